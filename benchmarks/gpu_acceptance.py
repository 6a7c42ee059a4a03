"""GPU acceptance in one command: the CUDA kernels, tree packing at full scale, real Trainer steps, log-prob memory.

    python benchmarks/gpu_acceptance.py --out DIR            # one CUDA GPU (under 8 minutes on an H200)
    python benchmarks/gpu_acceptance.py --dry-run --out DIR  # the same code end to end on a CPU, at tiny shapes

Parts, each in its own try/except so one failure does not hide the others:

- ``cuda_tests``: ``tests/test_tree_attention_cuda.py`` through pytest (FlexAttention fp32/bf16 and varlen bf16
  forward and backward against the dense reference, the packed model against the unpacked one).
- ``tree_packing``: flat against tree packing, forward and backward, on the four cases of
  ``benchmarks/tree_packing.py`` with a Qwen3-1.7B config (random weights) in bf16. A row holds as many
  independent draws of a case as fit in 32K flat tokens (the dry run thins each case to about 512 instead);
  seconds (median) and peak memory per layout. Its two cases whose group spans rows (a prompt of 8192 tokens and
  G=16 answers, a two-level fork), at full length in rows of 4096 tokens (the dry run: 1/32), whole steps run
  flat, as sub-groups and cross-row (the prompt forwarded once across the rows).
- ``trainer_steps``: SFT and GRPO steps of the tiny embedded model through a real ``lightning.Trainer``, built
  from ``recipes/tiny/{sft,grpo}.yaml`` the way ``lightning-rl run`` builds them but without the CLI (the CLI needs
  jsonargparse, which the GPU machine lacks), with ``verify_packing`` on where the modules offer it.
- ``logprob_memory``: the chunked LM head's peak memory at 32K tokens x a 151,936 vocabulary, against the plain
  full-logits computation where that fits.

Writes ``DIR/gpu_acceptance.json`` and ``DIR/gpu_acceptance.md`` and prints the markdown; the exit code is 1 if
a part failed (or, on the GPU, was skipped). Nothing is judged on time.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
# The GPU machine runs from a copy of the repository with nothing installed: import it, and the sibling benchmarks.
sys.path[:0] = [str(ROOT), str(BENCHMARKS)]

GiB = 2**30
CASES = ("no_sharing", "shared_prompt_long", "shared_prompt_short", "nested_forks")
SPAN_CASES = ("long_prompt_spans_rows", "nested_spans_rows")
# What each part imports beyond torch.
NEEDS = {
    "cuda_tests": ("pytest", "hypothesis", "transformers"),
    "tree_packing": ("transformers",),
    "trainer_steps": ("lightning", "transformers", "tokenizers", "peft", "safetensors", "yaml"),
    "logprob_memory": ("transformers",),
}
# Known to be absent on the GPU machine; no part needs them (they serve the CLI, tools, W&B, vLLM, TRL, Parquet).
NOT_NEEDED = ("jsonargparse", "jsonschema", "wandb", "vllm", "trl", "datasets", "pyarrow")


@dataclass(frozen=True)
class Setting:
    """Shapes and devices of one run: the GPU acceptance itself, or its CPU rehearsal (``--dry-run``)."""

    device: torch.device
    dtype: torch.dtype
    model: dict[str, Any]  # Qwen3Config arguments of the tree-packing model
    row_tokens: int  # flat tokens per tree-packing row, at most
    rounds: int  # timed rounds per tree-packing layout
    span_scale: int  # the span cases' lengths divided by this
    logprob_tokens: int
    logprob_vocab: int
    logprob_hidden: int
    trainer_steps: int

    @classmethod
    def for_run(cls, dry_run: bool, rounds: int | None) -> Setting:
        if dry_run:
            tiny = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, vocab_size=2048, tie_word_embeddings=True)  # fmt: skip
            return cls(device=torch.device("cpu"), dtype=torch.float32, model=tiny, row_tokens=512, rounds=rounds or 1, span_scale=32,
                       logprob_tokens=512, logprob_vocab=4096, logprob_hidden=64, trainer_steps=2)  # fmt: skip
        # Qwen3-1.7B's shapes, as in the reference's table.
        qwen3_1_7b = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
        return cls(device=torch.device("cuda"), dtype=torch.bfloat16, model=qwen3_1_7b, row_tokens=32768, rounds=rounds or 3, span_scale=1,
                   logprob_tokens=32768, logprob_vocab=151936, logprob_hidden=2048, trainer_steps=2)  # fmt: skip


class Skipped(Exception):
    """A part that cannot run here; its message is the reason."""


class PartFailed(Exception):
    """A part that ran and found a problem; keeps the figures it had."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


