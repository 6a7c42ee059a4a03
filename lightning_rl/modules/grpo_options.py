"""GRPO's refusals of options that each pass their own check but cannot run together, and the reward entries.

A settings group checks its own values (``GRPOLoss``, ``SamplingSettings``, ``RolloutSettings``, ``AsyncSettings``); what spans groups
(the sampling penalty and the loss's correction, the advantages' scaling and aggregation, the reference's refresh
and LoRA) is refused here, in one line naming the key, before any model loads.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_rl import validation
from lightning_rl.data.prompts import TOY_DATASET
from lightning_rl.data.sft import check_source
from lightning_rl.errors import RecipeError
from lightning_rl.losses import GRPOLoss
from lightning_rl.models.loading import LoraSettings
from lightning_rl.models.policy_sync import PushInBackground, check_push_in_background
from lightning_rl.modules.mismatch import alarm_bound
from lightning_rl.modules.optim import check_schedule
from lightning_rl.rewards import RewardSpec
from lightning_rl.rollout.base import SamplingSettings
from lightning_rl.toy.shapes import toy_source


@dataclass(frozen=True)
class AsyncSettings:
    """Asynchronous GRPO's keys of the same names (see `GRPOModule`), checked together as they are made."""

    async_mode: bool = False
    max_staleness: int = 1
    push_in_background: PushInBackground = "auto"

    def __post_init__(self) -> None:
        validation.non_negative_int("max_staleness", self.max_staleness)
        check_push_in_background(self.push_in_background, self.async_mode, self.max_staleness)


def steps_of_epochs(trainer: Any, pass_per_batch: float, num_iterations: int) -> None:
    """A GRPO run draws prompt batches without end, so it stops at ``trainer.max_steps``: a run given
    ``trainer.max_epochs`` alone (TRL's ``num_train_epochs``) trains that many passes over its prompts (a batch takes
    ``pass_per_batch`` of one, on every rank together), counted in optimizer steps (``num_iterations`` per batch). A
    run given no limit at all (``max_epochs: -1``) is refused, as is a fraction of its endless epoch."""
    for key in ("limit_train_batches", "val_check_interval"):  # Lightning's own refusal of these was a traceback
        value = getattr(trainer, key)
        if isinstance(value, float) and value != 1.0:
            raise RecipeError(f"trainer.{key}: {value:g} is a fraction of an epoch, but a GRPO run draws prompt batches without end: "
                              "give a whole number of steps", f"trainer.{key}")
    if trainer.max_steps != -1:
        if trainer.max_epochs not in (None, -1) and trainer.is_global_zero:
            print(f"note: trainer.max_epochs={trainer.max_epochs} is not used: a GRPO run given trainer.max_steps stops there (as TRL's "
                  "max_steps overrides num_train_epochs)", file=sys.stderr)
        return
    epochs = trainer.max_epochs
    if epochs is None or epochs < 0:
        raise RecipeError("a GRPO run stops at trainer.max_steps (or after trainer.max_epochs passes over its prompts): set one", "trainer.max_steps")
    if not (trainer.limit_train_batches is None or isinstance(trainer.limit_train_batches, float) and trainer.limit_train_batches == 1.0):
        # Lightning's epoch would end at the limit, not after a pass (a whole number is batches, 1 too)
        raise RecipeError(f"trainer.limit_train_batches: {trainer.limit_train_batches} cuts a GRPO run's epochs short of a pass over its "
                          "prompts (trainer.max_epochs counts passes): give trainer.max_steps to train fewer steps", "trainer.limit_train_batches")
    batches = math.ceil(round(epochs / pass_per_batch, 6))
    trainer.fit_loop.epoch_loop.max_steps = batches * num_iterations
    if trainer.is_global_zero:
        print(f"note: trainer.max_epochs={epochs}: {batches * num_iterations} optimizer steps ({batches} batches of prompts"
              f"{f', {num_iterations} steps each' if num_iterations > 1 else ''}) in one Lightning epoch", file=sys.stderr)


def check_values(hparams: Mapping[str, Any], init: Callable[..., Any]) -> None:
    """Each of ``GRPOModule``'s own scalar arguments (as ``save_hyperparameters`` recorded them) within its bounds, and
    each named choice one of its names (``init``: the module's ``__init__``, whose annotations list them)."""
    validation.literal_arguments(init, hparams)
    for key in ("num_iterations", "chunk_size", "verify_packing_every", "summary_window", "eval_max_new_tokens", "max_tokens_per_row"):
        if hparams[key] is not None:
            validation.positive_int(key, hparams[key])
    for key in ("eval_generations", "warmup_steps", "log_rollouts_every_n_steps"):
        validation.non_negative_int(key, hparams[key])
    validation.finite_non_negative("weight_decay", hparams["weight_decay"])
    for key in ("learning_rate", "reward_timeout_s", "max_grad_norm"):
        if hparams[key] is not None:
            validation.finite_positive(key, hparams[key])
    check_schedule(hparams["lr_schedule"], hparams["learning_rate"], hparams["warmup_steps"])
    alarm_bound(hparams["mismatch_alarm_kl"])
    defaults = inspect.signature(init).parameters
    for key, needs in (("dynamic_sampling_max_rounds", "dynamic_sampling"), ("eval_data", "eval_generations")):
        if hparams[key] != defaults[key].default and not hparams[needs]:
            print(f"note: {key} is set, but {needs} is {hparams[needs]}, so it is not used", file=sys.stderr)
    if hparams["packing"] == "none" and hparams["max_tokens_per_row"] is not None:
        raise RecipeError("max_tokens_per_row packs rollouts into rows, but packing: none forwards each alone: leave it unset", "max_tokens_per_row")
    if hparams["packing"] == "none" and hparams["prefix_across_rows"] == "always":
        raise RecipeError("prefix_across_rows: always shares a prompt across packed rows, but packing: none forwards each rollout alone, "
                          "its prompt with it: leave it at auto", "prefix_across_rows")
    if hparams["eval_generations"] and hparams["eval_data"] is None:
        raise RecipeError("eval_generations needs model.eval_data (held-out conversations; toy: the embedded task's)", "eval_generations")
    if hparams["eval_data"] not in (None, TOY_DATASET):
        check_source("eval_data", toy_source(hparams["eval_data"]))


