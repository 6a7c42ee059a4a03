"""With ``loss.beta > 0`` the frozen reference scores each packed row as the policy does: the same tree (a group's
prompt once per row), forwarded without gradients; never the sequences one by one or packed flat."""

from __future__ import annotations

import lightning as L
import torch
from support.grpo import fit

from lightning_rl.losses import GRPOLoss


class TreeForwards(L.Callback):
    """Records, for the policy and the reference, the tokens of every forward that carries a packed row's tree."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[int, bool]]] = {"policy": [], "reference": []}

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        for name in self.calls:
            def record(module, args, kwargs, name=name) -> None:
                if kwargs.get("tree_attention") is not None:
                    self.calls[name].append((int(kwargs["input_ids"].shape[1]), torch.is_grad_enabled()))

            getattr(pl_module, name).register_forward_pre_hook(record, with_kwargs=True)


def test_the_reference_forwards_the_policys_packed_tree():
    forwards = TreeForwards()
    # Sub-groups (each row holds its prompt); a group whose prompt is forwarded once across rows: test_prefix_rows.py.
    module, trainer = fit(1, [forwards], batch_size=2, loss=GRPOLoss(beta=0.04), max_tokens_per_row=48, verify_packing="never", prefix_across_rows="never")
    rows = int(trainer.callback_metrics["train/rows"])
    assert rows >= 2 and float(trainer.callback_metrics["train/packing_ratio"]) > 1  # rows that are trees
    policy, reference = forwards.calls["policy"], forwards.calls["reference"]
    # The reference's first tree forward is its packing probe (the policy's ran as the fit started, before this
    # records); then one forward per row each, the same rows in the same order.
    assert [tokens for tokens, _ in policy] == [tokens for tokens, _ in reference[1:]] and len(reference) == 1 + rows
    assert all(grad for _, grad in policy) and not any(grad for _, grad in reference)