def missing_modules(names: tuple[str, ...]) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def import_report() -> tuple[str, dict[str, str]]:
    """One line saying what is missing and which parts that skips, and the reason per skipped part."""
    gone = {part: missing_modules(needs) for part, needs in NEEDS.items()}
    skips = {part: f"needs {', '.join(names)}" for part, names in gone.items() if names}
    needed = sorted({name for names in gone.values() for name in names})
    unneeded = missing_modules(NOT_NEEDED)
    line = "imports: " + (f"missing {', '.join(needed + unneeded)}" if needed or unneeded else "nothing missing")
    if unneeded:
        line += f" ({', '.join(unneeded)}: needed by no part; the Trainer steps build the modules without the CLI)"
    return line + "; skipping " + (", ".join(f"{part} ({why})" for part, why in skips.items()) or "no part"), skips


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float, int, int]:
    """(result, seconds, peak bytes, bytes live before) of ``fn``: on a GPU torch's allocator peak
    (``torch.cuda.max_memory_allocated``); on a CPU the profiler's allocation events, counted from zero."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        return result, time.perf_counter() - start, torch.cuda.max_memory_allocated(device), before
    from memory import peak_memory_bytes

    box = {}
    start = time.perf_counter()
    peak = peak_memory_bytes(lambda: box.setdefault("result", fn()))
    return box["result"], time.perf_counter() - start, peak, 0


def memory_kind(device: torch.device) -> str:
    return "cuda_max_memory_allocated" if device.type == "cuda" else "cpu_profiler_peak_above_start"


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fresh_compiles() -> None:
    # FlexAttention is compiled once per shape (dynamic=False); each part starts from an empty count so the shapes
    # of one part do not push the next past dynamo's recompile limit (beyond it, flex would run uncompiled).
    torch._dynamo.reset()


def cuda_tests(setting: Setting, out: Path) -> dict[str, Any]:
    """tests/test_tree_attention_cuda.py through pytest, in its own process; pass/fail counts from its JUnit XML."""
    if setting.device.type != "cuda":
        raise Skipped("no CUDA (the dry run stays on the CPU)")
    report = out / "cuda_tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_tree_attention_cuda.py", f"--junitxml={report}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as stopped:  # keep what it printed: the test it hung in
        (out / "cuda_tests.log").write_bytes((stopped.stdout or b"") + (stopped.stderr or b""))
        raise
    (out / "cuda_tests.log").write_text(done.stdout + done.stderr)
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failing = [case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None or case.find("error") is not None]
    figures = {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"], **counts,
               "failing": failing, "pytest_exit_code": done.returncode, "log": "cuda_tests.log"}  # fmt: skip
    if done.returncode != 0 or figures["passed"] == 0:
        last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
        raise PartFailed(f"pytest exit code {done.returncode}: {last[0]}", figures)
    return figures


def tree_packing(setting: Setting, out: Path) -> dict[str, Any]:
    """Flat against tree packing on benchmarks/tree_packing.py's cases, with its learner step and FLOP count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fresh_compiles()
    torch.manual_seed(0)
    config = Qwen3Config(**setting.model, attn_implementation="sdpa")
    with setting.device:
        model = Qwen3ForCausalLM(config).to(setting.dtype)
    cases = {}
    for case in CASES + SPAN_CASES:
        try:
            cases[case] = (span_case if case in SPAN_CASES else packing_case)(model, config, case, setting)
        except torch.OutOfMemoryError:  # a finding at this row size; the other cases still run
            cases[case] = {"out_of_memory": True}
        model.zero_grad(set_to_none=True)
        release_memory()
        print(f"tree_packing {case}: {json.dumps(cases[case])}", flush=True)
    del model
    release_memory()
    figures = {"model": {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size},
               "dtype": str(setting.dtype).removeprefix("torch."), "row_tokens": setting.row_tokens, "rounds": setting.rounds,
               "memory_kind": memory_kind(setting.device), "cases": cases}  # fmt: skip
    if short := [case for case, c in cases.items() if c.get("out_of_memory")]:
        raise PartFailed(f"out of memory on {', '.join(short)}", figures)
    return figures


