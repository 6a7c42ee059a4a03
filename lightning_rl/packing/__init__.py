"""Prefix-tree packing (pure tensors): the layout, its ancestor relation, loss terms, and row planning."""

from lightning_rl.packing.planner import RowPlan, plan_ordered_rows, plan_rows
from lightning_rl.packing.tree import PackedBatch, count_unique_tokens, pack_sequences

__all__ = ["PackedBatch", "RowPlan", "count_unique_tokens", "pack_sequences", "plan_ordered_rows", "plan_rows"]
