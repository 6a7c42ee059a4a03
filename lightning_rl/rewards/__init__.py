"""Reward functions: built-ins, loading by dotted path, and weighted scoring of rollouts."""

from lightning_rl.rewards.arguments import TrainerState
from lightning_rl.rewards.scoring import NO_REWARD_COLUMNS, ROLLOUT_COLUMNS, RewardError, RewardScorer, RewardSpec, Scores

__all__ = ["NO_REWARD_COLUMNS", "ROLLOUT_COLUMNS", "RewardError", "RewardScorer", "RewardSpec", "Scores", "TrainerState"]