def scaled_case(case: str, vocab: int, row_tokens: int) -> tuple[list[list[int]], list[list[bool]], dict[str, int]]:
    """benchmarks/tree_packing.py's sequences and loss masks of ``case``, scaled to about ``row_tokens`` flat tokens
    with the prefix tree's shape kept: independent draws side by side when the case is smaller, every ``stride``-th
    token of each sequence when it is larger (a prefix two sequences share stays shared, ``stride`` times shorter)."""
    import tree_packing as bench

    rng = random.Random(case)
    seqs, masks = bench.rollouts(case, vocab, rng)
    flat = sum(map(len, seqs))
    if flat > row_tokens:
        stride = math.ceil(flat / row_tokens)
        return [seq[::stride] for seq in seqs], [mask[::stride] for mask in masks], {"copies": 1, "stride": stride}
    copies = row_tokens // flat
    for _ in range(copies - 1):
        more_seqs, more_masks = bench.rollouts(case, vocab, rng)
        seqs, masks = seqs + more_seqs, masks + more_masks
    return seqs, masks, {"copies": copies, "stride": 1}


def packing_case(model: torch.nn.Module, config: Any, case: str, setting: Setting) -> dict[str, Any]:
    """One case scaled to a row: peak memory of one step and the median seconds of interleaved rounds, flat and tree."""
    import tree_packing as bench

    from lightning_rl.packing import pack_sequences

    device = setting.device
    seqs, masks, scale = scaled_case(case, config.vocab_size, setting.row_tokens)
    advantages = torch.randn(len(seqs), device=device)
    layouts = {name: pack_sequences(seqs, masks, share_prefixes=(name == "tree")).to(device) for name in ("flat", "tree")}
    trained = int(layouts["tree"].loss_positions.numel())

    def run(name: str) -> int:
        model.zero_grad(set_to_none=True)
        return bench.step(model, layouts[name], advantages)

    figures = {}
    for name, batch in layouts.items():
        if device.type == "cuda":
            run(name)  # warm-up: compiles this shape's FlexAttention kernels (nothing compiles on a CPU)
        _, _, peak, _ = measured(lambda: run(name), device)
        flops = bench.layout_flops(config, batch.num_unique_tokens, int((batch.position_ids + 1).sum()), trained)
        figures[name] = {"tokens": batch.num_unique_tokens, "peak_gib": round(peak / GiB, 4), "flops": flops, "times": []}
    # flat and tree alternate which goes first
    timed_rounds(run, figures, [("flat", "tree") if r % 2 == 0 else ("tree", "flat") for r in range(setting.rounds)], device)
    flat, tree = figures["flat"], figures["tree"]
    return {"sequences": len(seqs), **scale, "t_over_u": round(flat["tokens"] / tree["tokens"], 3),
            "speedup": round(flat["seconds"] / tree["seconds"], 3), **figures}  # fmt: skip


