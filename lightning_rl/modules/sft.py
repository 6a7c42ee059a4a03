"""Supervised fine-tuning as a LightningModule.

One training step: a packed row (examples side by side, shared prefixes once) goes through the model
with tree attention, the chunked LM head gives log p(target) for the trained tokens only. The loss of an
optimizer step is the mean negative log-probability over every trained token of the step: all its
accumulated micro-batches on all ranks (as transformers' Trainer computes it), not a mean of per-row
means, which would weigh a token of a short row more than one of a long row. Hardware, precision,
accumulation and clipping are the Trainer's business.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoConfig

from lightning_rl import validation
from lightning_rl.attention.tree_attention import AttentionBackend, PackingRefused
from lightning_rl.data.sft import BatchRows, GenerationCase
from lightning_rl.errors import RecipeError
from lightning_rl.models.loading import LoraSettings, TowerTraining, check_towers
from lightning_rl.models.multimodal import attends_within_images_both_ways, image_token_id
from lightning_rl.models.paths import check_model_source, model_context, resolve_model_path
from lightning_rl.modules.evaluation import HELDOUT_METRIC, check_cases_fit, exact_match, log_heldout
from lightning_rl.modules.optim import LrSchedule, check_schedule
from lightning_rl.modules.policy import ExportMode, PolicyModule, export_mode
from lightning_rl.ops.grad_norm import total_grad_norm
from lightning_rl.ops.packed_forward import PackingVerifier, VerifyPacking, across_rows_exact, packed_logprobs, unpacked_hint
from lightning_rl.ops.prefix_rows import PrefixedRow, finish_prefix, share_prefixes
from lightning_rl.packing.tree import PackedBatch


class SFTModule(PolicyModule):
    """SFT on packed rows with loss on assistant / completion tokens only.

    Args:
        model_name_or_path: a from_pretrained folder, or ``tiny`` for the embedded default. TRL: `model_name_or_path`.
        learning_rate, weight_decay, betas: AdamW's. TRL: `learning_rate`, `weight_decay`, `adam_beta1`, `adam_beta2`.
        warmup_steps, lr_schedule: linear warmup; then ``lr_schedule``, a ``transformers.get_scheduler`` schedule
            (``linear``, ``cosine``, ``cosine_with_restarts`` and ``polynomial`` run over the run's length, so need
            ``max_steps``). TRL: `warmup_steps`, `lr_scheduler_type`.
        lora: adapt with LoRA through peft instead of full fine-tuning.
        export: the final Hugging Face folder: ``model`` (full model), ``merged`` (LoRA merged into the
            base) or ``adapter`` (the LoRA adapter alone); default ``model``, or ``merged`` with LoRA.
        chunk_size: tokens per LM-head chunk (bounds the logits memory).
        attention_backend: tree attention kernel: ``auto`` (FlexAttention on CUDA, shape-only on XLA/Neuron, fused
            SDPA blocks elsewhere), ``blocks``, ``flex``, ``varlen`` (CUDA) or ``dense``.
        gradient_checkpointing: recompute each layer's activations in backward. TRL: `gradient_checkpointing`.
        offload_activations: keep the activations a forward saves for backward in host memory until then (less
            accelerator memory); with ``gradient_checkpointing`` only the layers' inputs. TRL: `activation_offloading`.
        compile: ``torch.compile`` each decoder layer for training (the tree attention inside stays eager).
        towers: an image-text model's vision (and audio) towers and projectors: ``frozen`` (default), ``train`` (in
            full), or ``lora`` (adapters there too, with ``lora``).
        verify_packing, verify_packing_every: compare a packed row with its sequences run one by one, on the real backend, device and
            dtype, and stop before any weight changes if they disagree: ``first_step`` (default: the first step a
            process trains, a resumed run's too, whose machine or kernels may differ), ``every_n_steps`` (every
            ``verify_packing_every`` optimizer steps) or ``never``. Logged as ``train/packing_error``.
        eval_generations: held-out prompts (``data.val_data``) greedily decoded for exact-match accuracy at each
            validation and after training: logged as ``val/exact_match``, the last in summary.json.
        max_new_tokens: decode budget for those generations.
    """

    def __init__(
        self,
        model_name_or_path: str = "tiny",
        learning_rate: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        lr_schedule: LrSchedule = "cosine",
        lora: LoraSettings | None = None,
        export: ExportMode | None = None,
        chunk_size: int = 1024,
        attention_backend: AttentionBackend = "auto",
        gradient_checkpointing: bool = False,
        offload_activations: bool = False,
        compile: bool = False,
        towers: TowerTraining = "frozen",
        verify_packing: VerifyPacking = "first_step",
        verify_packing_every: int = 100,
        eval_generations: int = 0,
        max_new_tokens: int = 32,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        validation.literal_arguments(SFTModule.__init__, self.hparams)
        check_model_source(model_name_or_path, loads=True)
        validation.finite_positive("learning_rate", learning_rate)
        validation.finite_non_negative("weight_decay", weight_decay)
        for i, beta in enumerate(betas):
            validation.fraction(f"betas[{i}]", beta)
        validation.non_negative_int("warmup_steps", warmup_steps)
        check_schedule(lr_schedule, learning_rate, warmup_steps)
        validation.positive_int("chunk_size", chunk_size)
        validation.positive_int("verify_packing_every", verify_packing_every)
        validation.non_negative_int("eval_generations", eval_generations)
        validation.positive_int("max_new_tokens", max_new_tokens)
        # This rank's sums since the last optimizer step: loss, trained tokens, forwarded (unique) and flat tokens,
        # entropy and tokens predicted right (the likeliest token); the held-out ones: loss, tokens, entropy, right.
        self._step_totals = torch.zeros(6, dtype=torch.float64)  # as the held-out sums: a 64-true loss is not rounded to float32
        self._val_totals = torch.zeros(4, dtype=torch.float64)
        self.step_loss: float | None = None  # the last optimizer step's loss, over its micro-batches and ranks
        self.lora = LoraSettings.checked(lora)  # the typed settings; the hparams keep plain values (a weights-only load reads them)
        self.hparams["lora"] = None if self.lora is None else asdict(self.lora)
        check_towers(towers, self.lora)
        self.export = export_mode(export, self.lora)
        self.packing_verifier = PackingVerifier(verify_packing, verify_packing_every)
        self._heldout: tuple[int, dict[str, Any]] | None = None  # the last evaluation: its step and figures
        self._backward_row: PackedBatch | None = None  # the row whose loss backpropagates next
        self._zeroed_early = False  # whether training_step zeroed this step's gradients (a batch of several rows)

    @property
    def model(self) -> torch.nn.Module | None:
        """The model being trained (the policy)."""
        return self.policy

    def setup(self, stage: str) -> None:
        self._heldout = None  # a figure of another Trainer's step (a second fit or validate) is not this one's
        # The datamodule is set up by now: generations asked of held-out data that has none are refused before a
        # model loads.
        n = self.hparams.eval_generations
        cases = getattr(self.trainer.datamodule, "generation_cases", None)
        if n and not cases:
            given = getattr(self.trainer.datamodule, "val_data", None)
            why = "data.val_data is not set" if given is None else f"data.val_data ({given}) has no conversation ending in a reply"
            raise RecipeError(f"eval_generations={n} needs held-out conversations to decode, but {why}", "eval_generations")
        if n:
            if n > len(cases) and self.trainer.is_global_zero:
                print(f"note: eval_generations={n}, but data.val_data has {len(cases)} held-out conversations ending in a reply: "
                      "all of them are decoded", file=sys.stderr)
            config = AutoConfig.from_pretrained(resolve_model_path(self.hparams.model_name_or_path))
            check_cases_fit(cases[:n], model_context(config), self.hparams.max_new_tokens, "max_new_tokens")

    def configure_model(self) -> None:
        if self.policy is None:
            self.policy = self.load_policy(self.hparams.model_name_or_path, self.lora)

    def _logprobs(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each trained token's log-prob, and the entropy and whether the likeliest token is it (TRL's figures)."""
        with unpacked_hint("data.packing", "example", packed=not batch.unpacked):
            return packed_logprobs(self.policy, batch, chunk_size=self.hparams.chunk_size, attention_backend=self.attention_backend(), return_stats=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._check_batch(batch)
        super().on_train_batch_start(batch, batch_idx)

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._check_batch(batch)

    def _check_batch(self, batch: Any) -> None:
        if not isinstance(batch, (PackedBatch, BatchRows)):
            source = type(self.trainer.datamodule).__name__ if self.trainer.datamodule is not None else "the data given"
            raise RecipeError(f"SFT trains on the packed rows of SFTDataModule, got a batch of {type(batch).__name__} from {source}", "data")

    def _rows(self, batch: PackedBatch | BatchRows) -> list[PackedBatch]:
        """A batch's rows (``data.max_tokens_per_row``), each span's prefix cut off and shared (`ops.prefix_rows`), its
        images with it; a model or kernel that cannot continue a prefix exactly, or whose image tokens attend both
        ways where a span's row or nested prefix holds images of its own, takes the batch's sub-groups under
        ``auto``, and is refused in one line under ``always``."""
        if isinstance(batch, PackedBatch) or not any(batch.prefixes):
            return [batch] if isinstance(batch, PackedBatch) else batch.rows
        why, rows = None, None
        if not across_rows_exact(self.policy, self.attention_backend()):
            why = f"it cannot continue a prefix forwarded apart exactly ({self.attention_backend()} attention)"
        else:
            try:
                rows = share_prefixes(batch.rows, batch.prefixes, recompute=self.hparams.gradient_checkpointing, image_token_id=image_token_id(self.policy.config))
            except PackingRefused as refused:  # in the words of the rows' refusal, naming SFT's key
                if batch.apart is None:
                    raise PackingRefused(str(refused).replace("model.prefix_across_rows", "data.prefix_across_rows")) from None
                return batch.apart.rows
            else:
                if attends_within_images_both_ways(self.policy) and any(_own_images(row) for row in rows):
                    why = "its image tokens attend to each other both ways, which a span does not compute in a row or nested prefix holding images of its own"
        if why is None:
            return rows
        if batch.apart is None:  # prefix_across_rows: always
            raise PackingRefused(f"{type(self.policy).__name__}: {why}; set data.prefix_across_rows: never")
        return batch.apart.rows

    def training_step(self, batch: PackedBatch | BatchRows, batch_idx: int) -> dict[str, Any]:
        rows = self._rows(batch)
        # Lightning zeroes the gradients after a step's first training_step, where the rows but the last have
        # backpropagated already: they are zeroed before, and Lightning's left out (optimizer_zero_grad).
        self._zeroed_early = len(rows) > 1 and batch_idx % self.trainer.accumulate_grad_batches == 0
        if self._zeroed_early:
            self.optimizers().zero_grad()
        if self.packing_verifier.due(self.global_step) and not rows[0].unpacked:  # an unpacked row is the model's own forward
            checked = next((row for row in rows if isinstance(row, PrefixedRow)), rows[0])  # a span's row checks its prefix too
            with unpacked_hint("data.packing", "example"):
                error = self.packing_verifier.check(
                    self.policy, checked, step=self.global_step, backend=self.attention_backend(), strategy=self.trainer.strategy, chunk_size=self.hparams.chunk_size
                )
            self.log_check("train/packing_error", error)
        # Under DDP the last row backpropagates here too, and Lightning's backward is of zero from every parameter: the
        # step's one synchronised backward, which reduces the gradients every row and prefix left (`reduced_by_ddp`).
        in_step = len(rows) > 1 and isinstance(self.trainer.strategy.model, DistributedDataParallel)
        loss_sum = batch_loss = trained = unique = flat = 0
        for k, row in enumerate(rows):
            if k:  # the row before backpropagates now, within this batch; Lightning backpropagates the last (but under DDP)
                self.trainer.strategy.backward(loss_sum / self.trainer.accumulate_grad_batches, None)
            logprobs, entropy, hits = self._logprobs(row)
            self._backward_row = row  # its span's prefix backpropagates after the span's last row (on_after_backward)
            # Backward runs on the sum; on_before_optimizer_step divides by the step's trained tokens.
            loss_sum = -logprobs.sum()
            # A rank's empty batch (one token, run so that every rank runs as many) trains and counts nothing: every
            # example's row trains a token.
            counts = (logprobs.numel(), row.num_unique_tokens, row.num_flat_tokens) if logprobs.numel() else (0, 0, 0)
            on = torch.tensor(counts, dtype=torch.float64, device=loss_sum.device)
            sums = torch.stack([loss_sum.detach().double(), *on, entropy.sum().double(), hits.sum().double()])
            self._step_totals = self._step_totals.to(loss_sum.device) + sums
            batch_loss, trained, unique, flat = batch_loss + loss_sum.detach(), trained + counts[0], unique + counts[1], flat + counts[2]
        if in_step:
            self.trainer.strategy.backward(loss_sum / self.trainer.accumulate_grad_batches, None)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        reported = batch_loss / max(trained, 1)  # 0 for a rank's empty batch
        return {"loss": self.reduced_by_ddp() if in_step else loss_sum, "reported_loss": reported, "tokens": unique, "flat_tokens": flat}

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Lightning's, but for a batch of several rows that ``training_step`` zeroed before its rows ran (a callback's
        ``on_before_zero_grad`` then sees them, not the last step's)."""
        if not self._zeroed_early:
            optimizer.zero_grad()
        self._zeroed_early = False

    def on_after_backward(self) -> None:
        row, self._backward_row = self._backward_row, None
        if row is not None:
            finish_prefix(row)  # a span's last row: one backward through its prefix

    def on_validation_epoch_start(self) -> None:
        self._val_totals = torch.zeros(4, dtype=torch.float64)

    def validation_step(self, batch: PackedBatch | BatchRows, batch_idx: int) -> None:
        for row in self._rows(batch):
            logprobs, entropy, hits = self._logprobs(row)
            self._val_totals += torch.tensor([-logprobs.sum().item(), logprobs.numel(), entropy.sum().item(), hits.sum().item()], dtype=torch.float64)

    def on_validation_epoch_end(self) -> None:
        # Every rank's summed loss over every rank's tokens, divided once (Lightning's batch-size weighting averaged
        # the ranks' token counts as integers, so a count that did not divide by the ranks read low, or 0: inf).
        loss_sum, tokens, entropy, hits = self.trainer.strategy.reduce(self._val_totals.to(self.device), reduce_op="sum").tolist()
        if tokens > 0:
            self.log("val/loss", loss_sum / tokens, prog_bar=True)
            self.log_dict({"val/entropy": entropy / tokens, "val/mean_token_accuracy": hits / tokens})
        if self.hparams.eval_generations and not self.trainer.sanity_checking:
            self.heldout(in_validation=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning divided each micro-batch's sum by accumulate_grad_batches and the strategy averaged the
        # gradients over ranks; rescale so the gradient is that of the step's token mean.
        # The step's figures are over its every micro-batch and rank (TRL's), not the last micro-batch's.
        loss_sum, tokens, unique, flat, entropy, hits = self.trainer.strategy.reduce(self._step_totals, reduce_op="sum").tolist()
        self._step_totals = torch.zeros_like(self._step_totals)
        self.log_dict({"train/trained_tokens": tokens, "train/unique_tokens": unique, "train/flat_tokens": flat,
                       "train/packing_ratio": flat / max(unique, 1.0)})  # fmt: skip
        if tokens > 0:
            self.log_dict({"train/entropy": entropy / tokens, "train/mean_token_accuracy": hits / tokens})
            scale = self.trainer.accumulate_grad_batches * self.trainer.world_size / tokens
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
            self.step_loss = loss_sum / tokens  # summary.json's, as logged
            wide = torch.float64 if self.policy.dtype == torch.float64 else torch.float32  # a float is logged as float32
            self.log("train/loss", torch.tensor(self.step_loss, dtype=wide), prog_bar=True)
        if any(p.grad is not None for p in self.parameters()):
            self.log("train/grad_norm", total_grad_norm(self.parameters()))

    def exact_match_accuracy(self, cases: list[GenerationCase], tokenizer: Any) -> dict[str, float]:
        """Greedy-decode held-out prompts; the fraction whose completion equals the reference exactly."""
        return exact_match(self.policy, tokenizer, cases, max_new_tokens=self.hparams.max_new_tokens)

    def heldout(self, in_validation: bool = False) -> dict[str, Any]:
        """The held-out figures of the policy at this step, evaluated (and logged) once per step: in a validation,
        through Lightning, so ``val/exact_match`` is logged at the step ``val/loss`` is."""
        if self._heldout is None or self._heldout[0] != self.global_step:
            datamodule = self.trainer.datamodule
            figures = self.exact_match_accuracy(datamodule.generation_cases[: self.hparams.eval_generations], datamodule.tokenizer)
            if not in_validation:
                log_heldout(self, figures)
            self._heldout = (self.global_step, figures)
        if in_validation:  # logged in every validation, a figure of this step computed earlier too
            self.log(HELDOUT_METRIC, self._heldout[1]["heldout_exact_match"])  # every rank computed the same figure
        return self._heldout[1]

    def summary_metrics(self) -> dict[str, Any]:
        """Figures for summary.json beyond the generic ones: held-out accuracy and packing used."""
        metrics: dict[str, Any] = {"packing": getattr(self.trainer.datamodule, "resolved_packing", None)}
        if self.hparams.eval_generations:
            metrics.update(self.heldout())
        return metrics

    def export_hf(self, path: Path, write: bool = True) -> Path:
        """Write the final Hugging Face folder (model, merged model or adapter, plus tokenizer); on no Trainer (a
        module from ``load_from_checkpoint``), with the model's own tokenizer."""
        datamodule = self.attached_datamodule
        if datamodule is None:
            return self.export_policy(self.model_tokenizer(), path, mode=self.export, data=None, write=write)
        tokenizer = getattr(datamodule, "processor", None) or datamodule.tokenizer  # an image-text model ships its processor
        return self.export_policy(tokenizer, path, mode=self.export, data=getattr(datamodule, "train_data", None), write=write)


def _own_images(row: PackedBatch) -> bool:
    """Whether a span's row, or a nested prefix of its chain, holds images after the prefix above it."""
    if not isinstance(row, PrefixedRow):
        return False
    return bool(row.image_inputs) or any(prefix.batch.image_inputs for prefix in row.prefix.chain if prefix.parent is not None)
