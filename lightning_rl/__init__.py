"""lightning-rl: SFT and GRPO post-training on the Lightning stack, with prefix-tree packing."""

__version__ = "0.1.0"