def timed_rounds(run: Callable[[str], None], figures: dict[str, dict[str, Any]], orders: list[Sequence[str]], device: torch.device) -> None:
    """Time ``run(name)`` for each name of each round's order, then put each layout's median seconds and its TFLOP/s
    (from its ``flops``) in ``figures``."""
    for order in orders:
        for name in order:
            synchronize(device)
            start = time.perf_counter()
            run(name)
            synchronize(device)
            figures[name]["times"].append(time.perf_counter() - start)
    for layout in figures.values():
        seconds = statistics.median(layout.pop("times"))
        layout["seconds"] = round(seconds, 4)
        layout["tflops"] = round(layout.pop("flops") / seconds / 1e12, 2)


def span_case(model: torch.nn.Module, config: Any, case: str, setting: Setting) -> dict[str, Any]:
    """A case whose group spans rows: whole steps flat, as sub-groups and cross-row (benchmarks/tree_packing.py's
    rows and learner step), peak memory of one and the median seconds of rounds in rotating order."""
    import tree_packing as bench

    from lightning_rl.packing import pack_sequences

    fresh_compiles()  # its rows bring shapes of their own (the prefix, rows of each length) after the four cases'
    device = setting.device
    seqs, masks = bench.rollouts(case, config.vocab_size, random.Random(case), scale=setting.span_scale)
    budget = bench.SPAN_ROW_BUDGET // setting.span_scale
    advantages = torch.randn(len(seqs), device=device)
    layouts = bench.span_layouts(model, seqs, masks, budget, device)
    tree = pack_sequences(seqs, masks)
    trained = int(tree.loss_positions.numel())
    bound = bench.layout_flops(config, tree.num_unique_tokens, int((tree.position_ids + 1).sum()), trained)

    def run(name: str) -> None:
        model.zero_grad(set_to_none=True)
        bench.rows_step(model, layouts[name], advantages)

    figures = {}
    for name, layout in layouts.items():
        if device.type == "cuda":
            run(name)  # warm-up: compiles the rows' FlexAttention kernels
        _, _, peak, _ = measured(lambda: run(name), device)
        tokens, flops = bench.layout_cost(config, layout, trained)
        figures[name] = {"rows": len(layout[0]), "tokens": tokens, "peak_gib": round(peak / GiB, 4), "flops": flops, "times": []}
    timed_rounds(run, figures, [list(layouts)[r % 3 :] + list(layouts)[: r % 3] for r in range(setting.rounds)], device)
    flat, sub, cross = figures["flat"], figures["subgroups"], figures["cross_row"]
    flop_bound = bench.layout_cost(config, layouts["flat"], trained)[1] / bound
    return {"sequences": len(seqs), "span_scale": setting.span_scale, "row_budget": budget, "tokens_unique": tree.num_unique_tokens,
            "t_over_u": round(flat["tokens"] / tree.num_unique_tokens, 3), "flop_bound": round(flop_bound, 3),
            "speedup": round(flat["seconds"] / cross["seconds"], 3),
            "speedup_over_flop_bound": round(flat["seconds"] / cross["seconds"] / flop_bound, 3),
            "speedup_over_subgroups": round(sub["seconds"] / cross["seconds"], 3), **figures}  # fmt: skip


