"""The training engine: models, data, prepare, trainer, optimizer, checkpoint, gradients, parity."""
