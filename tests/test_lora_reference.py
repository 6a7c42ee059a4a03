"""With LoRA and ``loss.beta > 0`` the reference is the policy's base read through the policy itself (its adapters
off, in eval mode), as TRL takes it: no frozen copy in memory or in checkpoints, and the same numbers as one."""

from __future__ import annotations

import lightning as L
import torch
from support.grpo import LENGTH_REWARD, fit

from lightning_rl.losses import GRPOLoss
from lightning_rl.models.loading import LoraSettings, base_model, load_causal_lm
from lightning_rl.models.paths import resolve_model_path

LORA = dict(lora=LoraSettings(r=4, alpha=8), loss=GRPOLoss(beta=0.5), learning_rate=5e-2, rewards=LENGTH_REWARD)


class HeldCopy(L.Callback):
    """Gives the module a frozen copy of the base as its reference, as full fine-tuning holds one (the random
    state kept as it was, so both runs sample alike)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        with torch.random.fork_rng():
            pl_module.reference = load_causal_lm(resolve_model_path("tiny")).eval().requires_grad_(False)


class KL(L.Callback):
    def __init__(self) -> None:
        self.kl: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.kl.append(float(trainer.callback_metrics["train/kl"]))


def adapters(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.policy.named_parameters() if "lora_" in name}


def test_the_policys_base_is_the_reference_a_frozen_copy_would_be(tmp_path):
    read, held = KL(), KL()
    module, trainer = fit(3, [read], **LORA)
    assert module.reference is None  # no second copy of the model
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert not [name for name in torch.load(tmp_path / "run.ckpt", weights_only=False)["state_dict"] if name.startswith("reference.")]
    copied, _ = fit(3, [held, HeldCopy()], **LORA)
    assert copied.reference is not None
    assert read.kl[-1] > 1e-4  # the adapters moved the policy away from its base: the reference counts
    torch.testing.assert_close(read.kl, held.kl, rtol=1e-5, atol=1e-7)
    ours, theirs = adapters(module), adapters(copied)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)
    assert module.policy.training and all(m.training for m in module.policy.modules())  # its modes as they were


def test_a_checkpoint_holding_a_copy_of_the_base_resumes(tmp_path):
    """An older LoRA run wrote the base's copy under ``reference.``: the same weights, dropped on resume."""
    module, trainer = fit(1, **LORA)
    trainer.save_checkpoint(tmp_path / "old.ckpt")
    checkpoint = torch.load(tmp_path / "old.ckpt", weights_only=False)
    base = load_causal_lm(resolve_model_path("tiny")).state_dict()
    checkpoint["state_dict"].update({f"reference.{name}": weight for name, weight in base.items()})
    torch.save(checkpoint, tmp_path / "old.ckpt")
    resumed, run = fit(2, ckpt_path=str(tmp_path / "old.ckpt"), **LORA)
    assert run.global_step == 2 and resumed.reference is None


def test_base_model_turns_the_adapters_and_dropout_off_and_restores_each_modules_mode():
    policy = load_causal_lm(resolve_model_path("tiny"), lora=LoraSettings(r=4, alpha=8, dropout=0.5))
    base = load_causal_lm(resolve_model_path("tiny")).eval()
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # adapters that change the output
    policy.train()
    policy.base_model.model.lm_head.eval()  # a module left in eval mode on purpose
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert not torch.allclose(policy(ids).logits, base(ids).logits)
        with base_model(policy) as taken:
            assert not any(m.training for m in taken.modules())
            torch.testing.assert_close(taken(ids).logits, base(ids).logits, rtol=0, atol=1e-6)
    assert [m.training for m in policy.modules()] == [m is not policy.base_model.model.lm_head for m in policy.modules()]


def test_a_prefix_shared_across_rows_is_forwarded_apart_for_the_base_and_the_adapted_policy():
    """Rows of a group share its prompt's keys and values, kept per model forward: the packing check (eval mode,
    no gradients, adapters on) and the reference (the same, adapters off) read one entry, and whichever ran second
    attended to the other's prefix (a KL of neither model, or a false packing refusal)."""
    from lightning_rl.ops.packed_forward import packed_logprobs, verify_row
    from lightning_rl.ops.prefix_rows import share_prefixes
    from lightning_rl.packing import pack_sequences

    policy = load_causal_lm(resolve_model_path("tiny"), lora=LoraSettings(r=4, alpha=8))
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # a trained adapter
    policy.train()
    sequences = [list(range(3, 12)) + [20 + k, 30 + k] for k in range(4)]
    masks = [[t >= 9 for t in range(len(s))] for s in sequences]

    def rows():
        return share_prefixes([pack_sequences(sequences[:2], masks[:2]), pack_sequences(sequences[2:], masks[2:])], [(0, 8), (0, 8)])

    def reference(row):
        with torch.no_grad(), base_model(policy) as base:
            return packed_logprobs(base, row)

    alone, shared = reference(rows()[0]), rows()
    verify_row(policy, shared[0])  # the packing check first, as a step runs it
    torch.testing.assert_close(reference(shared[0]), alone, rtol=0, atol=1e-6)
    first = rows()
    reference(first[0])  # the reference first, as num_iterations > 1 takes it
    assert verify_row(policy, first[0])[0] < 1e-5
