"""SFT batches cut into rows (``data.max_tokens_per_row``): the toy conversations all open with the same system
prompt, so a batch's rows share it. Forwarded once across the rows (``prefix_across_rows: always``) or again in each
(``never``), the step's gradient and loss are those of the whole batch in one row, under the tree-packing tolerances
(fp32: log-probs 1e-5, gradients 1e-4 relative)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy

from support.paths import TOY_HELDOUT, TOY_TRAIN

from lightning_rl.data.sft import BatchRows, SFTDataModule
from lightning_rl.errors import RecipeError
from lightning_rl.modules import sft as sft_module
from lightning_rl.modules.sft import SFTModule
from lightning_rl.packing.planner import plan_batch_rows
from lightning_rl.rollout.vllm_server_process import free_port
from lightning_rl.strategies import FSDP2Strategy

TESTS = Path(__file__).parent


class Figures(Callback):
    """Each step's gradients (before SFT's rescaling by the step's tokens, the same in every run compared) and figures."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.rows: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.rows.append(len(batch.rows) if isinstance(batch, BatchRows) else 1)

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None})


def fit(per_row, setting="auto", accumulate=1, checkpointing=False, steps=1, precision="32-true"):
    data = SFTDataModule(TOY_TRAIN, TOY_HELDOUT, max_tokens=256, max_tokens_per_row=per_row, prefix_across_rows=setting, shuffle=False)
    module = SFTModule(learning_rate=1e-2, gradient_checkpointing=checkpointing)
    figures = Figures()
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      max_steps=steps, accumulate_grad_batches=accumulate, precision=precision, limit_val_batches=2, val_check_interval=accumulate, callbacks=[figures])
    trainer.fit(module, datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return figures, metrics


def worst(grads, reference) -> float:
    """The largest difference of any tensor's gradient, relative to that tensor's largest."""
    return max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in reference.items())


def test_rows_sharing_a_prefix_train_as_one_row(monkeypatch):
    whole, whole_metrics = fit(None)
    assert whole.rows == [1]
    for setting in ("always", "never"):
        rows, metrics = fit(80, setting)
        assert rows.rows[0] >= 3  # the batch was cut
        assert worst(rows.grads[0], whole.grads[0]) < 1e-4, setting
        for key in ("train/loss", "val/loss"):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5), (setting, key)
        if setting == "always":
            spanned = metrics["train/unique_tokens"]
        else:  # each row forwarded the system prompt again
            assert metrics["train/unique_tokens"] > spanned + 50
    assert spanned < whole_metrics["train/unique_tokens"] + 20  # the prompt forwarded once, and little else more
    # The control: no backward through the prefix after the span's last row, and the gradients are wrong.
    monkeypatch.setattr(sft_module, "finish_prefix", lambda row: None)
    broken, _ = fit(80, "always")
    assert worst(broken.grads[0], whole.grads[0]) > 1e-2


def test_rows_under_accumulation_and_gradient_checkpointing():
    whole, whole_metrics = fit(None, accumulate=2)
    rows, metrics = fit(80, "always", accumulate=2, checkpointing=True)
    assert min(rows.rows) >= 3
    assert worst(rows.grads[0], whole.grads[0]) < 1e-4
    assert metrics["train/loss"] == pytest.approx(whole_metrics["train/loss"], rel=1e-5)


def test_a_recomputed_prefix_runs_again_under_the_forward_autocast():
    """A span's last row is backpropagated after the training step returned, outside Lightning's autocast: its prefix,
    forwarded again for that backward (gradient checkpointing), takes the first forward's precision (it took fp32)."""
    kept, _ = fit(80, "always", precision="bf16-mixed")
    recomputed, _ = fit(80, "always", checkpointing=True, precision="bf16-mixed")
    assert worst(recomputed.grads[0], kept.grads[0]) < 1e-6


def test_a_batch_is_cut_by_first_token_and_shared_prefix():
    prompt = list(range(100, 140))
    sequences = [prompt + [1, 2, 3, 4, 5, 6, 7, 8] for _ in range(6)] + [[7, 8, 9]]
    masks = [[False] * 40 + [True] * 8 for _ in range(6)] + [[False, True, True]]
    rows, prefixes = plan_batch_rows(sequences, masks, 30, "always")
    assert sorted(i for row in rows for i in row) == list(range(7))
    spans = [p for p in prefixes if p is not None]
    assert spans and all(length == 39 for _, length in spans)  # up to the first trained token's input
    assert all(p is None for row, p in zip(rows, prefixes) if 6 in row)  # another first token: another group
    # Sub-groups each repeat the prompt: no row of 30 holds it, so never refuses where always fits.
    with pytest.raises(ValueError, match="more than max_tokens=30"):
        plan_batch_rows(sequences, masks, 30, "never")


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(max_tokens=64, max_tokens_per_row=128), "max_tokens_per_row"),
        (dict(max_tokens=128, max_tokens_per_row=64, packing="none"), "max_tokens_per_row"),
        (dict(max_tokens=128, max_tokens_per_row=64, max_length=100), "max_length"),
        (dict(max_tokens=128, max_tokens_per_row=64, prefix_across_rows="sometimes"), "prefix_across_rows"),
        (dict(max_tokens=128, prefix_across_rows="always"), "prefix_across_rows"),  # a batch of one row: nothing to share across
    ],
)
def test_row_settings_refused_in_one_line(kwargs, key):
    with pytest.raises(RecipeError) as refused:
        SFTDataModule(TOY_TRAIN, **kwargs)
    assert refused.value.key == key and "\n" not in str(refused.value)


def test_rows_refused_where_they_cannot_run():
    flat = SFTDataModule(TOY_TRAIN, max_tokens=256, max_tokens_per_row=80, packing="flat", prefix_across_rows="always")
    with pytest.raises(RecipeError, match="packing: flat shares no prefix"):
        flat.setup("fit")
    # FSDP2 gathers and reduces shards in every row's forward and backward, in step with ranks whose batches may hold
    # more or fewer rows (the Trainers are built, never run); DDP runs them.
    def two(strategy) -> SFTDataModule:
        data = SFTDataModule(TOY_TRAIN, max_tokens=256, max_tokens_per_row=80)
        data.trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        return data

    with pytest.raises(RecipeError, match=r"which 2 processes run under DDP \(without static_graph\) alone, not FSDP2Strategy \("):
        two(FSDP2Strategy()).setup("fit")
    # DDP's static graph fixes from the first iteration how often each gradient is reduced.
    with pytest.raises(RecipeError, match="not DDPStrategy with static_graph"):
        two(DDPStrategy(static_graph=True)).setup("fit")
    accepted = two("ddp")
    accepted.setup("fit")
    assert accepted.train_examples


def test_rows_on_two_ranks_give_the_gradient_of_one_process_on_both_batches(tmp_path):
    """Under DDP every row and each span's prefix backpropagate without DDP's reduction, and the step's one
    synchronised backward reduces them all: the gradient of one process taking both ranks' batches (rank r trains
    every 2nd batch from r) as one step of two micro-batches."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(TESTS)}
    subprocess.run([sys.executable, str(TESTS / "support" / "sft_rows_ddp.py"), str(tmp_path)], env=env, check=True, timeout=600, cwd=TESTS.parent)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(rank["rows"][0] >= 3 for rank in ranks)  # each rank's batch was cut, its rows sharing the system prompt
    one, metrics = fit(80, "always", accumulate=2)
    for rank in ranks:
        assert worst(rank["grads"], one.grads[0]) < 1e-4
        assert rank["loss"] == pytest.approx(metrics["train/loss"], rel=1e-5)
