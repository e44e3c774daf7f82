"""The modules of the suite's pytest plugin, one concern each; ``lora_suite.harness.pytest_plugin`` registers them."""
