"""Ours against TRL 1.16 on identical inputs: SFT and GRPO training steps, log-prob memory, tree packing.

    python benchmarks/compare_trl.py --out benchmarks/results/compare_trl.json      (--quick: small sizes)

One process. Both sides load the same tiny Qwen3 weights (built from a config, saved, loaded back with
``from_pretrained``) into separate copies, get the same data, and take the same AdamW step; rounds alternate ours
and TRL's, and the figures are medians. TRL runs what its trainers run on a CPU:

- SFT: ``SFTTrainer.training_step`` on ``DataCollatorForLanguageModeling(padding_free=True)`` batches (SDPA with
  the block-diagonal mask transformers derives from ``position_ids``; TRL's fused LM head). Ours: the SFT loss of
  ``SFTModule`` (``packed_logprobs``) on the ``PackedCollator`` row, tree-packed, and flat as a control.
- GRPO: ``GRPOTrainer.compute_loss`` on its padded prompt/completion batch (no generation). Ours: the loss of
  ``GRPOModule`` on its tree-packed row. TRL's tree attention (async GRPO) needs FlashAttention-3 on a GPU, so it
  cannot run here; its tree planner (``TreeRow``) is compared on packing alone.
- Log-probs: TRL's ``ChunkedLogProbFunction`` (the torch fallback of its fused LM head, at the vocabulary tile its
  trainers use) against our ``token_logprobs``.

Every step includes collation/packing and the optimizer step. Ratios: ours/TRL speed (>1: ours faster) and
TRL/ours peak memory (>1: ours smaller). Peaks are allocation peaks from the profiler (``memory.py``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning
import torch
import transformers
from torch.profiler import ProfilerActivity, profile
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.utils import logging as hf_logging
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.experimental.async_grpo.packing import TreeRow
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

sys.path.insert(0, str(Path(__file__).parent))
from memory import peak_memory_bytes  # noqa: E402

from lightning_rl.data.sft import Example, PackedCollator  # noqa: E402
from lightning_rl.losses import GRPOLoss, StepCounts, group_advantages  # noqa: E402
from lightning_rl.models.loading import load_causal_lm  # noqa: E402
from lightning_rl.toy.model import build_tokenizer  # noqa: E402
from lightning_rl.modules.grpo import GRPOModule  # noqa: E402
from lightning_rl.ops.logprobs import token_logprobs  # noqa: E402
from lightning_rl.ops.packed_forward import packed_logprobs  # noqa: E402
from lightning_rl.packing import pack_sequences  # noqa: E402
from lightning_rl.rollout.base import Rollout, padded_rollouts  # noqa: E402

MB = 2**20
LEARNING_RATE = 1e-5
PACK_REPEATS = 10  # packing takes milliseconds: time ten in a row


@dataclass(frozen=True)
class Sizes:
    hidden: int = 128
    layers: int = 2
    vocab: int = 32768
    sft_prompts: int = 2
    sft_responses: int = 4  # responses per prompt: what tree packing shares
    sft_prompt_len: int = 192
    sft_response_len: int = 64
    grpo_prompts: int = 1
    grpo_group: int = 8
    grpo_prompt_len: int = 256
    grpo_completion_len: int = 64
    logprob_tokens: int = 8192
    logprob_vocab: int = 32768
    logprob_hidden: int = 128
    rounds: int = 5
    profile: bool = True  # one profiled step per side: where the time goes


QUICK = Sizes(hidden=64, layers=2, vocab=1024, sft_prompts=2, sft_responses=3, sft_prompt_len=48, sft_response_len=16,
              grpo_prompts=2, grpo_group=3, grpo_prompt_len=32, grpo_completion_len=12, logprob_tokens=1024,
              logprob_vocab=4096, logprob_hidden=64, rounds=2, profile=False)  # fmt: skip


# -- shared inputs -------------------------------------------------------------------------------------------------


def build_model_folder(path: Path, sizes: Sizes) -> Path:
    """A Qwen3 model with seeded random weights and the embedded tokenizer, written with save_pretrained."""
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=3 * sizes.hidden,
        num_hidden_layers=sizes.layers, num_attention_heads=max(1, sizes.hidden // 32),
        num_key_value_heads=max(1, sizes.hidden // 64), head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def random_tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def sft_examples(sizes: Sizes, eos: int, rng: random.Random) -> list[Example]:
    """Prompt/completion pairs, several responses per prompt; the loss is on the response and its end token."""
    examples = []
    for _ in range(sizes.sft_prompts):
        prompt = random_tokens(rng, sizes.vocab, sizes.sft_prompt_len)
        for _ in range(sizes.sft_responses):
            response = random_tokens(rng, sizes.vocab, rng.randint(sizes.sft_response_len // 2, sizes.sft_response_len)) + [eos]
            examples.append(Example(prompt + response, [False] * len(prompt) + [True] * len(response)))
    return examples


def grpo_rollouts(sizes: Sizes, rng: random.Random) -> tuple[list[Rollout], torch.Tensor]:
    """Groups of completions sharing their prompt, with engine log-probs and group-normalised advantages."""
    rollouts = []
    for g in range(sizes.grpo_prompts):
        prompt = random_tokens(rng, sizes.vocab, sizes.grpo_prompt_len)
        for _ in range(sizes.grpo_group):
            completion = random_tokens(rng, sizes.vocab, rng.randint(sizes.grpo_completion_len // 2, sizes.grpo_completion_len))
            logprobs = [-3.0 - rng.random() for _ in completion]
            rollouts.append(Rollout(prompt, completion, logprobs, weight_version=0, group_id=g))
    rewards = torch.tensor([rng.random() for _ in rollouts])
    advantages = group_advantages(rewards, torch.tensor([r.group_id for r in rollouts]))
    return rollouts, advantages


def nested_fork_sequences(sizes: Sizes, rng: random.Random) -> tuple[list[list[int]], list[list[bool]]]:
    """Prompt -> 4 first turns -> 2 tool results and answers each: forks inside forks."""
    prompt = random_tokens(rng, sizes.vocab, sizes.grpo_prompt_len)
    seqs, masks = [], []
    for _ in range(4):
        turn = random_tokens(rng, sizes.vocab, sizes.grpo_completion_len)
        for _ in range(2):
            tool, answer = random_tokens(rng, sizes.vocab, 16), random_tokens(rng, sizes.vocab, sizes.grpo_completion_len)
            seqs.append(prompt + turn + tool + answer)
            masks.append([False] * len(prompt) + [True] * len(turn) + [False] * len(tool) + [True] * len(answer))
    return seqs, masks


# -- measurement ---------------------------------------------------------------------------------------------------


def alternate(steps: dict[str, Callable[[], object]], rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and process-CPU seconds of each step: one warm-up each, then rounds that alternate their order.

    CPU seconds (all threads of this process) move less than wall seconds when other work shares the machine.
    """
    for step in steps.values():
        step()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    median = lambda times: {name: statistics.median(values) for name, values in times.items()}  # noqa: E731
    return median(wall), median(cpu)


