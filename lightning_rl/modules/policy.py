"""What SFT and GRPO share: the policy being trained and how it is built, its attention backend, the optimizer and
its schedule, gradient clipping over every mesh, what wrote a checkpoint and the checks on resume, and the Hugging Face
export."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoTokenizer

from lightning_rl.attention.tree_attention import choose_backend
from lightning_rl.callbacks import ScheduleOnResume, StopOnNonFinite, ValidationOnResume
from lightning_rl.checkpoints import RESUME_KEYS, ForeignCheckpointError, check_weights_fit, every_ranks, this_ranks
from lightning_rl.device_policy import requires_static_shapes, resolve_pad_to_multiple_of, wraps_in_ddp
from lightning_rl.errors import RecipeError
from lightning_rl.models.loading import LoraSettings, export_hf, load_causal_lm
from lightning_rl.models.multimodal import load_processor
from lightning_rl.models.paths import EMBEDDED, resolve_model_path
from lightning_rl.models.structure import auto_model_class, compile_decoder_layers
from lightning_rl.models.weights import export_merge_refusal
from lightning_rl.modules.model_card import data_name, key_settings, model_card
from lightning_rl.modules.optim import adamw_with_schedule
from lightning_rl.ops.grad_norm import clip_grad_norm, total_grad_norm
from lightning_rl.ops.random_state import RandomState
from lightning_rl.ops.packed_forward import check_packable, unpacked_hint
from lightning_rl.ops.prefix_rows import reduce_after_rows
from lightning_rl.ops.saved_activations import OffloadedForwards
from lightning_rl.strategies.fsdp2 import FSDP2Strategy, loads_weights_sharded


ExportMode = Literal["model", "merged", "adapter"]
WRITER = "written_by"  # the checkpoint key of what wrote it (``PolicyModule.writer``)
RANDOM_STATE = "random_state"  # ... and of each rank's random state (dropout), where the run stood
_CLI_KEYS = {"_instantiator", "_class_path"}  # what LightningCLI adds to the saved hyperparameters


# The optimizer's settings that a checkpoint restores with its state (Lightning loads its parameter groups whole).
_OPTIMIZER_KEYS = ("learning_rate", "weight_decay", "betas")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def export_mode(export: ExportMode | None, lora: LoraSettings | None) -> ExportMode:
    """The final folder's kind (the ``export`` key): as given, where ``merged`` and ``adapter`` need a LoRA; by
    default the full model, or a LoRA merged into it."""
    if export in ("merged", "adapter") and lora is None:
        raise RecipeError(f"export={export!r} needs a model.lora block", "export")
    return export or ("merged" if lora is not None else "model")


class PolicyModule(LightningModule):
    """A training module around one policy. Subclasses keep in ``hparams`` the keys read here:
    ``attention_backend``, ``compile``, ``towers``, ``gradient_checkpointing``, ``offload_activations``, ``learning_rate``,
    ``weight_decay``, ``lr_schedule``, ``warmup_steps`` (and ``betas``, if they have it), and their LoRA settings in
    ``self.lora`` (or None)."""

    def __init__(self) -> None:
        super().__init__()
        self.policy: torch.nn.Module | None = None
        self._backends: dict[torch.device, str] = {}
        self.offloaded: OffloadedForwards | None = None  # with offload_activations: what the latest forward moved
        self._resumed_random: RandomState | None = None  # a checkpoint's, until the resumed run's first step
        self._unwritten: dict[str, float] = {}  # log_check's figures of this step, until on_train_batch_end
        # Set by the command for --ckpt_path=last (a requeued job's, which starts with the same command every time):
        # a newest checkpoint with nothing left to train writes the run's end (held-out score, summary.json, hf/)
        # again, where a kill may have cut it, instead of being refused.
        self.finish_when_trained = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """A resumed run's first step draws its dropout masks from the random state the checkpoint kept, as the
        uninterrupted run's did (the data loaders draw from generators of their own, so nothing draws from it in
        between). A step's figures are those logged during it. Lightning logs every training figure logged so far in the epoch
        at each step (a GRPO run is one long epoch), so one logged at some steps only (a packing check's error, a
        failure count, a fresh batch's mismatch) would repeat its last value at every later step: at each step's first
        micro-batch, those logged for a step alone are forgotten."""
        if self._resumed_random is not None:
            self._resumed_random.restore()
            self._resumed_random = None
        if batch_idx % self.trainer.accumulate_grad_batches:
            return
        connector = self.trainer._logger_connector
        for result in (self.trainer._results or {}).values():
            if result.meta.on_step and not result.meta.on_epoch and not result.has_reset:
                result.reset()
                for cached in (connector._progress_bar_metrics, connector._callback_metrics):
                    cached.pop(result.meta.name, None)

    def log_check(self, name: str, value: float) -> None:
        """Log a figure measured on some steps only (a packing check) at its own step: ``self.log`` alone reaches the
        loggers only on the steps ``trainer.log_every_n_steps`` writes, and dropped it on the others, where
        ``on_train_batch_end`` writes it."""
        self.log(name, value)
        self._unwritten[name] = float(value)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """A check's figure on a step Lightning does not write, written at that step (after the callbacks, so a stop one
        of them asks for, which makes Lightning write the step, is known: it is written once, either way)."""
        if self._unwritten:
            connector = self.trainer._logger_connector
            if not connector.should_update_logs and self.trainer.log_every_n_steps:  # 0: no step logging at all
                connector.log_metrics(dict(self._unwritten))  # Lightning's own writer: its step and epoch, every logger
            self._unwritten.clear()

    def load_policy(self, path: str, lora: LoraSettings | None) -> torch.nn.Module:
        """The model at ``path`` to train, in train mode: its weights read by each rank's own shards when the
        strategy loads them sharded, an image-text model's towers as ``towers`` says, each decoder layer recomputed
        in backward with ``gradient_checkpointing``, the activations its forward saves kept in host memory until
        backward with ``offload_activations``, each decoder layer compiled when ``compile`` is set. Both memory
        settings change no value: the loss and gradients are those without them."""
        hp = self.hparams
        policy = load_causal_lm(
            path, lora=lora, gradient_checkpointing=hp.gradient_checkpointing, defer_weights=self.loads_sharded(), towers=hp.towers
        )
        policy.train()  # from_pretrained returns the model in eval mode
        sharded = self._trainer is not None and isinstance(self.trainer.strategy, FSDP2Strategy)
        if lora is not None and getattr(self, "export", None) == "merged" and (problem := export_merge_refusal(policy, sharded)):
            raise RecipeError(f"export: merged: {problem}; set model.export: adapter (the adapter alone, loaded with its base)", "export")
        if hp.offload_activations:
            self.offloaded = OffloadedForwards(policy)
        if hp.compile:
            compile_decoder_layers(policy)
        if self._trainer is not None and wraps_in_ddp(self.trainer.strategy):
            reduce_after_rows(policy)  # its rows backpropagate in `rows_reduced_once`
        return policy

    @contextlib.contextmanager
    def rows_reduced_once(self) -> Iterator[None]:
        """A step's rows and their prefixes backpropagate inside without DDP's reduction, and one synchronised backward
        after them reduces every gradient they left (DDP reduces what the gradients hold: `reduced_by_ddp`). A span's
        prefix backpropagates after its rows, outside any backward the strategy runs, and a rank's rows and spans need
        not number another's: one reduction a step reduces each of them once, in step with every rank. Under other
        strategies, and DDP with ``static_graph``, the backward passes run as they are, each reduced (and spans are
        refused: `ops.prefix_rows.reduce_after_rows` is declared under DDP alone)."""
        strategy = self.trainer.strategy
        if not isinstance(strategy.model, DistributedDataParallel) or not wraps_in_ddp(strategy):  # static_graph: each backward reduced
            yield
            return
        with strategy.block_backward_sync():
            yield
        # Every rank runs as many rows (`rows_on_every_rank`), each reaching every parameter: none here, none anywhere.
        if any(p.grad is not None for p in self.parameters()):
            self.manual_backward(self.reduced_by_ddp())  # (callbacks' on_after_backward see it too)

    def reduced_by_ddp(self) -> torch.Tensor:
        """Zero, from every trainable parameter: a backward of it adds nothing to their gradients but reaches each, so
        DDP, whose hooks reduce a parameter's whole gradient in a synchronised backward, reduces them all (those that
        backward passes without its reduction left: `rows_reduced_once`)."""
        return torch.stack([p.reshape(-1)[0].float() for p in self.parameters() if p.requires_grad and p.numel()]).sum() * 0.0

    def loads_sharded(self) -> bool:
        """Whether each rank reads only its own shards of the weights (the strategy's choice)."""
        return self._trainer is not None and loads_weights_sharded(self.trainer.strategy)

    def attention_backend(self) -> str:
        """The tree-attention kernel for this model where it now lives: chosen once per device (and the trainer's
        static-shape policy), not per row."""
        if self.device not in self._backends:
            static = self._trainer is not None and requires_static_shapes(self.trainer)
            self._backends[self.device] = choose_backend(self.hparams.attention_backend, self.device, static_shapes=static, dtype=self.policy.dtype, training=True)
        return self._backends[self.device]

    def check_packable(self) -> None:
        """What tree packing refuses in the policy, refused now (`ops.packed_forward.check_packable`); nothing for a
        policy whose rows are unpacked (GRPO's ``packing: none``)."""
        if self.hparams.get("packing") == "none":
            return
        with unpacked_hint("model.packing", "rollout"):
            check_packable(self.policy, attention_backend=self.attention_backend(), pad_to_multiple_of=self.row_multiple())

    def row_multiple(self) -> int | None:
        """What the rows this module packs itself are padded to a multiple of: 128 where the trainer's device compiles
        once per shape (XLA, Neuron, ``cpu_static``), else None."""
        return resolve_pad_to_multiple_of("auto", self.trainer) if self._trainer is not None else None

    def trainable(self) -> list[torch.nn.Parameter]:
        """The weights the optimizer steps."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: one; with weight decay, the weights it decays and, apart, the biases and
        norm weights it leaves alone, chosen as transformers' Trainer (and so TRL) chooses them."""
        if not self.hparams.weight_decay:
            return [{"params": self.trainable()}]
        from transformers import Trainer  # only here: importing it takes seconds

        decayed = set(Trainer.get_decay_parameter_names(None, self.policy))  # a method that reads only the model
        named = [(n, p) for n, p in self.policy.named_parameters() if p.requires_grad]
        return [{"params": [p for n, p in named if n in decayed]},
                {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}]  # fmt: skip

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        stepped = {p.dtype for group in self.parameter_groups() for p in group["params"]}
        if stepped & {torch.bfloat16, torch.float16} and hp.learning_rate < 1e-4 and self.global_rank == 0:
            print(f"note: trainer.precision {self.trainer.precision} steps 16-bit weights with no float32 copy: an update "
                  f"smaller than half a 16-bit step of a weight is lost, and at learning_rate {hp.learning_rate:g} most "
                  "are (bf16 keeps 8 bits); bf16-mixed keeps float32 weights", file=sys.stderr)
        text = self.policy.config.get_text_config()
        if getattr(text, "output_router_logits", False) and getattr(text, "router_aux_loss_coef", 0) and self.global_rank == 0:
            print(f"note: {hp.model_name_or_path}'s config asks for its router's auxiliary loss (output_router_logits: true, "
                  f"router_aux_loss_coef {text.router_aux_loss_coef:g}), which is not added here: the loss is the tokens' "
                  "alone (TRL adds it)", file=sys.stderr)
        return adamw_with_schedule(
            self.parameter_groups(), self.trainer, learning_rate=hp.learning_rate,
            weight_decay=hp.weight_decay, betas=hp.get("betas"), lr_schedule=hp.lr_schedule, warmup_steps=hp.warmup_steps,
        )  # fmt: skip

    def clip_gradients_over_meshes(self, max_norm: float | None) -> torch.Tensor:
        """Clip the gradient norm of every weight together, wherever it lives (expert slices have a mesh of their own);
        returns that norm, before clipping (``max_norm`` None: the norm only)."""
        if max_norm is None:
            return total_grad_norm(self.parameters())
        return clip_grad_norm(self.parameters(), max_norm)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        # Lightning's norm clipping stacks every gradient's norm, which fails once experts live on their own mesh.
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            self.clip_gradients_over_meshes(gradient_clip_val)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def writer(self) -> dict[str, Any]:
        """What a checkpoint of this module is, as plain data: the task, the model's kind, the LoRA layout and the
        optimizer's parameter groups (their sizes). A checkpoint of another one does not resume here."""
        config = self.policy.config
        lora = self.lora
        return {
            "task": type(self).__name__,
            "model": f"{config.model_type} ({', '.join(config.architectures or []) or type(self.policy).__name__})",
            "lora": None if lora is None else {"r": lora.r, "alpha": lora.alpha, "target_modules": lora.target_modules},
            "optimizer groups": [len(group["params"]) for group in self.parameter_groups()],
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[WRITER] = self.writer()
        checkpoint[RANDOM_STATE] = every_ranks(RandomState.now(self.device).plain())  # each rank's dropout draws

    def configure_callbacks(self) -> list[Callback]:
        """What keeps a run's numbers right under any Trainer, not only the command's (whose own instances these
        replace): no step on a non-finite loss or gradient norm, the schedule followed on a resume with another
        ``max_steps``, and a validation due at the checkpoint's step run on resume."""
        return [StopOnNonFinite(), ScheduleOnResume(), ValidationOnResume()]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._trainer is None:  # ``load_from_checkpoint``: the weights into a module built from its arguments, no run to resume
            self.check_writer(checkpoint, "the checkpoint")
            self._loaded_step = checkpoint.get("global_step")  # the model card's steps, exported with no Trainer
            return
        path = self.trainer.ckpt_path
        lacking = [key for key in RESUME_KEYS if key not in checkpoint]  # `run` refused such a file before the fit
        if isinstance(self.trainer.strategy, ModelParallelStrategy):  # it loaded a file's weights and optimizer already
            lacking = [key for key in lacking if key not in ("state_dict", "optimizer_states")]
        if lacking and path is not None and Path(path).is_file():  # a sharded one's parts are read by its strategy
            raise ForeignCheckpointError(f"ckpt_path: {path} holds no {lacking[0]}, so it cannot resume a run (saved with weights only, "
                                         "or by hand): resume from a checkpoint a run wrote")
        recorded = checkpoint.get(WRITER)
        # A run of this kind: its optimizer keys before its layout (weight_decay 0 or not groups the parameters
        # otherwise); an older checkpoint, which records no layout, once the kind is told by its arguments.
        same_kind = isinstance(recorded, dict) and {**recorded, "optimizer groups": None} == {**self.writer(), "optimizer groups": None}
        if same_kind:
            self._check_optimizer_keys(checkpoint, path)
        self.check_writer(checkpoint, path)
        check_weights_fit(checkpoint, self, path)
        if RANDOM_STATE in checkpoint:  # absent from an older checkpoint
            self._resumed_random = RandomState.from_plain(this_ranks(checkpoint[RANDOM_STATE], self.trainer, lambda _: False), self.device)
        if not same_kind:
            self._check_optimizer_keys(checkpoint, path)
        step, max_steps, max_epochs = int(checkpoint["global_step"]), self.trainer.max_steps, self.trainer.max_epochs
        # At or past its limit Lightning trains nothing and writes the run's end again: wanted for --ckpt_path=last at
        # the run's own limit (a requeue, after a kill that cut the export), refused otherwise. Epochs count as its
        # loop counts them (an epoch is done once processed, before the hook that saves at its end).
        fit = checkpoint.get("loops", {}).get("fit_loop", {})
        current = fit.get("epoch_progress", {}).get("current", {})
        epochs = current.get("processed", 0)
        if fit.get("epoch_loop.batch_progress", {}).get("is_last_batch") and epochs == current.get("completed", 0):
            epochs += 1  # saved at the epoch's last batch (a periodic or a signal's checkpoint): Lightning counts it done on resume
        # The run's own limit reached (a lower one is refused below: it asks for less than was trained).
        reached = "max_steps" if max_steps >= 0 and step == max_steps else "max_epochs" if (
            max_epochs is not None and max_epochs >= 0 and epochs == max_epochs and not 0 <= max_steps < step) else None  # fmt: skip
        if reached and self.finish_when_trained:
            if self.global_rank == 0:
                print(f"resume: nothing is left to train at step {step} (trainer.{reached} is {getattr(self.trainer, reached)}): "
                      f"the run's end is written again (summary.json, and hf/ where the recipe exports); raise trainer.{reached} "
                      "to train on from it", file=sys.stderr)
            return
        if max_steps >= 0 and step >= max_steps:
            raise ForeignCheckpointError(
                f"ckpt_path: {path} is at step {step}, and trainer.max_steps is {max_steps}: there is nothing left to "
                "train; raise trainer.max_steps to train on from it"
            )
        if max_epochs is not None and max_epochs >= 0 and epochs >= max_epochs:
            raise ForeignCheckpointError(
                f"ckpt_path: {path} has trained {epochs} epoch{'s' if epochs != 1 else ''} (step {step}), and trainer.max_epochs "
                f"is {max_epochs}: there is nothing left to train; raise trainer.max_epochs to train on from it"
            )

    def _check_optimizer_keys(self, checkpoint: dict[str, Any], path: Any) -> None:
        saved = checkpoint.get("hyper_parameters") or {}
        for key in _OPTIMIZER_KEYS:  # restored with the optimizer's state: a new value would be ignored
            if key in saved and key in self.hparams and _plain(saved[key]) != _plain(self.hparams[key]):
                raise RecipeError(
                    f"{key}={_plain(self.hparams[key])!r}, but ckpt_path: {path} resumes the optimizer with "
                    f"{key}={_plain(saved[key])!r} (its state holds it): give that, or start a new run", key,
                )

    def check_writer(self, checkpoint: dict[str, Any], path: Any) -> None:
        """Refuse a checkpoint another kind of run wrote: another task, model kind, LoRA layout or optimizer layout.
        One without a record (an older one) is told by its hyperparameters' names, which are its module's arguments."""
        recorded, here = checkpoint.get(WRITER), self.writer()
        if isinstance(recorded, dict):
            differs = [f"{key} {recorded.get(key)!r} there, {value!r} here" for key, value in here.items() if recorded.get(key) != value]
        else:
            theirs = set(checkpoint.get("hyper_parameters") or {}) - _CLI_KEYS
            ours = set(self.hparams) - _CLI_KEYS
            differs = [f"arguments {sorted(theirs - ours)[:3]} there, not {here['task']}'s"] if theirs - ours else []
        if differs:
            raise ForeignCheckpointError(f"ckpt_path: {path} was written by another kind of run ({'; '.join(differs)})")

    def model_tokenizer(self) -> Any:
        """The model's own tokenizer (an image-text model's processor), to export a module on no Trainer with
        (``load_from_checkpoint`` in a script)."""
        path = resolve_model_path(self.hparams.model_name_or_path)
        return load_processor(path)[0] or AutoTokenizer.from_pretrained(path)

    @property
    def attached_datamodule(self) -> Any:
        """The Trainer's datamodule, None on no Trainer (``load_from_checkpoint``) or none given."""
        return self._trainer.datamodule if self._trainer is not None else None

    def export_policy(self, tokenizer: Any, path: Path, mode: ExportMode, data: Any, write: bool = True) -> Path:
        """Write the trained policy (``model``, LoRA ``merged`` into it, or the ``adapter`` alone) and its tokenizer
        as a Hugging Face folder, with a model card of the run (``data``: what it trained on). The base model is named
        as the recipe names it (an adapter's ``base_model_name_or_path`` too), not by where this machine keeps it."""
        base = self.hparams.model_name_or_path
        task = type(self).__name__.removesuffix("Module")
        steps = self.global_step or getattr(self, "_loaded_step", None) or 0  # a loaded module's, on no Trainer or a new one
        card = model_card(task=task, base_model=base, export=mode, steps=steps, data=data_name(data), settings=key_settings(self.hparams, self.lora),
                          image_text=getattr(tokenizer, "image_processor", None) is not None, embedded_base=base in EMBEDDED,
                          model_class=auto_model_class(self.policy.config).__name__)  # Muse Spark Open: image-text, even with a tokenizer only
        return export_hf(self.policy, tokenizer, path, mode=mode, write=write, base_model=base, model_card=card)