def fit_recipe(recipe_path: Path, setting: Setting, out: Path) -> dict[str, Any]:
    """A recipe's task through a real Trainer, built as ``lightning-rl run`` builds it (seed, tokenizer from the
    model, the datamodule's own sampler, RunSummary and the HF export), with a few steps; returns summary.json."""
    import lightning as L
    import yaml

    from lightning_rl.callbacks import ExportHuggingFace, RunSummary
    from lightning_rl.data.prompts import PromptDataModule
    from lightning_rl.data.sft import SFTDataModule
    from lightning_rl.models.paths import resolve_model_path
    from lightning_rl.modules.grpo import GRPOModule
    from lightning_rl.modules.sft import SFTModule

    recipe = yaml.safe_load(recipe_path.read_text())
    task, seed = recipe["task"], recipe.get("seed", 0)
    module_class, data_class = {"sft": (SFTModule, SFTDataModule), "grpo": (GRPOModule, PromptDataModule)}[task]
    L.seed_everything(seed, verbose=False)
    model_path = resolve_model_path(recipe["model"]["model_name_or_path"])
    model_args = {**recipe["model"], "model_name_or_path": model_path}
    if "eval_generations" in model_args:
        model_args["eval_generations"] = min(model_args["eval_generations"], 8)  # the decode path, not the accuracy
    verify = "verify_packing" in inspect.signature(module_class.__init__).parameters
    if verify:
        model_args["verify_packing"] = "first_step"
    data_args = dict(recipe["data"])
    for key in ("train_data", "val_data"):  # recipe paths are relative to the repository; embedded names (toy) are not
        if isinstance(data_args.get(key), str) and (ROOT / data_args[key]).exists():
            data_args[key] = str(ROOT / data_args[key])
    data_params = inspect.signature(data_class.__init__).parameters  # what the CLI links: seed, and the model's tokenizer
    if "seed" in data_params:
        data_args["seed"] = seed
    if "tokenizer" in data_params:
        data_args["tokenizer"] = model_path
    trainer = L.Trainer(
        **{**recipe["trainer"], "accelerator": setting.device.type, "devices": 1, "max_steps": setting.trainer_steps},
        default_root_dir=out, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[RunSummary(out, task=task), ExportHuggingFace(out)],
    )  # fmt: skip
    trainer.fit(module_class(**model_args), datamodule=data_class(**data_args))
    summary = json.loads((out / "summary.json").read_text())
    if summary["steps"] != setting.trainer_steps or summary["last_loss"] is None or not math.isfinite(summary["last_loss"]):
        raise RuntimeError(f"{task}: {summary['steps']} of {setting.trainer_steps} steps, last loss {summary['last_loss']}")
    keep = ("steps", "first_loss", "last_loss", "tokens_per_s", "peak_memory_mb", "peak_memory_kind", "wall_seconds")
    return {"verify_packing": "first_step" if verify else "not offered", **{key: summary[key] for key in keep}}


def trainer_steps(setting: Setting, out: Path) -> dict[str, Any]:
    fresh_compiles()
    figures: dict[str, Any] = {"accelerator": setting.device.type}
    errors = []
    for task in ("sft", "grpo"):  # a failing SFT run must not hide the GRPO one
        try:
            figures[task] = fit_recipe(ROOT / "recipes" / "tiny" / f"{task}.yaml", setting, out / task)
        except Exception as error:
            errors.append(f"{task}: {type(error).__name__}: {error}")
            figures[task] = {"error": errors[-1][:500], "traceback": traceback.format_exc()[-3000:]}
        release_memory()
    if errors:
        raise PartFailed("; ".join(errors), figures)
    return figures