def top_ops(steps: dict[str, Callable[[], object]], count: int = 8) -> dict[str, list[tuple[str, float]]]:
    """Where each step's CPU time goes: the operators with the largest share of self time (profiler)."""
    shares = {}
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events)
        events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        shares[name] = [(e.key, round(e.self_cpu_time_total / total, 3)) for e in events[:count]]
    return shares


def peaks_mb(steps: dict[str, Callable[[], object]]) -> dict[str, float]:
    return {name: peak_memory_bytes(step) / MB for name, step in steps.items()}


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def max_grad_difference(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    """Largest |g_ours - g_theirs| over all parameters, relative to the largest |g_theirs|."""
    theirs_grads = dict(theirs.named_parameters())
    diff = scale = 0.0
    for name, param in ours.named_parameters():
        other = theirs_grads[name].grad
        diff = max(diff, float((param.grad - other).abs().max()))
        scale = max(scale, float(other.abs().max()))
    return diff / max(scale, 1e-30)


# -- 1. SFT --------------------------------------------------------------------------------------------------------


class SFTSides:
    """The same SFT batch and weights for TRL's SFTTrainer and for ours (tree-packed, and flat as a control)."""

    ours_names = ("ours_tree", "ours_flat")

    def __init__(self, model_path: Path, sizes: Sizes, workdir: Path) -> None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
        self.examples = sft_examples(sizes, tokenizer.eos_token_id, random.Random("sft"))
        # What SFTTrainer's dataset preparation makes of a completion mask: labels, -100 off the completion.
        self.rows = [{"input_ids": e.input_ids, "labels": [t if m else -100 for t, m in zip(e.input_ids, e.loss_mask)]}
                     for e in self.examples]  # fmt: skip
        args = SFTConfig(
            output_dir=str(workdir / "sft"), padding_free=True, max_length=None, per_device_train_batch_size=len(self.rows),
            report_to=[], use_cpu=True, bf16=False, dataset_kwargs={"skip_prepare_dataset": True},
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa", dtype=torch.float32)
        self.trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(self.rows), processing_class=tokenizer)
        self.trainer.current_gradient_accumulation_steps = 1  # what its training loop sets before each step
        self.trainer.model.train()
        self.collators = {name: PackedCollator(share_prefixes=(name == "ours_tree"), pad_to_multiple_of=None,
                                               pad_token_id=tokenizer.pad_token_id) for name in self.ours_names}  # fmt: skip
        self.models = {name: load_causal_lm(str(model_path)).train() for name in self.ours_names}

    def ours_loss(self, name: str) -> torch.Tensor:
        """SFTModule's loss: mean negative log-prob of the trained tokens of the packed row."""
        return -packed_logprobs(self.models[name], self.collators[name](self.examples)).mean()

    def trl_forward_backward(self) -> torch.Tensor:
        """SFTTrainer's step before the optimizer: collate padding-free, fused-LM-head loss, backward."""
        return self.trainer.training_step(self.trainer.model, self.trainer.data_collator(self.rows))


def sft_agreement(sides: SFTSides) -> dict[str, dict[str, float]]:
    """Loss and gradients of each of our layouts against TRL's, on the same weights (before any step)."""
    their_loss = float(sides.trl_forward_backward())
    agreement = {}
    for name, model in sides.models.items():
        loss = sides.ours_loss(name)
        loss.backward()
        agreement[name] = {"loss_ours": float(loss), "loss_trl": their_loss, "abs_diff": abs(float(loss) - their_loss),
                           "max_rel_grad_diff": max_grad_difference(model, sides.trainer.model)}  # fmt: skip
        model.zero_grad(set_to_none=True)
    sides.trainer.model.zero_grad(set_to_none=True)
    return agreement


def bench_sft(model_path: Path, sizes: Sizes, workdir: Path) -> dict:
    sides = SFTSides(model_path, sizes, workdir)
    agreement = sft_agreement(sides)
    optimizers = {name: adamw(model) for name, model in sides.models.items()}
    optimizers["trl"] = adamw(sides.trainer.model)

    def ours(name: str) -> Callable[[], None]:
        def step() -> None:
            sides.ours_loss(name).backward()
            optimizer_step(optimizers[name])

        return step

    def theirs() -> None:
        sides.trl_forward_backward()
        optimizer_step(optimizers["trl"])

    steps = {"trl": theirs, **{name: ours(name) for name in sides.ours_names}}
    seconds, cpu = alternate(steps, sizes.rounds)
    peaks = peaks_mb(steps)
    breakdown = top_ops(steps) if sizes.profile else None
    tree = sides.collators["ours_tree"](sides.examples)
    result = {
        "examples": len(sides.examples), "flat_tokens": tree.num_flat_tokens, "unique_tokens": tree.num_unique_tokens,
        "trained_tokens": int(tree.loss_targets.numel()), "t_over_u": round(tree.packing_ratio, 3), "agreement": agreement,
        # TRL's fused head scores only labelled positions with Triton; its CPU fallback scores every position.
        "lm_head_positions": {"trl": tree.num_flat_tokens - 1, "ours": int(tree.loss_targets.numel())},
        "attention_pairs": {"trl_dense_mask": tree.num_flat_tokens**2, "ours": int((tree.position_ids + 1).sum())},
        "top_ops": breakdown,
    }  # fmt: skip
    for name in steps:
        result[name] = {"step_s": round(seconds[name], 4), "step_cpu_s": round(cpu[name], 4),
                        "tokens_per_s": round(tree.num_flat_tokens / seconds[name], 1), "peak_mb": round(peaks[name], 1)}  # fmt: skip
    for name in sides.ours_names:
        result[f"{name}_speed_ratio"] = round(seconds["trl"] / seconds[name], 3)
        result[f"{name}_cpu_ratio"] = round(cpu["trl"] / cpu[name], 3)
        result[f"{name}_memory_ratio"] = round(peaks["trl"] / peaks[name], 3)
    return result


# -- 2. GRPO -------------------------------------------------------------------------------------------------------


def trl_grpo_inputs(rollouts: list[Rollout], advantages: torch.Tensor, pad: int) -> dict[str, torch.Tensor]:
    """The batch GRPOTrainer trains on: the padded rollouts, per-sequence advantages, the step's token count."""
    batch = padded_rollouts(rollouts, pad)
    tokens = float(batch["completion_mask"].sum())
    return {**batch, "advantages": advantages, "num_items_in_batch": torch.tensor(tokens)}


class GRPOSides:
    """The same fixed rollouts and weights for TRL's GRPOTrainer loss and for our GRPOModule's (DAPO, no KL)."""

    def __init__(self, model_path: Path, sizes: Sizes, workdir: Path) -> None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
        self.pad = tokenizer.pad_token_id
        self.rollouts, self.advantages = grpo_rollouts(sizes, random.Random("grpo"))
        self.module = GRPOModule(model_name_or_path=str(model_path), num_generations=sizes.grpo_group,
                                 sampling={"max_new_tokens": sizes.grpo_completion_len}, loss=GRPOLoss("dapo", epsilon_low=0.2, epsilon_high=0.2))  # fmt: skip
        self.module.configure_model()
        # The module reads its device and static-shape needs from the Trainer it belongs to.
        self.module.trainer = lightning.pytorch.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        theirs = copy.deepcopy(self.module.policy)  # same weights, copied before our forward switches the attention
        config = GRPOConfig(
            output_dir=str(workdir / "grpo"), loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.2,
            num_generations=sizes.grpo_group, per_device_train_batch_size=len(self.rollouts),
            max_completion_length=sizes.grpo_completion_len, report_to=[], use_cpu=True, bf16=False,
        )  # fmt: skip
        self.trainer = GRPOTrainer(
            model=theirs, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
            train_dataset=Dataset.from_list([{"prompt": "x"}] * len(self.rollouts)), processing_class=tokenizer,
        )  # fmt: skip
        self.trainer.current_gradient_accumulation_steps = 1
        self.trainer.model.train()
        trained = sum(len(r.completion_ids) for r in self.rollouts)
        self.counts = StepCounts(num_sequences=len(self.rollouts), num_tokens=trained, rank_tokens=trained,
                                 max_completion_length=sizes.grpo_completion_len)  # fmt: skip

    def ours_loss(self) -> torch.Tensor:
        """GRPOModule's step loss on one tree-packed row: pack -> log-probs -> clipped loss, step-normalised."""
        packed = self.module.pack_rollouts(self.rollouts, self.advantages)
        terms, _ = self.module.row_loss(packed)
        seq_tokens = torch.bincount(packed.loss_seq, minlength=packed.num_sequences)
        return (terms.loss * self.module.loss.token_weights(packed.loss_seq, seq_tokens, self.counts)).sum()

    def trl_loss(self) -> torch.Tensor:
        return self.trainer.compute_loss(self.trainer.model, trl_grpo_inputs(self.rollouts, self.advantages, self.pad))


def grpo_agreement(sides: GRPOSides) -> dict[str, float]:
    ours, theirs = sides.ours_loss(), sides.trl_loss()
    ours.backward()
    theirs.backward()
    agreement = {"loss_ours": float(ours), "loss_trl": float(theirs), "abs_diff": abs(float(ours) - float(theirs)),
                 "max_rel_grad_diff": max_grad_difference(sides.module.policy, sides.trainer.model)}  # fmt: skip
    sides.module.policy.zero_grad(set_to_none=True)
    sides.trainer.model.zero_grad(set_to_none=True)
    return agreement


def bench_grpo(model_path: Path, sizes: Sizes, workdir: Path) -> dict:
    sides = GRPOSides(model_path, sizes, workdir)
    agreement = grpo_agreement(sides)
    optimizers = {"ours_tree": adamw(sides.module.policy), "trl": adamw(sides.trainer.model)}

    def ours_step() -> None:
        sides.ours_loss().backward()
        optimizer_step(optimizers["ours_tree"])

    def theirs_step() -> None:
        sides.trainer.accelerator.backward(sides.trl_loss())
        optimizer_step(optimizers["trl"])

    steps = {"trl": theirs_step, "ours_tree": ours_step}
    seconds, cpu = alternate(steps, sizes.rounds)
    peaks = peaks_mb(steps)
    breakdown = top_ops(steps) if sizes.profile else None
    packed = sides.module.pack_rollouts(sides.rollouts, sides.advantages)
    padded = trl_grpo_inputs(sides.rollouts, sides.advantages, sides.pad)
    result = {
        "sequences": len(sides.rollouts), "flat_tokens": packed.num_flat_tokens, "unique_tokens": packed.num_unique_tokens,
        "trl_padded_tokens": int(padded["prompt_ids"].numel() + padded["completion_ids"].numel()),
        "trained_tokens": sides.counts.num_tokens, "t_over_u": round(packed.packing_ratio, 3), "agreement": agreement,
        "speed_ratio": round(seconds["trl"] / seconds["ours_tree"], 3), "cpu_ratio": round(cpu["trl"] / cpu["ours_tree"], 3),
        "memory_ratio": round(peaks["trl"] / peaks["ours_tree"], 3), "top_ops": breakdown,
        "lm_head_positions": {"trl": int(padded["prompt_ids"].shape[0] * (padded["prompt_ids"].shape[1] + padded["completion_ids"].shape[1] - 1)),
                              "ours": int(packed.loss_targets.numel())},
        "attention_pairs": {"trl_padded": int(padded["prompt_ids"].shape[0] * (padded["prompt_ids"].shape[1] + padded["completion_ids"].shape[1]) ** 2),
                            "ours": int((packed.position_ids + 1).sum())},
    }  # fmt: skip
    for name in steps:
        result[name] = {"step_s": round(seconds[name], 4), "step_cpu_s": round(cpu[name], 4), "peak_mb": round(peaks[name], 1)}
    return result


# -- 3. log-prob memory --------------------------------------------------------------------------------------------


def bench_logprobs(sizes: Sizes) -> dict:
    torch.manual_seed(0)
    hidden = torch.randn(sizes.logprob_tokens, sizes.logprob_hidden, requires_grad=True)
    weight = (torch.randn(sizes.logprob_vocab, sizes.logprob_hidden) * 0.02).requires_grad_()
    targets = torch.randint(sizes.logprob_vocab, (sizes.logprob_tokens,))
    values = {}

    def run(name: str, fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            hidden.grad = weight.grad = None
            logprobs = fn()
            (-logprobs.mean()).backward()
            values[name] = (logprobs.detach(), hidden.grad.clone())

        return step

    steps = {
        "trl": run("trl", lambda: ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",))[0]),
        "ours": run("ours", lambda: token_logprobs(hidden, weight, targets)),
    }  # fmt: skip
    peaks = peaks_mb(steps)
    seconds, cpu = alternate(steps, max(1, sizes.rounds // 2))
    return {
        "tokens": sizes.logprob_tokens, "vocab": sizes.logprob_vocab, "hidden": sizes.logprob_hidden,
        "fp32_logits_mb": round(sizes.logprob_tokens * sizes.logprob_vocab * 4 / MB, 1),
        **{name: {"peak_mb": round(peaks[name], 1), "fwd_bwd_s": round(seconds[name], 3), "fwd_bwd_cpu_s": round(cpu[name], 3)}
           for name in steps},
        "memory_ratio": round(peaks["trl"] / peaks["ours"], 3), "speed_ratio": round(seconds["trl"] / seconds["ours"], 3),
        "cpu_ratio": round(cpu["trl"] / cpu["ours"], 3),
        "max_abs_logprob_diff": float((values["trl"][0] - values["ours"][0]).abs().max()),
        "max_abs_grad_diff": float((values["trl"][1] - values["ours"][1]).abs().max()),
    }  # fmt: skip


# -- 4. packing ----------------------------------------------------------------------------------------------------


def trl_tree_row(seqs: list[list[int]], masks: list[list[bool]], groups: list[int]) -> dict[str, torch.Tensor]:
    row = TreeRow()
    for seq, mask, group in zip(seqs, masks, groups):
        row.add({"input_ids": torch.tensor(seq), "completion_mask": torch.tensor(mask, dtype=torch.long),
                 "old_log_probs": torch.zeros(len(seq)), "advantage": 0.0, "group_id": group})  # fmt: skip
    return row.pack()


def bench_packing(sizes: Sizes, model_path: Path) -> list[dict]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    rollouts, _ = grpo_rollouts(sizes, random.Random("grpo"))
    examples = sft_examples(sizes, tokenizer.eos_token_id, random.Random("sft"))
    nested, nested_masks = nested_fork_sequences(sizes, random.Random("nested"))
    cases = {
        "grpo_shared_prompt": ([r.sequence for r in rollouts], [r.loss_mask for r in rollouts], [r.group_id for r in rollouts]),
        "sft_responses_per_prompt": ([e.input_ids for e in examples], [e.loss_mask for e in examples], list(range(len(examples)))),
        "nested_forks": (nested, nested_masks, [0] * len(nested)),
    }  # fmt: skip
    rows = []
    for case, (seqs, masks, groups) in cases.items():
        ours, theirs = pack_sequences(seqs, masks), trl_tree_row(seqs, masks, groups)
        repeat = lambda fn: lambda: [fn() for _ in range(PACK_REPEATS)]  # noqa: E731
        seconds, _ = alternate({"trl": repeat(lambda: trl_tree_row(seqs, masks, groups)), "ours": repeat(lambda: pack_sequences(seqs, masks))},
                               max(sizes.rounds, 5))  # fmt: skip
        flat = sum(map(len, seqs))
        rows.append({
            "case": case, "sequences": len(seqs), "flat_tokens": flat,
            "ours_unique_tokens": ours.num_unique_tokens, "trl_unique_tokens": int(theirs["input_ids"].numel()),
            "ours_ratio": round(ours.packing_ratio, 3), "trl_ratio": round(flat / theirs["input_ids"].numel(), 3),
            "ours_loss_terms": int(ours.loss_targets.numel()), "trl_loss_terms": int(theirs["token_index"].numel()),
            "ours_pack_ms": round(1000 * seconds["ours"] / PACK_REPEATS, 2), "trl_pack_ms": round(1000 * seconds["trl"] / PACK_REPEATS, 2),
        })  # fmt: skip
    return rows


# -- report --------------------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    sft, grpo, lp = report["sft"], report["grpo"], report["logprob_memory"]
    lines = [
        "| benchmark | TRL 1.16 | ours | speed ours/TRL (wall) | (CPU time) | memory TRL/ours |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in (("ours_tree", "tree-packed"), ("ours_flat", "flat-packed, control")):
        lines.append(
            f"| SFT step, tokens/s and peak MiB (ours {label}) | {sft['trl']['tokens_per_s']} tok/s, {sft['trl']['peak_mb']} MiB | "
            f"{sft[name]['tokens_per_s']} tok/s, {sft[name]['peak_mb']} MiB | {sft[f'{name}_speed_ratio']}x | "
            f"{sft[f'{name}_cpu_ratio']}x | {sft[f'{name}_memory_ratio']}x |"
        )
    lines.append(
        f"| GRPO step on fixed rollouts, s and peak MiB | {grpo['trl']['step_s']} s, {grpo['trl']['peak_mb']} MiB | "
        f"{grpo['ours_tree']['step_s']} s, {grpo['ours_tree']['peak_mb']} MiB | {grpo['speed_ratio']}x | {grpo['cpu_ratio']}x | "
        f"{grpo['memory_ratio']}x |"
    )
    lines.append(
        f"| log-probs fwd+bwd, {lp['tokens']} tokens x {lp['vocab']} vocab, peak MiB | {lp['trl']['peak_mb']} MiB | "
        f"{lp['ours']['peak_mb']} MiB | {lp['speed_ratio']}x | {lp['cpu_ratio']}x | {lp['memory_ratio']}x |"
    )
    for row in report["packing"]:
        lines.append(
            f"| packing ratio (flat/unique) and pack ms, {row['case']} | {row['trl_ratio']}, {row['trl_pack_ms']} ms | "
            f"{row['ours_ratio']}, {row['ours_pack_ms']} ms | {round(row['trl_pack_ms'] / max(row['ours_pack_ms'], 1e-9), 2)}x | | |"
        )
    agree = (
        f"Same batch, same weights: SFT loss |ours - TRL| {sft['agreement']['ours_tree']['abs_diff']:.1e} (tree), "
        f"{sft['agreement']['ours_flat']['abs_diff']:.1e} (flat), max relative gradient difference "
        f"{sft['agreement']['ours_tree']['max_rel_grad_diff']:.1e}; GRPO (DAPO) loss |ours - TRL| "
        f"{grpo['agreement']['abs_diff']:.1e}, max relative gradient difference {grpo['agreement']['max_rel_grad_diff']:.1e}; "
        f"log-probs max |diff| {lp['max_abs_logprob_diff']:.1e}."
    )
    return "\n".join(lines + ["", agree])


def environment() -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "lightning": lightning.__version__},  # fmt: skip
    }


def agreement_ok(report: dict, tolerance: float = 1e-4) -> bool:
    """Whether the two sides compute the same SFT and GRPO losses (and GRPO gradients) on the same batch."""
    sft, grpo = report["sft"]["agreement"], report["grpo"]["agreement"]
    return all(a["abs_diff"] <= tolerance * max(1.0, abs(a["loss_trl"])) for a in [*sft.values(), grpo]) and grpo["max_rel_grad_diff"] <= 1e-3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compare_trl.json"))
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--parts", nargs="*", default=["sft", "grpo", "logprob_memory", "packing"])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 gives steadier figures on a busy machine)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else Sizes()
    if args.rounds is not None:
        sizes = Sizes(**{**asdict(sizes), "rounds": args.rounds})
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the Trainer's device banner
    warnings.filterwarnings("ignore")

    command = " ".join(["python benchmarks/compare_trl.py", *(sys.argv[1:] if argv is None else argv)])
    report: dict = {"command": command, "sizes": asdict(sizes), **environment()}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_path = build_model_folder(workdir / "model", sizes)
        benches = {"sft": lambda: bench_sft(model_path, sizes, workdir), "grpo": lambda: bench_grpo(model_path, sizes, workdir),
                   "logprob_memory": lambda: bench_logprobs(sizes), "packing": lambda: bench_packing(sizes, model_path)}  # fmt: skip
        for part in args.parts:
            report[part] = benches[part]()
            print(part, json.dumps(report[part]), flush=True)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    if {"sft", "grpo"} <= set(report):
        report["losses_agree"] = agreement_ok(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".tmp")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(args.out)
    if set(benches) <= set(report):
        print("\n" + markdown(report))
    print(f"\n{report['machine']}, load {report['load_average_1_5_15']} -> {report['load_average_after']}; {args.out}")
    return 0 if report.get("losses_agree", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
