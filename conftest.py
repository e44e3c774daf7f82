"""Wiring only: the suite's pytest plugin lives in the lora_suite package (lora_suite/pytest_plugin.py)."""

pytest_plugins = ("lora_suite.pytest_plugin",)