def logprob_memory(setting: Setting, out: Path) -> dict[str, Any]:
    """Peak memory above the inputs of log p(target) forward and backward: chunked LM head against plain logits."""
    from logprob_memory import plain_logprobs

    from lightning_rl.ops.logprobs import token_logprobs

    device, tokens, vocab = setting.device, setting.logprob_tokens, setting.logprob_vocab
    torch.manual_seed(0)
    hidden = torch.randn(tokens, setting.logprob_hidden, device=device, dtype=setting.dtype, requires_grad=True)
    weight = (torch.randn(vocab, setting.logprob_hidden, device=device, dtype=setting.dtype) * 0.02).requires_grad_()
    targets = torch.randint(vocab, (tokens,), device=device)

    def forward_backward(logprobs_of: Callable[[], torch.Tensor]) -> torch.Tensor:
        hidden.grad = weight.grad = None
        logprobs = logprobs_of()
        (-logprobs.mean()).backward()
        return logprobs.detach()

    ways = {"chunked": lambda: token_logprobs(hidden, weight, targets, chunk_size=1024), "plain": lambda: plain_logprobs(hidden, weight, targets)}
    cases, logprobs = {}, {}
    for name, logprobs_of in ways.items():
        try:
            forward_backward(logprobs_of)  # warm-up: library handles and workspaces are not the method's memory
            logprobs[name], seconds, peak, before = measured(lambda: forward_backward(logprobs_of), device)
            cases[name] = {"fits": True, "peak_extra_gib": round((peak - before) / GiB, 4), "seconds": round(seconds, 4)}
        except torch.OutOfMemoryError:  # the plain way may not fit; that is a finding, not a failure
            cases[name] = {"fits": False}
        release_memory()
    if not cases["chunked"]["fits"]:
        raise RuntimeError("the chunked LM head ran out of memory")
    figures = {"tokens": tokens, "vocab": vocab, "hidden": setting.logprob_hidden, "dtype": str(setting.dtype).removeprefix("torch."),
               "fp32_logits_gib": round(tokens * vocab * 4 / GiB, 3), "memory_kind": memory_kind(device), **cases}  # fmt: skip
    if "plain" in logprobs:
        # Same answer both ways (fp32 softmax in both; bf16 logits round differently before it).
        figures["max_abs_diff"] = float((logprobs["chunked"] - logprobs["plain"]).abs().max())
        tolerance = 5e-2 if setting.dtype == torch.bfloat16 else 1e-4
        if figures["max_abs_diff"] > tolerance:
            raise PartFailed(f"chunked and plain log-probs differ by {figures['max_abs_diff']:.2e} (> {tolerance})", figures)
    return figures


PARTS = {"cuda_tests": cuda_tests, "tree_packing": tree_packing, "trainer_steps": trainer_steps, "logprob_memory": logprob_memory}


def run_part(name: str, part: Callable[[Setting, Path], dict[str, Any]], setting: Setting, out: Path, skip: str | None) -> dict[str, Any]:
    start = time.perf_counter()
    result: dict[str, Any] = {"status": "ok", "seconds": 0.0, "figures": {}}
    try:
        if skip:
            raise Skipped(skip)
        result["figures"] = part(setting, out)
    except Skipped as reason:
        result.update(status="skipped", reason=str(reason))
    except Exception as error:  # one part's failure must not hide the others
        result.update(status="failed", error=f"{type(error).__name__}: {error}"[:500], traceback=traceback.format_exc()[-3000:])
        result["figures"] = getattr(error, "figures", {})
        release_memory()
    result["seconds"] = round(time.perf_counter() - start, 2)
    print(f"{name}: {result['status']} in {result['seconds']} s", flush=True)
    return result


