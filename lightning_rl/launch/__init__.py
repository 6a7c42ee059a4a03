"""Multi-node launch: SLURM and torchrun scripts rendered from recipes (the capacity planner is `lightning_rl.planner`)."""
