"""Wiring only: the suite's pytest plugin lives in the lora_suite package (lora_suite/harness/pytest_plugin.py)."""

pytest_plugins = ("lora_suite.harness.pytest_plugin",)
