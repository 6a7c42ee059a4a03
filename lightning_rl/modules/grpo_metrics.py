"""What a GRPO step logs: the loss statistics summed over its packed rows, and the figures of the batch it trained on
(rewards and their failures, staleness, completion lengths, dynamic sampling, tool calls) and its rollout table; what
the run's summary.json says of its steps."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_args

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger

from lightning_rl.losses.grpo import TokenLoss
from lightning_rl.packing.tree import PackedBatch
from lightning_rl.rollout.base import InfraFailure
from lightning_rl.rollout.buffer import ScoredBatch
from lightning_rl.rollout.conversation import TOOL_FAILURE_KINDS
from lightning_rl.run_folder import is_run_folder


class Pooled(float):
    """A figure that is a ratio of sums (a mean per token or per rollout, a fraction): its value, with the sums behind
    it, which the ranks add up before one division (each rank's ratio averaged weighed a rank of few tokens as much
    as one of many; TRL reduces the sums). 0 where nothing was counted."""

    total: float
    count: float

    def __new__(cls, total: float, count: float) -> Pooled:
        value = super().__new__(cls, total / count if count else 0.0)
        value.total, value.count = float(total), float(count)
        return value


class StepStats:
    """Sums over the rows of one step of what is logged about the loss; with ``bonus``, also the entropy of the
    tokens an entropy bonus acts on (adaptive entropy control reads it). ``clips``: the loss clips its ratio (sapo's
    and vespo's do not: no clip figures, as TRL logs none)."""

    def __init__(self, bonus: bool = False, clips: bool = True, vespo: bool = False, policy_loss: bool = False) -> None:
        self.bonus, self.clips, self.vespo, self.logs_policy_loss = bonus, clips, vespo, policy_loss
        self.loss = self.policy_loss = 0.0  # the loss, and the policy's part of it (without the entropy bonus)
        self.tokens = 0
        self.low = self.high = self.clip_units = 0.0  # clipped, of clip_units: tokens, or sequences at sequence level
        # Over the sequences that train a token: the smallest share of a sequence's terms clipped low, the largest
        # clipped high (TRL's clip_ratio/low_min, high_max).
        self.low_min, self.high_max = math.inf, -math.inf
        self.phi = self.phi_sequences = 0.0  # vespo's phi summed over the sequences that train, and their count
        self.kl = self.entropy = self.ratio = 0.0
        self.bonus_entropy, self.bonus_tokens = 0.0, 0
        self.flat_tokens = self.unique_tokens = 0
        self.rows = 0
        self.has_kl = False
        self.grad_norm: torch.Tensor | None = None  # of all gradients together, before clipping
        self.lr = 0.0  # the learning rate the step's optimizer update took

    def add(self, loss: torch.Tensor, terms: TokenLoss, entropy: torch.Tensor | None, packed: PackedBatch, padding: bool = False,
            bonus: torch.Tensor | float = 0.0) -> None:
        self.loss += float(loss)
        self.policy_loss += float(loss) + float(bonus)
        self.tokens += int(terms.loss.numel())
        weight = terms.clip_weight
        self.low += float((terms.low_clipped * weight).sum())
        self.high += float((terms.high_clipped * weight).sum())
        self.clip_units += float(weight.sum()) if isinstance(weight, torch.Tensor) else weight * terms.loss.numel()
        if terms.loss.numel():  # each sequence's share of its terms clipped (one term per token: a term per sequence counts alike)
            counts = torch.bincount(packed.loss_seq, minlength=packed.num_sequences).double()
            trains = counts > 0

            def share(clipped: torch.Tensor) -> torch.Tensor:
                return torch.bincount(packed.loss_seq, weights=clipped.double(), minlength=packed.num_sequences)[trains] / counts[trains]

            self.low_min = min(self.low_min, float(share(terms.low_clipped).min()))
            self.high_max = max(self.high_max, float(share(terms.high_clipped).max()))
            if terms.vespo_phi is not None:  # one phi per sequence, repeated over its terms
                self.phi += float(share(terms.vespo_phi).sum())
                self.phi_sequences += float(trains.sum())
        self.ratio += float(terms.ratio.sum())
        if terms.kl is not None:
            self.has_kl = True
            self.kl += float(terms.kl.sum())
        if entropy is not None:
            self.entropy += float(entropy.sum())
        if entropy is not None and self.bonus:
            kept = entropy if terms.entropy_mask is None else entropy[terms.entropy_mask]
            self.bonus_entropy += float(kept.double().sum())
            self.bonus_tokens += kept.numel()
        if not padding:  # a rank's empty row (one pad token, run so that every rank runs as many rows) is none
            self.flat_tokens += packed.num_flat_tokens
            self.unique_tokens += packed.num_unique_tokens
            self.rows += 1

    def metrics(self) -> dict[str, float]:
        metrics = {
            "loss": self.loss,
            "ratio/mean": Pooled(self.ratio, self.tokens),
            "entropy": Pooled(self.entropy, self.tokens),
            "packing_ratio": Pooled(self.flat_tokens, self.unique_tokens),
            "trained_tokens": float(self.tokens),
            "flat_tokens": float(self.flat_tokens),  # each rollout's prompt and completion, as TRL's num_tokens counts a step's
            "rows": float(self.rows),
        }
        if self.clips:  # a rank that trained no token gives the extremes no bound (inf), which the ranks' min/max pass over
            metrics |= {"clip/low": Pooled(self.low, self.clip_units), "clip/high": Pooled(self.high, self.clip_units),
                        "clip/fraction": Pooled(self.low + self.high, self.clip_units),
                        "clip/low_min": self.low_min, "clip/high_max": self.high_max}  # fmt: skip
        if self.vespo:  # on every rank, one that trained no sequence too (0): the ranks log the same names
            metrics["vespo/phi_seq_mean"] = Pooled(self.phi, self.phi_sequences)  # TRL's name
        if self.has_kl:
            metrics["kl"] = Pooled(self.kl, self.tokens)
        if self.logs_policy_loss:  # TRL logs it where an entropy bonus may apply
            metrics["policy_loss"] = self.policy_loss
        if self.grad_norm is not None:
            metrics["grad_norm"] = float(self.grad_norm)
        return metrics


def batch_metrics(scored: ScoredBatch, with_tools: bool) -> dict[str, Any]:
    """The figures of a batch of scored rollouts (``with_tools``: its tool calls and their failures too)."""
    rewards = torch.tensor(scored.rewards)
    rollouts = scored.rollouts
    metrics = {
        "reward/mean": rewards.nanmean(),
        "reward/std": _nanstd(rewards),
        "reward/frac_zero_std": _frac_tied_groups(rewards, [r.group_id for r in rollouts]),  # TRL's frac_reward_zero_std
        "reward/unscored": float(rewards.isnan().sum()),  # samples no reward function applied to (all returned None)
        "reward/errors": float(sum(scored.reward_failure_kinds.values())),  # every function's failures, counted as below
        "rollout/weight_version": float(scored.weight_version),
        "rollout/completion_tokens": Pooled(sum(sum(r.completion_mask) for r in rollouts), len(rollouts)),
        "speed/generation_tokens_per_s": sum(len(r.completion_ids) for r in rollouts) / max(scored.generation_seconds, 1e-9),
        "dynamic_sampling/rounds": float(scored.sampling_rounds),
        "dynamic_sampling/filtered_fraction": Pooled(scored.filtered_groups, scored.sampled_groups),
        "completions/truncated_fraction": Pooled(sum(r.finish_reason == "length" for r in rollouts), len(rollouts)),
        **_lengths([sum(r.completion_mask) for r in rollouts]),  # the tokens the model wrote (not a tool's), as TRL
        **_lengths([sum(r.completion_mask) for r in rollouts if r.finish_reason != "length"], "terminated_"),  # those that ended
        # Left out of the advantages and the loss for infrastructure failures (the rest are what was trained).
        "rollouts/excluded": float(sum(scored.excluded_rollouts.values())),
        "groups/excluded": float(scored.excluded_groups),
        "rollouts/regenerated_stale": float(scored.stale_regenerations),
        # Every reason and kind at every step, 0 where none: a figure logged only at some steps stays in a logger's
        # summary (W&B's) as its last value.
        **{f"rollouts/excluded/{reason}": float(scored.excluded_rollouts.get(reason, 0)) for reason in get_args(InfraFailure)},
    }
    # Every sample the step's sampling scored, as tool failures are counted: one a timeout failed was left out.
    failed = scored.reward_failure_kinds
    for name, values in scored.reward_terms.items():
        terms = torch.tensor(values)
        metrics[f"reward/{name}/mean"] = terms.nanmean()  # over the samples it applied to (did not return None)
        metrics[f"reward/{name}/std"] = _nanstd(terms)
        metrics[f"reward/{name}/errors"] = float(failed.get(f"{name}/raised", 0))  # samples scored 0 because it raised
        metrics[f"reward/{name}/non_finite"] = float(failed.get(f"{name}/non_finite", 0))  # ... or returned +-inf
        metrics[f"reward/{name}/timeouts"] = float(failed.get(f"{name}/timeout", 0))  # ... or ran past reward_timeout_s (left out)
    for name, values in scored.logged_metrics.items():  # a reward function's log_metric, averaged over the step
        metrics[f"reward_metric/{name}"] = sum(values) / len(values)
    if with_tools:
        # Every call the step's sampling made, as its failures are counted: a dropped or left-out rollout's too.
        metrics["tools/calls"] = float(scored.tool_calls)
        for kind in TOOL_FAILURE_KINDS:
            metrics[f"tools/failures/{kind}"] = float(scored.tool_failures.get(kind, 0))
        # TRL's: calls per sampled completion, and the share of calls that failed (0 without calls).
        metrics["tools/call_frequency"] = Pooled(scored.tool_calls, scored.sampled_rollouts)
        metrics["tools/failure_frequency"] = Pooled(sum(scored.tool_failures.values()), scored.tool_calls)
        # Completions ended at the context: their last calls ran, and their results did not fit in max_context_tokens.
        metrics["tools/context_ended_fraction"] = Pooled(sum(r.metadata.get("ended") == "context_length" for r in rollouts), len(rollouts))
    return metrics


def step_metrics(scored: ScoredBatch, stats: StepStats, staleness: int, waited: float, train_seconds: float, with_tools: bool,
                 extra: dict[str, float]) -> dict[str, Any]:
    """One optimizer step's ``train/`` figures (without the prefix): its batch's, its staleness and times, the
    step's own, then ``extra``."""
    return {
        **batch_metrics(scored, with_tools=with_tools),
        "rollout/staleness": float(staleness),
        "time/wait_for_rollouts_s": waited,
        "time/train_s": train_seconds,
        "speed/train_tokens_per_s": stats.unique_tokens / max(train_seconds, 1e-9),
        "lr": stats.lr,
        **stats.metrics(),
        **extra,
    }


# How every rank's figure of a step makes the step's: counts add up, extremes are the extremes of the ranks', ratios
# of sums (`Pooled`) and means of samples are taken over every rank's (`_over_ranks`), and the rest (settings, times,
# figures every rank shares) are averaged.
_REDUCTIONS = ((re.compile(r"(unscored|errors|non_finite|timeouts|excluded(/\w+)?|regenerated_stale|calls|failures/\w+|trained_tokens|flat_tokens|rows|restarts)$"), "sum"),
               (re.compile(r"(max_(terminated_)?length|_max)$"), "max"), (re.compile(r"(min_(terminated_)?length|_min)$"), "min"))  # fmt: skip


def log_step(module: LightningModule, metrics: dict[str, Any], scored: ScoredBatch) -> float:
    """Log a step's ``train/`` figures as the step's, over every rank (each rank's alone was rank 0's in the logs),
    and return the step's mean reward over every rank's scored samples (summary.json's reward history)."""
    rewards = torch.tensor(scored.rewards)
    over_ranks: dict[str, float] = {}  # figures already over every rank's samples: the same on every rank
    if module.trainer.world_size > 1:
        # The log_metric names every rank logs, in one order (Lightning reduces a rank's figures in its own order).
        pooled = {key: value for key, value in metrics.items() if isinstance(value, Pooled)}
        over_ranks = _over_ranks(module, _samples(scored), pooled)
        metrics = {key: value for key, value in metrics.items() if not key.startswith("reward_metric/")} | over_ranks
    metrics |= _extremes(module, metrics)
    by_reduction: dict[str, dict[str, Any]] = {}
    for key, value in sorted(metrics.items()):  # one order on every rank: Lightning reduces each name as it is logged
        # A log_metric name that reads like one of the library's counts ("parse_errors") is the user's mean.
        fx = "mean" if key in over_ranks or key.startswith("reward_metric/") else _reduction(key)
        by_reduction.setdefault(fx, {})[f"train/{key}"] = value
    for fx, figures in sorted(by_reduction.items()):
        module.log_dict(figures, on_step=True, prog_bar=False, batch_size=1, sync_dist=True, reduce_fx=fx)
    scored = ~rewards.isnan()
    total, count = module.trainer.strategy.reduce(torch.stack([rewards[scored].sum(), scored.sum()]).double().to(module.device), reduce_op="sum").tolist()
    mean = total / count if count else float("nan")
    module.log("train/reward", mean, prog_bar=True, batch_size=1)
    return mean


def _samples(scored: ScoredBatch) -> dict[tuple[str, str | None], list[float]]:
    """The samples behind each figure that is a mean (and std) of samples, by its keys (mean, std or None): the
    rewards, each reward's terms, and each value a reward function logged (``log_metric``)."""
    samples: dict[tuple[str, str | None], list[float]] = {("reward/mean", "reward/std"): scored.rewards}
    samples.update({(f"reward/{name}/mean", f"reward/{name}/std"): values for name, values in scored.reward_terms.items()})
    samples.update({(f"reward_metric/{name}", None): values for name, values in scored.logged_metrics.items()})
    return samples


def _over_ranks(module: LightningModule, samples: dict[tuple[str, str | None], list[float]], pooled: dict[str, Pooled]) -> dict[str, float]:
    """The figures of ``samples`` over every rank's samples, as TRL takes them over every process's: each rank's mean
    and std averaged was neither (ranks score different numbers of samples: a None is left out), and a value
    logged by one rank alone, or by the ranks in another order, mixed up the names Lightning reduces by position.
    Each ``pooled`` figure is its sums over every rank, divided once."""
    every: list[Any] = [None] * module.trainer.world_size
    torch.distributed.all_gather_object(every, (list(samples), list(pooled)))
    keys = sorted(set().union(*(set(named) for named, _ in every)), key=str)
    ratios = sorted(set().union(*(set(named) for _, named in every)))
    moments = []
    for key in keys:
        values = torch.tensor(samples.get(key, []), dtype=torch.float64)
        present = values[~values.isnan()]
        moments.append([present.numel(), present.sum(), present.square().sum()])
    moments += [[pooled[key].count, pooled[key].total, 0.0] if key in pooled else [0.0, 0.0, 0.0] for key in ratios]
    n, total, squares = module.trainer.strategy.reduce(torch.tensor(moments, dtype=torch.float64, device=module.device), reduce_op="sum").cpu().T.tolist()
    figures: dict[str, float] = {key: float(Pooled(sum_, count)) for key, count, sum_ in zip(ratios, n[len(keys):], total[len(keys):])}
    for (mean, std), count, sum_, sum_sq in zip(keys, n, total, squares):
        figures[mean] = sum_ / count if count else math.nan
        if std is not None:  # unbiased, NaN for fewer than two (as `_nanstd`)
            figures[std] = math.sqrt(max(sum_sq - sum_ * sum_ / count, 0.0) / (count - 1)) if count > 1 else math.nan
    return figures


def _lengths(lengths: list[int], kind: str = "") -> dict[str, float]:
    """Completion lengths in tokens, as TRL names them (``completions/mean_length``, ``min_length``, ``max_length``;
    ``kind`` ``terminated_``: of the completions that ended, TRL's ``mean_terminated_length`` ...), 0 where none: on
    every rank, one without any too (the ranks log the same names, and `_extremes` passes over its infinities)."""
    return {f"completions/mean_{kind}length": Pooled(sum(lengths), len(lengths)), f"completions/min_{kind}length": float(min(lengths, default=math.inf)),
            f"completions/max_{kind}length": float(max(lengths, default=-math.inf))}  # fmt: skip


def _extremes(module: LightningModule, metrics: dict[str, Any]) -> dict[str, float]:
    """Each figure that is a smallest or a largest (`_REDUCTIONS`), over every rank that has one: a rank without (no
    completion that ended, no token trained) gives an infinite bound, which the others' pass over; where no rank has
    one, TRL's: 0 for a length, NaN for a clip figure (no sequence trained), never an infinity in the logs."""
    keys = [key for key in metrics if _reduction(key) in ("min", "max")]
    signs = [-1.0 if _reduction(key) == "min" else 1.0 for key in keys]
    local = torch.tensor([sign * float(metrics[key]) for key, sign in zip(keys, signs)], dtype=torch.float64, device=module.device)
    if module.trainer.world_size > 1:
        local = module.trainer.strategy.reduce(local, reduce_op="max")
    return {key: sign * value if math.isfinite(value) else 0.0 if key.endswith("length") else math.nan
            for key, sign, value in zip(keys, signs, local.tolist())}


def _reduction(key: str) -> str:
    return next((fx for pattern, fx in _REDUCTIONS if pattern.search(key)), "mean")


def _frac_tied_groups(rewards: torch.Tensor, groups: list[int]) -> Pooled:
    """The share of the batch's groups whose scored rewards all tie (std 0: no advantage, nothing to learn from),
    up to the rounding of the std (``isclose`` to 0, as TRL tests it: eight rewards of 0.1 have a float32 std of 1e-9).
    A group with fewer than two scored rewards has no std, and is not counted as tied (TRL's nanstd is NaN there)."""
    by_group: dict[int, list[float]] = {}
    for reward, group in zip(rewards.tolist(), groups, strict=True):
        by_group.setdefault(group, []).append(reward)
    scored = [values[~values.isnan()] for values in map(torch.tensor, by_group.values())]
    tied = [present.numel() > 1 and bool(torch.isclose(std := present.std(), torch.zeros_like(std))) for present in scored]
    return Pooled(sum(tied), len(tied))


def _nanstd(values: torch.Tensor) -> torch.Tensor:
    """The unbiased std of the values that are not NaN (TRL's ``nanstd``): NaN for fewer than two, as TRL logs it."""
    present = values[~values.isnan()]
    return present.std() if present.numel() > 1 else torch.tensor(math.nan)


def rollout_table(scored: ScoredBatch, text: Callable[[Sequence[int]], str], step: int, advantages: Sequence[float]) -> tuple[list[str], list[list[Any]]]:
    """The batch as a table (columns, rows): the trainer step that first trained it (the logged figures' ``step``) and
    the batch's index (they differ with ``num_iterations`` > 1), prompt, completion, reward, advantage (TRL's table
    has it too), each reward term and each
    column the reward functions logged (``log_extra``) per rollout. A term or logged column named like a column before
    it is ``reward/NAME`` or ``extra/NAME`` (a term named ``reward`` replaced the weighted total, a column ``step``
    the step that a resume's rewrite of the table goes by)."""
    names, logged = list(scored.reward_terms), list(scored.logged_columns)
    columns = ["step", "batch", "prompt", "completion", "reward", "advantage", "weight_version"]
    for kind, keys in (("reward", names), ("extra", logged)):
        columns += [key if key not in columns else f"{kind}/{key}" for key in keys]
    rows = [
        [step, scored.index, text(r.prompt_ids), text(r.completion_ids), scored.rewards[i], float(advantages[i]), r.weight_version]
        + [scored.reward_terms[name][i] for name in names] + [scored.logged_columns[name][i] for name in logged]
        for i, r in enumerate(scored.rollouts)
    ]
    return columns, rows


def run_summary(reward_history: Sequence[float], summary_window: int, trained_batches: Sequence[dict[str, int]]) -> dict[str, Any]:
    """summary.json's figures of the steps: reward means of the first and last ``summary_window`` steps (at most half
    the run each), the steps, and the stalest batch trained."""
    window = max(1, min(summary_window, len(reward_history) // 2 or 1))

    def mean(values: Sequence[float]) -> float:  # over the steps that scored any sample (a step of None rewards is NaN)
        scored = [value for value in values if not math.isnan(value)]
        return sum(scored) / len(scored) if scored else float("nan")

    return {
        "reward_first_window_mean": mean(reward_history[:window]),
        "reward_last_window_mean": mean(reward_history[-window:]),
        "reward_window": window,
        "grpo_steps": len(reward_history),
        "max_staleness_seen": max((b["index"] - b["weight_version"] for b in trained_batches), default=0),
    }


ROLLOUTS_FILE = "rollouts.jsonl"


def log_rollouts(trainer: Trainer, step: int, table: tuple[list[str], list[list[Any]]]) -> None:
    """A batch's rollout table (``rollout_table``), logged at trainer step ``step``: a W&B table when the run logs to
    W&B, rows of rollouts.jsonl when it logs elsewhere (CSV), nothing when it logs nowhere. Rank zero's rollouts, as a
    logger has them: each rank samples its own. The rows go to the run's folder: OUTPUT_DIR under the command, and
    under a Trainer of one's own the first logger's folder (``trainer.log_dir``, ``lightning_logs/version_N``), so
    that a second experiment in the same working directory keeps the first one's rows."""
    columns, rows = table
    wandb = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
    for logger in wandb:
        logger.log_table(key="rollouts", columns=columns, data=rows, step=step)
    if trainer.loggers and not wandb and trainer.is_global_zero:
        folder = Path(trainer.default_root_dir)
        if not is_run_folder(folder):  # as ``trainer.log_dir``, which broadcasts: only rank zero is here
            first = trainer.loggers[0]  # a logger without a folder of its own (MLflow's): its name and version under its save_dir
            own = getattr(first, "log_dir", None) or Path(first.save_dir or folder, *(str(part) for part in (first.name, first.version) if part is not None))
            folder = Path(own)
            folder.mkdir(parents=True, exist_ok=True)
        append_rows(folder / ROLLOUTS_FILE, [dict(zip(columns, row, strict=True)) for row in rows])


def append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append one batch's rows (their ``step`` the same) to a JSONL file. Rows already there of that step or a later
    one (a resumed run redoing steps, another pass over the batch) are replaced rather than repeated."""
    step = rows[0]["step"]
    text = "".join(json.dumps(_json_safe(row), default=str) + "\n" for row in rows)
    last = _last_line(path)
    if last is None or json.loads(last)["step"] < step:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if json.loads(line)["step"] < step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept) + text, encoding="utf-8")
    os.replace(tmp, path)


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as None (JSON has no NaN: a sample a reward returned None for)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _last_line(path: Path) -> bytes | None:
    """The file's last line, read from its end (the file grows over a run); None for no file or an empty one."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        end = f.seek(0, os.SEEK_END)
        start, tail = end, b""
        while start > 0 and tail.rstrip(b"\n").count(b"\n") == 0:
            start = max(0, start - 65536)
            f.seek(start)
            tail = f.read(end - start)
    lines = tail.rstrip(b"\n").split(b"\n")
    return lines[-1] if lines[-1] else None
