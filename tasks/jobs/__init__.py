"""The runtime every torchrun job shares: the world, sharding, checkpoints, the launchers, the job log
and environment. Pretraining and fine-tuning stand on it side by side; it imports neither."""
