"""Training: gradient sync, checkpoints and export, data, LoRA, the sync-tax meter, the training loops."""
