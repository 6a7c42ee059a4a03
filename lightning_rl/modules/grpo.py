"""GRPO as a LightningModule.

One optimizer step, top to bottom (`training_step`):

    prompts -> engine samples G completions each (with its log-probs and weight version)
            -> reward functions -> group-normalised advantages
            -> tree-packed rows (the G completions of a prompt share the prompt: forwarded once)
            -> per-token log-probs -> clipped importance-ratio loss -> optimizer step
            -> new weights pushed to the engine

The first two lines are the rollout side (`rollout/collector.py:RolloutCollector`); in asynchronous mode they run
ahead on a background thread (`RolloutProducer`), never more than `max_staleness` weight versions behind the trainer.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback
from transformers import AutoTokenizer

from lightning_rl import validation
from lightning_rl.errors import RecipeError
from lightning_rl.losses import GRPOLoss, StepCounts
from lightning_rl.losses.advantages import RewardAggregation, RewardScaling, step_advantages
from lightning_rl.losses.grpo import EntropyControl, TokenLoss
from lightning_rl.models.loading import LoraSettings, TowerTraining, check_towers, end_of_turn_ids, load_causal_lm
from lightning_rl.models.paths import check_model_source, model_context, resolve_model_path
from lightning_rl.checkpoints import every_ranks, this_ranks
from lightning_rl.modules.optim import LrSchedule
from lightning_rl.modules.policy import ExportMode, PolicyModule, export_mode
from lightning_rl.modules.reference import drop_base_copy, reference_model, refresh_reference
from lightning_rl.modules.threads import share_cores_with_rollouts
from lightning_rl.attention.tree_attention import AttentionBackend
from lightning_rl.data.prompts import TOY_DATASET, PromptRenderer, PromptSource
from lightning_rl.data.sft import DataError, GenerationCase
from lightning_rl.modules.evaluation import HeldOutEvery, exact_match, heldout_cases, log_heldout
from lightning_rl.modules.grpo_options import AsyncSettings, check_combinations, check_values, reward_specs, steps_of_epochs
from lightning_rl.modules.entropy_threshold import step_entropy_threshold
from lightning_rl.modules.grpo_metrics import StepStats, log_rollouts, log_step, rollout_table, run_summary, step_metrics
from lightning_rl.modules.mismatch import MismatchStats, OldLogprobs, old_logprobs_source, replay_routes, unreplayed
from lightning_rl.models.routing import RouteAgreement, RouterReplaySetting, is_moe
from lightning_rl.models.weights import SyncReport
from lightning_rl.toy.shapes import toy_source
from lightning_rl.toy.task import HELDOUT_FILE
from lightning_rl.ops.logprobs import lm_head_of
from lightning_rl.ops.packed_forward import PackingVerifier, VerifyPacking, across_rows_exact, packed_logprobs, unpacked_hint
from lightning_rl.packing.planner import PrefixAcrossRows, RowPrefix
from lightning_rl.ops.prefix_rows import finish_prefix, plan_step_rows, rows_on_every_rank, share_prefixes
from lightning_rl.models.multimodal import attends_within_images_both_ways, load_processor, multimodal_token_ids, processor_token_ids, rope_positions, uses_multi_axis_positions
from lightning_rl.packing.images import pack_with_images
from lightning_rl.packing.tree import PackedBatch, pack_sequences
from lightning_rl.rewards import NO_REWARD_COLUMNS, ROLLOUT_COLUMNS, RewardScorer, RewardSpec
from lightning_rl.rollout.base import EngineFactory, EngineName, EngineSpec, Rollout, RolloutEngine, SamplingConfig, SamplingSettings
from lightning_rl.rollout.buffer import RolloutProducer, ScoredBatch
from lightning_rl.rollout.collector import RolloutCollector, RolloutSettings
from lightning_rl.rollout.hf import HFRolloutEngine
from lightning_rl.stopping import fetched_on_every_rank
from lightning_rl.rollout import vllm_engine, vllm_server  # noqa: F401  (a recipe may name their engines by class name)
from lightning_rl.models.policy_sync import (
    BackgroundPush, PolicySync, PushInBackground, WeightSync, check_weight_sync, engine_options_for,
    pushes_in_background, resolve_weight_sync,
)

log = logging.getLogger(__name__)


class GRPOModule(PolicyModule):
    """Group Relative Policy Optimization with optional asynchronous rollouts and tool calls.

    Args:
        model_name_or_path: a from_pretrained folder, or ``tiny`` for the embedded default.
        lora: train a LoRA adapter (peft) instead of all weights; the engine gets them as ``weight_sync`` says.
        rewards: reward functions (built-in name or dotted path), each with a weight and kwargs.
        reward_on_error: ``zero`` scores a sample whose reward raises or is infinite 0 (and logs it); ``raise`` stops.
        reward_all_failed: ``stop`` (default) ends the run when a reward fails on every sample of a step, naming
            it; ``zero`` trains on with 0 for it.
        reward_timeout_s: a reward call running longer fails the samples it was given (kind ``timeout``); null: no
            limit.
        num_generations: completions per prompt (G >= 2: advantages compare a prompt's). TRL: `num_generations`.
        sampling: the ``sampling:`` group, every field of `SamplingSettings` (``max_new_tokens``, ``temperature``,
            ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``: TRL's names; ``max_support``: the widest a filter's
            support may be). With a filter on, the trainer scores each token over the support it was sampled from.
        system_prompt: prepended to string prompts (one written as chat messages keeps its own turns, a system one or none).
        loss: the ``loss:`` group, every field of `GRPOLoss` (loss type, clipping, KL, the engine-vs-trainer
            correction, entropy options, each with its TRL name); ``beta > 0`` keeps a frozen reference (with LoRA, the
            policy with its adapters off).
        scale_rewards: ``group`` divides group-centred rewards by the group's std (``std``: its earlier name),
            ``batch`` by the std of every reward of the step (all ranks), ``none`` does not. TRL: `scale_rewards`.
        reward_aggregation: ``sum_then_normalize`` (the weighted sum of the rewards is normalised) or
            ``normalize_then_sum`` (each reward normalised per group, their weighted sum over the step; GDPO).
            TRL: `multi_objective_aggregation`.
        dynamic_sampling, dynamic_sampling_max_rounds: DAPO's dynamic sampling: groups whose rewards all tie are
            dropped and more prompts sampled (at most that many rounds in all) until the step has ``batch_size``
            groups; the filtered fraction is logged (``train/dynamic_sampling/...``).
        mask_truncated_completions: completions cut at ``max_new_tokens`` (no end of sequence) train on no token;
            they still count in their group's advantages. TRL: `mask_truncated_completions`.
        ref_sync_every, ref_mixup_alpha: every ``ref_sync_every`` optimizer steps the reference moves towards the
            policy, ``ref = alpha * policy + (1 - alpha) * ref`` (TR-DPO; None: a frozen reference). TRL:
            `sync_ref_model`, `ref_model_sync_steps`, `ref_model_mixup_alpha`.
        num_iterations: optimizer steps taken on each batch of rollouts (PPO epochs). The old log-probs are the
            sampling policy's, computed once before the first of them, so the ratio moves and clipping bites; the
            engine gets new weights (and the next batch is generated) once per batch. TRL: `num_iterations`.
        old_logprobs, ignore_staleness: the ratio's policy: ``trainer`` (this step's log-probs, detached), ``engine``
            (the sampler's, the behaviour policy: the clipped ratio corrects a stale batch's lag) or ``auto``: ``engine``
            where a batch can be stale (``async_mode``, ``max_staleness >= 1``) and ``loss`` has no engine-vs-trainer
            correction, else ``trainer``; ``trainer`` there without it is refused unless ``ignore_staleness: true``.
        router_replay: an MoE policy's forward uses the experts the engine routed each token to (``auto``: where the
            engine records them; ``true`` refuses a dense model or an engine that cannot).
        mismatch_alarm_kl: stop when ``train/mismatch/kl`` (KL(engine || trainer), batches of staleness 0) exceeds it;
            null: never; off under dropout (LoRA's too), whose masks the engine does not draw. 1e-2 is ten times bf16's.
        learning_rate, weight_decay: AdamW settings. TRL: the same names.
        warmup_steps, lr_schedule: linear warmup, then a schedule (as SFT's). TRL: `warmup_steps`, `lr_scheduler_type`.
        max_grad_norm: clip the gradient norm (over every mesh of the weights); None: none. TRL: `max_grad_norm`.
        chunk_size: tokens per LM-head chunk (bounds the logits memory).
        max_tokens_per_row: unique tokens per packed micro-batch (None: the whole step in one row).
        prefix_across_rows: a group too large for a row forwards its shared prompt once, its rows attend to it (``always``;
            an untrained part below it that its subtree shares, such as a tool's output, once too where that saves),
            or is split into sub-groups that each forward it (``never``); ``auto``: whichever forwards fewer tokens.
        packing: ``tree`` (rollouts packed into rows, each prompt once), or ``none``: each rollout a row of its own, run as
            the model runs it alone (its own attention: a model tree packing refuses trains so, slower).
        attention_backend: tree attention kernel (``auto``: FlexAttention on CUDA, shape-only on XLA/Neuron,
            fused SDPA blocks elsewhere; or ``blocks``, ``flex``, ``varlen`` (CUDA), ``dense``).
        compile: ``torch.compile`` each decoder layer of the policy (the tree attention inside stays eager).
        gradient_checkpointing: recompute each decoder layer in backward (and a prefix shared across rows: its
            forward keeps only its keys and values while the rows run). TRL: `gradient_checkpointing`.
        offload_activations: keep the activations a forward saves in host memory until backward. TRL: `activation_offloading`.
        towers: an image-text model's vision (and audio) towers and projectors: ``frozen`` (default), ``train`` (in
            full), or ``lora`` (adapters there too, with ``lora``).
        verify_packing, verify_packing_every: check a step's first packed row against its sequences run one by
            one and stop before any weight changes if they disagree (``first_step``: a process's first, a resume's too; ``every_n_steps``, ``never``).
        async_mode, max_staleness: generate on a background thread; ``max_staleness`` bounds how many weight
            versions old a trained rollout may be (0: the synchronous run's rollouts).
        push_in_background: send each step's weights from a thread of their own while the trainer trains its next
            step (on a batch the previous weights sampled): staged in host memory first, then pushed and verified
            there; a failed push stops the run at the next step. ``auto``: with ``async_mode`` and ``max_staleness >= 1``,
            training on an accelerator (on a CPU the push takes the cores the step and the engine need), where the
            staged copy takes at most a quarter of the free host memory; ``always`` (refused without async_mode and
            max_staleness >= 1); ``never``: the trainer waits for every push.
        tools: tool functions (dotted paths, functions or ``Tool`` objects): the model may call them, and reads their answers.
        max_turns: replies a rollout may take, each after the tools' answers to the last. TRL: `max_tool_calling_iterations` + 1.
        samples_per_turn: forks per turn after the first (e.g. [2]: each tool-calling reply continues as 2 samples),
            giving nested forks; leaves of a prompt are its group.
        tool_timeout_s: a call running longer is killed (its worker process replaced) and answered with an error.
        tool_output_max_chars: a tool's answer is cut to this many characters before the model reads it.
        max_context_tokens: a multi-turn history that would grow past this (with the next reply) ends there; the
            model's context (``max_position_embeddings``, or as a scaled rope stretches it) bounds it always.
        seed: sampling's seed (a recipe's top-level ``seed``): one per batch and turn, so runs repeat.
        engine: the rollout engine: a short name (``hf``, ``vllm``, ``vllm_server``) or ``class_path`` (an engine's
            class name or dotted path) with its ``init_args``, checked against the engine's signature when the
            recipe is read; the run gives it the model path and ``seed``.
        weight_sync: how the policy reaches the engine after each step (``models/policy_sync.py``): ``full``, a LoRA
            ``merged`` into the weights or its ``adapter`` alone, ``delta`` (what changed: tensors, or their changed elements), ``auto``.
        eval_data, eval_generations, eval_max_new_tokens: held-out conversations (an SFT-shaped file; ``toy``: the
            embedded task's) of which the first ``eval_generations`` are decoded greedily, each up to ``eval_max_new_tokens``
            tokens, before training, every ``trainer.val_check_interval`` steps and after, by the SFT module's evaluator
            (``val/exact_match``; before training ``val/exact_match_before``; summary.json's ``heldout_exact_match[_before]``).
        log_rollouts_every_n_steps: rollout table (prompt, completion, rewards) cadence; 0 disables.
        summary_window: steps averaged for the first/last reward means of `summary_metrics`.
        export: the Hugging Face folder: ``model``, ``merged`` (LoRA merged in: the default with ``lora``), ``adapter`` (TRL's).
    """

    def __init__(
        self,
        model_name_or_path: str = "tiny",
        lora: LoraSettings | None = None,
        rewards: Sequence[RewardSpec] = (RewardSpec("math_answer"),),
        reward_on_error: Literal["zero", "raise"] = "zero",
        reward_all_failed: Literal["stop", "zero"] = "stop",
        reward_timeout_s: float | None = 600.0,
        num_generations: int = 8,
        sampling: SamplingSettings = SamplingSettings(),
        system_prompt: str | None = None,
        loss: GRPOLoss = GRPOLoss(),
        scale_rewards: RewardScaling = "group",
        reward_aggregation: RewardAggregation = "sum_then_normalize",
        mask_truncated_completions: bool = False,
        dynamic_sampling: bool = False,
        dynamic_sampling_max_rounds: int = 4,
        old_logprobs: OldLogprobs = "auto",
        ignore_staleness: bool = False,
        router_replay: RouterReplaySetting = "auto",
        mismatch_alarm_kl: float | None = 1e-2,
        num_iterations: int = 1,
        ref_sync_every: int | None = None,
        ref_mixup_alpha: float = 0.6,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: LrSchedule = "constant_with_warmup",
        max_grad_norm: float | None = 1.0,
        max_tokens_per_row: int | None = None,
        prefix_across_rows: PrefixAcrossRows = "auto",
        packing: Literal["tree", "none"] = "tree",
        chunk_size: int = 1024,
        attention_backend: AttentionBackend = "auto",
        compile: bool = False,
        gradient_checkpointing: bool = False,
        offload_activations: bool = False,
        towers: TowerTraining = "frozen",
        verify_packing: VerifyPacking = "first_step",
        verify_packing_every: int = 100,
        async_mode: bool = False,
        max_staleness: int = 1,
        push_in_background: PushInBackground = "auto",
        tools: Sequence[str] = (),
        max_turns: int = 1,
        samples_per_turn: Sequence[int] = (),
        tool_timeout_s: float = 10.0,
        tool_output_max_chars: int = 4000,
        max_context_tokens: int | None = None,
        engine: EngineName | EngineFactory = "hf",
        weight_sync: WeightSync = "auto",
        seed: int = 0,
        eval_data: str | None = None,
        eval_generations: int = 0,
        eval_max_new_tokens: int = 16,
        log_rollouts_every_n_steps: int = 10,
        summary_window: int = 10,
        export: ExportMode | None = None,
    ) -> None:
        super().__init__()
        specs = reward_specs(rewards)
        self.loss = validation.settings_group(GRPOLoss, loss, "loss")
        try:
            self.engine_spec = EngineSpec.of(engine)
        except ValueError as error:  # a wrong engine or option (a Python caller's: the recipe parser checked a recipe's)
            option = re.match(r"(\w+): ", str(error))
            raise RecipeError(str(error), "engine" if option is None else f"engine.init_args.{option[1]}") from None
        sampling = validation.settings_group(SamplingSettings, sampling, "sampling")
        self.save_hyperparameters(ignore=["rewards", "lora", "loss", "engine", "sampling"])
        self.hparams["engine"] = self.engine_spec.as_config()
        self.hparams["loss"], self.hparams["sampling"] = asdict(self.loss), asdict(sampling)
        # Plain data only, so that checkpoints load with torch.load(weights_only=True).
        self.hparams["rewards"] = [spec.as_config() for spec in specs]
        self.lora = LoraSettings.checked(lora)
        check_towers(towers, self.lora)
        self.hparams["lora"], self.export = None if self.lora is None else asdict(self.lora), export_mode(export, self.lora)
        check_weight_sync(weight_sync, self.lora is not None)
        self.asynchronous = AsyncSettings(async_mode, max_staleness, push_in_background)
        self.automatic_optimization = False
        check_model_source(model_name_or_path, loads=True)
        self.rollout = RolloutSettings(num_generations, dynamic_sampling, dynamic_sampling_max_rounds, tuple(tools), max_turns,
                                       tuple(samples_per_turn), tool_timeout_s, tool_output_max_chars, max_context_tokens, seed)
        self.hparams["tools"] = self.rollout.tool_references
        check_values(self.hparams, GRPOModule.__init__)
        old_logprobs = self.hparams["old_logprobs"] = old_logprobs_source(
            old_logprobs, self.loss, async_mode, max_staleness, num_iterations, ignore_staleness=ignore_staleness)  # fmt: skip
        check_combinations(self.loss, sampling, old_logprobs, scale_rewards, reward_aggregation, ref_sync_every, ref_mixup_alpha, self.lora)
        self.packing_verifier = PackingVerifier(verify_packing, verify_packing_every)
        self.scorer = RewardScorer(specs, on_error=reward_on_error, all_failed=reward_all_failed, timeout_s=reward_timeout_s)
        self.sampling = SamplingConfig(**asdict(sampling))
        self.reference: torch.nn.Module | None = None
        self.engine: RolloutEngine | None = None
        self.tokenizer: Any = None
        self.processor, self.image_token_id = None, None  # an image-text model's processor and image placeholder token
        self.collector: RolloutCollector | None = None
        self.producer: RolloutProducer | None = None
        self._start_run()
        self.route_layers = 0  # routers whose engine routes the trainer replays (router_replay)
        self.weight_sync, self._sync_metrics = None, {}  # how weights reach the engine (on_fit_start), the last sync's figures
        self._background: BackgroundPush | None = None  # pushes from a thread of their own (push_in_background)

    # -- setup ---------------------------------------------------------------------------------

    def _start_run(self) -> None:
        """What one fit records, fresh: a module fitted again starts a run of its own (a resume restores these)."""
        self.reward_history: list[float] = []
        self.trained_batches: list[dict[str, int]] = []  # index and weight version of every trained batch
        self.current_batch: ScoredBatch | None = None  # this step's, from before its optimizer step (its reward_errors)
        self.last_trained = self._batch = None  # the last batch trained; the one the num_iterations passes train on
        self._restored_queue: dict[str, Any] | None = None
        self.entropy_control = EntropyControl(self.loss.entropy_coef) if self.loss.adaptive_entropy else None
        self.heldout_before: dict[str, Any] | None = None  # the evaluator's figures before the first step
        # From the batch's first pass (num_iterations > 1): per row the sampling policy's and the reference's
        # log-probs; its engine-vs-trainer figures.
        self._old_logprobs = self._ref_logprobs = self._mismatch = None

    def setup(self, stage: str) -> None:
        if stage == "fit":  # before a checkpoint is restored, whichever the strategy
            self._start_run()
        # The reward functions' arguments against the data's columns, before a model is loaded: one line now,
        # rather than a run that scores 0 throughout.
        datamodule = self.trainer.datamodule
        if not isinstance(datamodule, PromptSource):
            raise TypeError(f"GRPO reads its prompts from a PromptSource (such as PromptDataModule), got {type(datamodule).__name__}")
        steps_of_epochs(self.trainer, datamodule.epoch_of(1), self.hparams.num_iterations)
        try:
            self.scorer.check_arguments(sorted(datamodule.columns() - NO_REWARD_COLUMNS), ROLLOUT_COLUMNS)
        except ValueError as error:
            raise DataError(f"{datamodule.path}: {error}") from None

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        path = resolve_model_path(self.hparams.model_name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.policy = self.load_policy(path, self.lora)
        # An image-text model: its processor renders image prompts, and its multimodal tokens are never sampled.
        self.processor, self.image_token_id = load_processor(path)
        if self.hparams.eval_generations:
            self.eval_cases  # read now: a bad row stops the run before it writes anything
        suppressed = tuple(sorted({*multimodal_token_ids(self.policy.config), *processor_token_ids(self.processor, self.tokenizer)}))
        stops = tuple(end_of_turn_ids(getattr(self.policy, "generation_config", None), self.tokenizer))  # a reply ends at its turn's end
        self.sampling = dataclasses.replace(self.sampling, suppress_token_ids=suppressed, stop_token_ids=stops)
        if self.loss.beta != 0.0 and self.lora is None:  # with LoRA the reference is the policy's base: its adapters off
            self.reference = load_causal_lm(path, defer_weights=self.loads_sharded()).eval().requires_grad_(False)
        lm_head_of(self.policy)  # a clear error now for heads the chunked log-probs cannot read

    def on_fit_start(self) -> None:
        self.check_packable()  # before an engine is built and a first step generated and scored for nothing
        spec = self.engine_spec
        if spec.engine_class is HFRolloutEngine and "device" not in spec.init_args:  # beside the policy by default
            spec = dataclasses.replace(spec, init_args={**spec.init_args, "device": str(self.device)})
        options = engine_options_for(spec.engine_class, spec.init_args, self.hparams.weight_sync, self.lora and self.lora.r, moe=is_moe(self.policy))
        self.engine = dataclasses.replace(spec, init_args=options).build(resolve_model_path(self.hparams.model_name_or_path), self.hparams.seed)
        self.weight_sync = PolicySync(resolve_weight_sync(self.hparams.weight_sync, self.policy, self.engine, self.lora is not None), self.hparams.weight_sync)
        self.route_layers = replay_routes(self.hparams.router_replay, self.policy, self.engine)
        self.scorer.to(self.device)  # reward models score on the trainer's device
        renderer = PromptRenderer(self.tokenizer, self.processor, self.image_token_id, self.hparams.system_prompt, self.rollout.tool_specs, self.hparams.model_name_or_path)
        self.collector = RolloutCollector(
            self.engine, self.trainer.datamodule, renderer, self.scorer, self.sampling, self.rollout,
            model_context=model_context(self.policy.config),
            max_steps=self.trainer.max_steps, steps_per_batch=self.hparams.num_iterations, rank=self.global_rank,
        )

    def on_train_start(self) -> None:
        # Here, not in on_fit_start: a resume has restored global_step by now. Versions count batches of rollouts
        # (one per num_iterations optimizer steps).
        if self.hparams.eval_generations and self.heldout_before is None and self.global_step == 0:  # a resume has them, or none
            self.heldout_before = self.evaluate()
        index, iteration = divmod(self.global_step, self.hparams.num_iterations)
        self._push_weights(version=index)
        if not self.asynchronous.async_mode:
            return
        first = index + (1 if iteration else 0)  # resumed inside a batch: that one came back with the checkpoint
        self.producer = RolloutProducer(self.collector.collect, lambda: self.engine.weight_version, self.asynchronous.max_staleness, start_index=first,
                                        concurrent=self.engine.concurrent_batches, interrupt=self.engine.interrupt, end_index=-(-self.trainer.max_steps // self.hparams.num_iterations))
        if self._restored_queue is not None:
            self.producer.load_state_dict(self._restored_queue, next_step=first)
        share_cores_with_rollouts(self.engine, self.trainer, self.asynchronous.max_staleness)  # the rollout thread computes beside this one
        self.producer.start()
        run = self.asynchronous
        if pushes_in_background(run.push_in_background, run.async_mode, run.max_staleness, self.policy, self.weight_sync.mode, self.device):
            self._background = BackgroundPush(self.weight_sync, self.producer.weights_updated)

    def on_train_end(self) -> None:
        if self._background is not None:  # the last push's failure is the run's
            self._record_sync(self._background.join())

    def on_fit_end(self) -> None:
        self.close()

    def configure_callbacks(self) -> list[Callback]:
        # Lightning calls no module hook when a fit ends by an exception (a SIGTERM stop included); a rollout thread
        # left running there aborts the interpreter at exit (exit code 134).
        return [*super().configure_callbacks(), _CloseOnException(), HeldOutEvery()]

    def close(self) -> None:
        """Stop the weight push and the rollout thread, the tool workers and the engine."""
        if self._background is not None:
            self._background.close()
            self._background = None
        if self.producer is not None:
            self.producer.close()
        if self.collector is not None:
            self.collector.close()
        if self.engine is not None:
            self.engine.close()

    # -- the algorithm -------------------------------------------------------------------------

    def training_step(self, batch_index: int, batch_idx: int) -> dict[str, Any]:
        step = self.global_step
        if int(batch_index) != step:
            raise RuntimeError(f"prompt batch {int(batch_index)} arrived at optimizer step {step}")
        index, iteration = divmod(step, self.hparams.num_iterations)
        started = time.perf_counter()
        if iteration == 0 or self._batch is None:  # a stop signal gives the step up while its rollouts are awaited
            fetch = functools.partial(self.producer.take if self.producer is not None else self.collector.collect, index)
            self._batch = fetched_on_every_rank(fetch, self._any_rank, self.producer and self.producer.give_back)
            self._old_logprobs = self._ref_logprobs = self._mismatch = None
            self.scorer.stop_if_failed_on_all(self._batch.reward_failures, self._batch.first_reward_failures, self._batch.sampled_rollouts, index + 1, self.trainer.strategy.reduce, self.device)
        scored = self.current_batch = self._batch
        waited = time.perf_counter() - started
        staleness = index - scored.weight_version  # within max_staleness: the producer samples a staler batch again

        advantages = self._advantages(scored)
        rollouts = scored.rollouts
        if self.hparams.mask_truncated_completions:
            rollouts = [dataclasses.replace(r, completion_mask=[False] * len(r.completion_ids)) if r.finish_reason == "length" else r for r in rollouts]
        rows, prefixes = self._plan_rows(rollouts)
        counts = self._step_counts(rollouts)

        optimizer = self.optimizers()
        optimizer.zero_grad()
        train_started = time.perf_counter()
        stats = StepStats(bonus=self.entropy_control is not None, clips=self.loss.clips, vespo=self.loss.loss_type == "vespo", policy_loss=self.loss.entropy_coef != 0 or self.entropy_control is not None)
        packed_rows = share_prefixes([self.pack_rollouts([rollouts[i] for i in row], advantages[row]).to(self.device) for row in rows], prefixes,
                                     recompute=self.hparams.gradient_checkpointing, image_token_id=self.image_token_id)
        # Taken once per batch, before its first update, as TRL takes them (a reference refreshed between passes too).
        for name, wanted, model in (("_old_logprobs", self.hparams.old_logprobs == "trainer", contextlib.nullcontext(self.policy)),
                                    ("_ref_logprobs", self.loss.beta != 0.0, reference_model(self.policy, self.reference))):
            if self.hparams.num_iterations > 1 and wanted and getattr(self, name) is None:
                with torch.no_grad(), model as taken:
                    setattr(self, name, [self.policy_logprobs(taken, packed)[0].cpu() for packed in packed_rows])
        threshold = draws = None  # draws: the random state each row's threshold forward began with (its dropout masks)
        if self.loss.top_entropy_quantile < 1:
            threshold, counts, draws = step_entropy_threshold(lambda row: self.policy_logprobs(self.policy, row, with_entropy=True)[1], packed_rows,
                                                              self.loss.top_entropy_quantile, counts, self.trainer.strategy, self.device)
        step_loss = self.loss  # with adaptive entropy control, the coefficient of this step
        if self.entropy_control is not None:
            step_loss = dataclasses.replace(self.loss, entropy_coef=self.entropy_control.applied(self.loss))
        mismatch = MismatchStats(self.route_layers, corrects=self.loss.corrects_engine, unreplayed=unreplayed(self.sampling, self.policy)) if self._mismatch is None else None
        with self.rows_reduced_once():  # under DDP: one reduction after every row's and prefix's backward
            for k, packed in enumerate(packed_rows):
                if self.packing_verifier.due(step) and not packed.unpacked:
                    self._verify_packing(packed, step)
                old, ref = (None if kept is None else kept[k].to(self.device) for kept in (self._old_logprobs, self._ref_logprobs))
                if draws is not None:  # under dropout, the training forward keeps the very tokens the threshold counted
                    draws[k].restore()
                terms, entropy = self.row_loss(packed, threshold, old_logprobs=old, ref_logprobs=ref, loss=step_loss, mismatch=mismatch)
                seq_tokens = torch.bincount(packed.loss_seq, minlength=packed.num_sequences)
                loss = step_loss.reduce(terms, packed.loss_seq, seq_tokens, counts)
                self.manual_backward(loss)
                finish_prefix(packed)  # a span's last row: one backward through its prefix
                stats.add(loss.detach(), terms, entropy, packed, padding=not rows[k], bonus=step_loss.bonus(terms, counts).detach())
        if mismatch is not None:  # before the optimizer step: an alarm leaves the weights as they were
            self._mismatch = mismatch.metrics(self.trainer.strategy.reduce, self.device, staleness, self.hparams.mismatch_alarm_kl)
        stats.grad_norm = self.clip_gradients_over_meshes(self.hparams.max_grad_norm)  # None: measured, not clipped
        stats.lr = optimizer.param_groups[0]["lr"]  # the rate this step takes (the scheduler moves it on next)
        optimizer.step()
        self.lr_schedulers().step()
        if self.entropy_control is not None:  # over every rank, for the next step's coefficient
            bonus = torch.tensor([stats.bonus_entropy, stats.bonus_tokens], dtype=torch.float64, device=self.device)
            total, tokens = self.trainer.strategy.reduce(bonus, reduce_op="sum").tolist()
            self.entropy_control.update(self.loss, total / max(tokens, 1.0))
        if self.hparams.ref_sync_every is not None and (step + 1) % self.hparams.ref_sync_every == 0:
            refresh_reference(self.reference, self.policy, self.hparams.ref_mixup_alpha)
        if iteration == self.hparams.num_iterations - 1:
            self._push_weights(version=index + 1)
            self._batch = self._old_logprobs = self._ref_logprobs = None
        train_seconds = time.perf_counter() - train_started

        self.trained_batches.append({"index": index, "iteration": iteration, "weight_version": scored.weight_version})
        self.last_trained = scored
        self.reward_history.append(self._log_step(scored, stats, staleness, waited, train_seconds))
        return {"loss": torch.tensor(stats.loss), "reported_loss": self._any_rank(stats.loss) / self.trainer.world_size, "tokens": stats.unique_tokens, "flat_tokens": stats.flat_tokens}  # as train/loss

    def _any_rank(self, value: float) -> float:
        return float(self.trainer.strategy.reduce(torch.tensor(value, dtype=torch.float64, device=self.device), reduce_op="sum"))

    def policy_logprobs(
        self, model: torch.nn.Module, packed: PackedBatch, *, with_entropy: bool = False, entropy_grad: bool = False,
        route_agreement: RouteAgreement | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(target) of every trained token of a packed row under the sampling temperature (and the entropy
        there, differentiable with ``entropy_grad``)."""
        with unpacked_hint("model.packing", "rollout", packed=not packed.unpacked):  # a refusal of a row says the way out
            out = packed_logprobs(
                model, packed, chunk_size=self.hparams.chunk_size, return_entropy=with_entropy, temperature=self._temperature(),
                attention_backend=self.attention_backend(), entropy_grad=entropy_grad, suppressed=self.sampling.suppress_token_ids,
                route_agreement=route_agreement)  # fmt: skip
        return out if with_entropy else (out, None)

    def _temperature(self) -> float:
        return self.sampling.temperature or 1.0  # greedy sampling scores under the plain distribution

    def _verify_packing(self, packed: PackedBatch, step: int) -> None:
        with unpacked_hint("model.packing", "rollout"):
            error = self.packing_verifier.check(self.policy, packed, step=step, backend=self.attention_backend(), temperature=self._temperature(),
                                                chunk_size=self.hparams.chunk_size, strategy=self.trainer.strategy, suppressed=self.sampling.suppress_token_ids)
        self.log_check("train/packing_error", error)

    # -- pieces of the step --------------------------------------------------------------------

    def row_loss(
        self, packed: PackedBatch, entropy_threshold: torch.Tensor | None = None, old_logprobs: torch.Tensor | None = None,
        loss: GRPOLoss | None = None, mismatch: MismatchStats | None = None, ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[TokenLoss, torch.Tensor | None]:
        """The loss terms of one packed row and its per-token entropy. ``entropy_threshold``: the step's, for
        ``loss.top_entropy_quantile < 1`` (by default this row's own quantile). ``old_logprobs``: the policy the
        ratio is taken against, when not this step's own (``num_iterations``) or the engine's; ``ref_logprobs``: the
        reference's, when taken already. ``loss``: the step's settings, when they are not ``self.loss`` (adaptive
        entropy control). ``mismatch``: the first pass's engine-vs-trainer figures, added to."""
        loss = self.loss if loss is None else loss
        logprobs, entropy = self.policy_logprobs(
            self.policy, packed, with_entropy=True, entropy_grad=loss.entropy_coef != 0, route_agreement=mismatch.routes if mismatch else None,
        )
        engine_logprobs = packed.token_values["engine_logprobs"]
        if self.loss.beta != 0.0 and ref_logprobs is None:
            with torch.no_grad(), reference_model(self.policy, self.reference) as reference:
                ref_logprobs, _ = self.policy_logprobs(reference, packed)
        old = old_logprobs if old_logprobs is not None else logprobs.detach() if self.hparams.old_logprobs == "trainer" else engine_logprobs
        terms = loss.token_loss(
            logprobs, old, packed.seq_values["advantage"][packed.loss_seq].to(logprobs),
            ref_logprobs=ref_logprobs, engine_logprobs=engine_logprobs, loss_seq=packed.loss_seq,
            seq_num_tokens=torch.bincount(packed.loss_seq, minlength=packed.num_sequences), entropy=entropy,
            entropy_threshold=entropy_threshold,
        )
        if mismatch is not None:
            mismatch.add(logprobs, engine_logprobs, terms)
        return terms, None if entropy is None else entropy.detach()

    def pack_rollouts(self, rollouts: list[Rollout], advantages: torch.Tensor) -> PackedBatch:
        return dataclasses.replace(self._pack(rollouts, advantages), unpacked=self.hparams.packing == "none")

    def _pack(self, rollouts: list[Rollout], advantages: torch.Tensor) -> PackedBatch:
        pad, multiple = self.tokenizer.pad_token_id or 0, self.row_multiple()  # static-shape devices: rows padded to buckets
        if not rollouts:  # an empty row (this rank has fewer rows than another): one untrained token
            return pack_sequences([[pad]], [[False]], token_values={"engine_logprobs": [[0.0]]}, seq_values={"advantage": [0.0]}, pad_to_multiple_of=multiple, pad_token_id=pad)
        options = dict(token_values={"engine_logprobs": [r.sequence_logprobs for r in rollouts]}, seq_values={"advantage": advantages.tolist()}, pad_token_id=pad,
                       token_supports=[r.sequence_support for r in rollouts], pad_to_multiple_of=multiple)  # a filter's support: scored over it, as sampled
        if self.route_layers:  # router replay: each token goes to the experts the engine routed it to
            options["routes"] = [r.routes for r in rollouts]
        if any(r.metadata.get("images") for r in rollouts):  # the G completions of an image prompt share its image
            rule = functools.partial(rope_positions, self.policy) if uses_multi_axis_positions(self.policy) else None  # the model's own
            images = [r.metadata.get("images", []) for r in rollouts]
            return pack_with_images([r.sequence for r in rollouts], images, self.image_token_id, [r.loss_mask for r in rollouts], position_rule=rule, **options)
        return pack_sequences([r.sequence for r in rollouts], [r.loss_mask for r in rollouts], **options)

    def _advantages(self, scored: ScoredBatch) -> torch.Tensor:
        """Each rollout's advantage; the statistics that span the step are summed over every rank."""
        return step_advantages(
            scored.rewards, scored.reward_terms, {name: self.scorer.weights[name] for name in self.scorer.rewards}, [r.group_id for r in scored.rollouts],
            self.hparams.reward_aggregation, self.hparams.scale_rewards, lambda t: self.trainer.strategy.reduce(t.to(self.device), reduce_op="sum").cpu(),
        )  # fmt: skip

    def _plan_rows(self, rollouts: list[Rollout]) -> tuple[list[list[int]], list[RowPrefix | None]]:
        """Micro-batches of this rank and their spans' prefixes; every rank runs the same number (padded with empty rows)."""
        def plan() -> tuple[list[list[int]], list[RowPrefix | None]]:
            if self.hparams.packing == "none":
                return [[i] for i in range(len(rollouts))] or [[]], [None] * max(len(rollouts), 1)
            if self.hparams.max_tokens_per_row is None:
                return [list(range(len(rollouts)))], [None]
            plan = plan_step_rows(self.hparams.max_tokens_per_row, self.hparams.prefix_across_rows, self.policy, [r.sequence for r in rollouts], [r.loss_mask for r in rollouts],
                                  [r.group_id for r in rollouts], bool(self.row_multiple()) or (any(r.metadata.get("images") for r in rollouts) and attends_within_images_both_ways(self.policy)),
                                  lambda: across_rows_exact(self.policy, self.attention_backend()))  # apart: padded rows; images a span's row may hold of its own, attending both ways  # fmt: skip
            return plan.ranks[0], plan.prefixes[0]
        return rows_on_every_rank(plan, self.trainer.strategy.reduce, self.device)

    def _step_counts(self, rollouts: list[Rollout]) -> StepCounts:
        rank_tokens = sum(sum(r.completion_mask) for r in rollouts)
        local = torch.tensor([len(rollouts), rank_tokens], dtype=torch.float64, device=self.device)
        total = self.trainer.strategy.reduce(local.clone(), reduce_op="sum")
        return StepCounts(  # Dr.GRPO's constant: the most tokens a completion can be trained on
            num_sequences=int(total[0]), num_tokens=int(total[1]), rank_tokens=rank_tokens, world_size=self.trainer.world_size,
            max_completion_length=self.sampling.max_new_tokens * max(self.hparams.max_turns, 1),
        )

    def _push_weights(self, version: int) -> None:
        if self._background is not None:  # staged here (FSDP2 shards gathered on every rank), sent on its thread
            self._record_sync(self._background.push(self.policy, self.engine, version))
            return
        self._record_sync(self.weight_sync.sync(self.policy, self.engine, version))  # FSDP2 shards gathered
        if self.producer is not None:
            self.producer.weights_updated()

    def _record_sync(self, report: SyncReport | None) -> None:
        """``train/sync/*``: summed over the pushes that landed during a step (the run's first with its first step's)."""
        if report is not None:
            self._sync_metrics = {k: self._sync_metrics.get(k, 0.0) + v for k, v in report.metrics().items()}

    # -- logging and checkpoints ---------------------------------------------------------------

    def _log_step(self, scored: ScoredBatch, stats: StepStats, staleness: int, waited: float, train_seconds: float) -> float:
        """Log the step's figures (over every rank); returns its mean reward."""
        coef = self.entropy_control.coef if self.entropy_control is not None else self.loss.entropy_coef  # TRL logs it with a bonus
        extra = {**({"entropy_coef": coef} if coef or self.entropy_control is not None else {}), **(self._mismatch or {}), **self._sync_metrics}
        if hasattr(self.engine, "restarts"):  # a vLLM server's, restarted after it died (engine_max_restarts)
            extra["engine/restarts"] = float(self.engine.restarts)
        metrics, self._sync_metrics = step_metrics(scored, stats, staleness, waited, train_seconds, bool(self.rollout.tools), extra), {}
        reward = log_step(self, metrics, scored)
        step = self.global_step - 1  # the step just taken, where Lightning logs its figures; a batch's table once, at its first
        if (every := self.hparams.log_rollouts_every_n_steps) and scored.index % every == 0 and step % self.hparams.num_iterations == 0:
            log_rollouts(self.trainer, step, rollout_table(scored, self.tokenizer.decode, step, self._advantages(scored).tolist()))  # every token as the model read it
        return reward

    @functools.cached_property
    def eval_cases(self) -> list[GenerationCase]:
        """The held-out prompts decoded by `evaluate`: read (and checked) as the model loads, before the run writes."""
        source = str(HELDOUT_FILE) if self.hparams.eval_data == TOY_DATASET else toy_source(self.hparams.eval_data)
        as_trained = PromptRenderer(self.tokenizer, system_prompt=self.hparams.system_prompt)  # string prompts' turns
        return heldout_cases(source, self.tokenizer, str(resolve_model_path(self.hparams.model_name_or_path)), self.processor, self.image_token_id,
                             count=self.hparams.eval_generations, context=model_context(self.policy.config), max_new_tokens=self.hparams.eval_max_new_tokens,
                             prompt_messages=lambda text: as_trained.messages({"prompt": text}))

    def evaluate(self) -> dict[str, Any]:
        """The held-out evaluator's figures for the policy as it is now (every rank takes part: shards are gathered)."""
        return log_heldout(self, exact_match(self.policy, self.tokenizer, self.eval_cases, max_new_tokens=self.hparams.eval_max_new_tokens))

    def summary_metrics(self) -> dict[str, Any]:
        """Reward means of the first and last `summary_window` steps, and held-out accuracy before and after
        training when ``eval_generations`` is set, for summary.json."""
        heldout = {}
        if self.hparams.eval_generations:
            heldout = {**self.evaluate(), "heldout_exact_match_before": (self.heldout_before or {}).get("heldout_exact_match")}
        return {**heldout, **run_summary(self.reward_history, self.hparams.summary_window, self.trained_batches), "reward_failure": self.scorer.stopped_by}

    def export_hf(self, path: Path, write: bool = True) -> Path:
        """Write the trained policy and its tokenizer as a Hugging Face folder (on no Trainer, the model's own)."""
        tokenizer = self.processor or getattr(self, "tokenizer", None) or self.model_tokenizer()
        return self.export_policy(tokenizer, path, mode=self.export, data=getattr(self.attached_datamodule, "path", None), write=write)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # what wrote it: a checkpoint of another kind is refused on resume
        if self._background is not None:  # the engine holds the saved weights: the queue then fills as in a foreground run
            self._record_sync(self._background.join())
        checkpoint["grpo"] = every_ranks({  # each rank's own: the batch it trains and its queue are its own prompts
            "rollout_queue": self.producer.state_dict() if self.producer is not None else {"ready": []},
            # Saved inside a batch's num_iterations passes: the batch and its old log-probs (in _SAVED), to finish them.
            "batch": None if self._batch is None else self._batch.state(),
            "entropy_control": None if self.entropy_control is None else dataclasses.asdict(self.entropy_control),
            **{key: copy.copy(getattr(self, name)) for key, name in _SAVED.items()},
        })

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.lora is not None:
            drop_base_copy(checkpoint)
        super().on_load_checkpoint(checkpoint)
        if self._trainer is None:  # load_from_checkpoint: the weights alone
            return
        state = this_ranks(checkpoint.get("grpo", {}), self.trainer, lambda saved: saved.get("batch") is not None or any(saved["rollout_queue"].values()))
        self._restored_queue = state.get("rollout_queue")
        self._batch = None if state.get("batch") is None else ScoredBatch.from_state(state["batch"])
        for key, name in _SAVED.items():  # absent from an older checkpoint: the fresh module's value
            setattr(self, name, copy.copy(state.get(key, getattr(self, name))))
        if self.entropy_control is not None and state.get("entropy_control") is not None:
            self.entropy_control = EntropyControl(**state["entropy_control"])


# What a checkpoint keeps of the module as it is (plain data, copied): its key, the attribute.
_SAVED = {"reward_history": "reward_history", "trained_batches": "trained_batches", "old_logprobs": "_old_logprobs",
          "ref_logprobs": "_ref_logprobs", "heldout_before": "heldout_before", "mismatch": "_mismatch"}  # fmt: skip


class _CloseOnException(Callback):
    def on_exception(self, trainer: Any, pl_module: GRPOModule, exception: BaseException) -> None:
        pl_module.close()
