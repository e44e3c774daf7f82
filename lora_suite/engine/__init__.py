"""The training engine: models and architecture families, data, prepare, the probe block, trainer, optimizer,
capture, checkpoints and resumes, gradients. What judges a run lives one layer up, in ``lora_suite.judges``."""