def number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    parts = report["parts"]
    lines = [f"# GPU acceptance ({report['mode']}): {report['device']}", "", report["imports"], "",
             "| part | status | seconds | note |", "|---|---|---|---|"]  # fmt: skip
    for name, part in parts.items():
        note = part.get("reason") or part.get("error") or ""
        if name == "cuda_tests" and part["status"] != "skipped":
            f = part["figures"]
            note = f"{f.get('passed')} passed, {f.get('failures')} failed, {f.get('errors')} errors, {f.get('skipped')} skipped. {note}"
        lines.append(f"| {name} | {part['status']} | {part['seconds']} | {note.strip()} |")
    packing = parts["tree_packing"]["figures"]
    if packing.get("cases"):
        lines += ["", f"Tree packing: Qwen3 {packing['model']['layers']} layers, hidden {packing['model']['hidden']}, vocab "
                  f"{packing['model']['vocab']}, {packing['dtype']}, rows of about {packing['row_tokens']} flat tokens, "
                  f"forward+backward, median of {packing['rounds']}; peak: {packing['memory_kind']}", "",
                  "| case | flat tokens | tree tokens | T/U | flat s | tree s | speedup | flat GiB | tree GiB | flat TFLOP/s | tree TFLOP/s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for case, c in packing["cases"].items():
            if case in SPAN_CASES:
                continue
            if c.get("out_of_memory"):
                lines.append(f"| {case} | out of memory |" + " |" * 10)
                continue
            f, t = c["flat"], c["tree"]
            lines.append(f"| {case} | {f['tokens']} | {t['tokens']} | {c['t_over_u']} | {f['seconds']} | {t['seconds']} | "
                         f"{c['speedup']} | {f['peak_gib']} | {t['peak_gib']} | {f['tflops']} | {t['tflops']} |")  # fmt: skip
        lines += ["", "A group spanning rows (whole steps; speedup and FLOP bound: cross-row against flat):", "",
                  "| case | T/U | FLOP bound | flat s | sub-groups s | cross-row s | speedup | speedup / bound | over sub-groups | "
                  "flat GiB | sub-groups GiB | cross-row GiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for case in SPAN_CASES:
            if (c := packing["cases"].get(case)) is None or c.get("out_of_memory"):
                lines.append(f"| {case} | {'out of memory' if c else 'not run'} |" + " |" * 11)
                continue
            f, g, x = c["flat"], c["subgroups"], c["cross_row"]
            lines.append(f"| {case} | {c['t_over_u']} | {c['flop_bound']} | {f['seconds']} | {g['seconds']} | {x['seconds']} | {c['speedup']} | "
                         f"{c['speedup_over_flop_bound']} | {c['speedup_over_subgroups']} | {f['peak_gib']} | {g['peak_gib']} | {x['peak_gib']} |")  # fmt: skip
    steps = parts["trainer_steps"]["figures"]
    if steps.get("sft") or steps.get("grpo"):
        lines += ["", f"Trainer steps ({steps['accelerator']}):", "",
                  "| task | verify_packing | steps | first loss | last loss | tokens/s | peak MB |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for task in ("sft", "grpo"):
            if (s := steps.get(task)) and "steps" in s:
                lines.append(f"| {task} | {s['verify_packing']} | {s['steps']} | {number(s['first_loss'], '.4f')} | "
                             f"{number(s['last_loss'], '.4f')} | {number(s['tokens_per_s'], '.0f')} | {number(s['peak_memory_mb'], '.0f')} |")  # fmt: skip
    logp = parts["logprob_memory"]["figures"]
    if logp.get("chunked"):
        lines += ["", f"Log-probs: {logp['tokens']} tokens x {logp['vocab']} vocab, hidden {logp['hidden']}, {logp['dtype']} "
                  f"(one fp32 logits tensor: {logp['fp32_logits_gib']} GiB); peak above the inputs: {logp['memory_kind']}", "",
                  "| way | peak extra GiB | seconds |", "|---|---|---|"]  # fmt: skip
        for way in ("chunked", "plain"):
            if c := logp.get(way):
                lines.append(f"| {way} | {c['peak_extra_gib']} | {c['seconds']} |" if c["fits"] else f"| {way} | out of memory | - |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, the CUDA tests skipped")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per tree-packing layout (3; dry run 1)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device; on a CPU run with --dry-run", file=sys.stderr)
        return 2
    imports, skips = import_report()
    print(imports, flush=True)
    setting = Setting.for_run(args.dry_run, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    parts = {name: run_part(name, part, setting, args.out, skips.get(name)) for name, part in PARTS.items()}
    device = torch.cuda.get_device_name(setting.device) if setting.device.type == "cuda" else f"CPU ({platform.machine()})"
    report = {
        "mode": "dry-run" if args.dry_run else "gpu", "device": device, "imports": imports, "seconds": round(time.perf_counter() - start, 2),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     **{name: _version(name) for name in ("triton", "transformers", "lightning", "tokenizers", "peft")}},
        "parts": parts,
    }  # fmt: skip
    (args.out / "gpu_acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out / "gpu_acceptance.md").write_text(text)
    print("\n" + text, flush=True)
    # On the GPU every part must run; the dry run skips the CUDA tests by design.
    accepted = all(p["status"] == "ok" or (p["status"] == "skipped" and args.dry_run) for p in parts.values())
    return 0 if accepted else 1


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
