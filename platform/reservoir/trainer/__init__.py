"""The trainer: algorithm pieces (advantages, policy losses, KL), the training loop, checkpoints."""
