"""Multi-node launch: SLURM scripts rendered from recipes, and a memory/step-time planner."""