def check_combinations(
    loss: GRPOLoss,
    sampling: SamplingSettings,
    old_logprobs: str,
    scale_rewards: str,
    reward_aggregation: str,
    ref_sync_every: int | None,
    ref_mixup_alpha: float,
    lora: LoraSettings | None,
) -> None:
    unused = [f"loss.{f.name}" for f in fields(GRPOLoss) if f.name.startswith(("entropy_coef_", "entropy_target"))
              and getattr(loss, f.name) != f.default and not loss.adaptive_entropy]  # fmt: skip
    if unused:
        print(f"note: {', '.join(unused)} {'is' if len(unused) == 1 else 'are'} set, but loss.adaptive_entropy is off, so not used", file=sys.stderr)
    if sampling.temperature == 0:
        raise RecipeError("sampling.temperature=0 samples greedily: every completion of a prompt is the same, so their advantages "
                          "are all 0 and GRPO learns nothing; give a temperature > 0", "sampling.temperature")
    uses_engine = [key for key, on in (
        ("loss.importance_sampling_cap", loss.importance_sampling_cap is not None),
        ("loss.importance_sampling_floor", loss.importance_sampling_floor is not None),
        ("old_logprobs=engine (given, or what `auto` takes where a batch can be stale: async_mode)", old_logprobs == "engine"),
        ("loss.off_policy_mask_threshold", loss.off_policy_mask_threshold is not None),
    ) if on]  # fmt: skip
    if sampling.repetition_penalty != 1.0 and uses_engine:
        # The penalty depends on every token before (how each engine counts them differs: transformers' counts the
        # padding): the trainer does not replay it, so the engine's log-probs are not of the policy it scores.
        raise RecipeError(
            f"sampling.repetition_penalty={sampling.repetition_penalty} with {uses_engine[0]}: the engine's log-probs "
            "then include a penalty the trainer does not replay, so the correction would compare different "
            "distributions; leave repetition_penalty at 1 or turn the correction off", "sampling.repetition_penalty",
        )
    if reward_aggregation == "normalize_then_sum" and scale_rewards not in ("group", "std"):
        raise RecipeError(
            f"scale_rewards={scale_rewards!r} with reward_aggregation='normalize_then_sum': that aggregation "
            "normalises each reward per group and their sum over the step itself; leave scale_rewards: group",
            "scale_rewards",
        )
    if ref_sync_every is not None:
        validation.positive_int("ref_sync_every", ref_sync_every)
        validation.fraction("ref_mixup_alpha", ref_mixup_alpha, low_open=True, high_open=False)
        if loss.beta == 0:
            raise RecipeError("ref_sync_every: loss.beta is 0, so there is no reference model to refresh", "ref_sync_every")
        if lora is not None:
            raise RecipeError(
                "ref_sync_every: with lora the reference is the frozen base model, read as the policy with its "
                "adapters off, which a refresh cannot move towards the policy; leave ref_sync_every unset", "ref_sync_every",
            )


def reward_specs(rewards: Any) -> list[RewardSpec]:
    """``rewards`` as ``RewardSpec``s: a list of entries, or one entry alone (TRL's ``reward_funcs`` takes either)."""
    if isinstance(rewards, (str, dict, RewardSpec)) or callable(rewards):
        rewards = [rewards]
    if not isinstance(rewards, (list, tuple)):
        raise RecipeError(f"rewards must be a list of reward functions, got {type(rewards).__name__}", "rewards")
    return [reward_spec(r) for r in rewards]


def reward_spec(spec: RewardSpec | dict[str, Any] | str) -> RewardSpec:
    """A ``rewards:`` entry as a ``RewardSpec``: a spec already, a name or dotted path, or its fields."""
    if isinstance(spec, RewardSpec):
        return spec
    if isinstance(spec, str) or callable(spec):  # a name or path; a function, partial or object (TRL's reward_funcs)
        return RewardSpec(spec)
    if not isinstance(spec, dict):
        raise RecipeError(f"rewards: each entry is a name or dotted path, a function, or a block (function, weight, kwargs), got {spec!r}", "rewards")
    return RewardSpec(**spec)
