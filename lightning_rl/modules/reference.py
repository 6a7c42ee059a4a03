"""GRPO's reference model (``loss.beta != 0``): the frozen base the KL penalty is taken against.

Full fine-tuning keeps a frozen copy of the base beside the policy, sharded as the policy is, which TR-DPO
(``ref_sync_every``) moves towards the policy. With LoRA the base is the policy itself with its adapters off, as
TRL takes it: its weights are the frozen base's, so no second copy is held in memory or written to checkpoints.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from lightning_rl.models.loading import base_model


def reference_model(policy: torch.nn.Module, reference: torch.nn.Module | None) -> contextlib.AbstractContextManager[torch.nn.Module]:
    """The model the reference's log-probs come from, while the block runs: the frozen copy where one is held,
    else (LoRA) the policy as its base."""
    return contextlib.nullcontext(reference) if reference is not None else base_model(policy)


@torch.no_grad()
def refresh_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """TR-DPO: the reference moves ``alpha`` of the way to the policy (shard by shard under FSDP2, where both are
    sharded alike)."""
    weights = dict(policy.named_parameters())
    for unit in reference.modules():  # FSDP2 units of a model without a backward stay gathered after forward
        getattr(unit, "reshard", lambda: None)()
    for name, ref in reference.named_parameters():
        ref.lerp_(weights[name].to(ref.dtype), alpha)


def drop_base_copy(checkpoint: dict[str, Any]) -> None:
    """A LoRA run's checkpoint from before the base was read through the policy holds a copy of it under
    ``reference.``: the same weights as the policy's base, dropped so the run resumes."""
    weights = checkpoint.get("state_dict")
    if isinstance(weights, dict):
        for name in [name for name in weights if name.startswith("reference.")]:
            del weights[name]
