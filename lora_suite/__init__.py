"""lora_suite: the harness that judges a LoRA implementation on the GPU (configs, models, data, trainer,
checkpoints, memory, criteria, parity, timing, reports, the regression gate). It imports ``lora_core``,
the system under test; ``lora_core`` never imports it (tests/test_import_boundary.py)."""
