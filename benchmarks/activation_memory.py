"""Activation memory of one tree-packed training row: none, ``gradient_checkpointing``, ``offload_activations``, both.

The row is GRPO-shaped: one prompt and its G completions, the prompt stored once (tree packing), the loss on the
completions. Each setting runs forward and backward of the same row in a fresh process, on the policy as the modules
load it (`load_causal_lm`, `OffloadedForwards`), and reports:

- ``peak_extra_mb``: on CUDA, ``torch.cuda.max_memory_allocated`` over what the weights held before the row (the
  gradients, the same in every setting, included);
- ``saved_in_place_mb``: the activations autograd keeps where they were made between forward and backward, counted
  with a saved-tensor hook (weights aside); on a CPU this is the figure to read (a process's resident memory is too
  coarse);
- ``host_mb``: what offloading moved to host memory;
- ``planned_device_mb`` / ``planned_host_mb``: what ``lightning-rl plan`` says of the activations for this model and row;
- ``seconds``: one forward and backward (indicative only on a shared machine);
- ``grads_equal`` / ``max_rel_grad_diff``: each setting's loss and gradients against the setting without either.

Run: OMP_NUM_THREADS=1 python benchmarks/activation_memory.py [--prompt 512 --completions 8 --completion 256]
(``--device cuda --dtype bf16`` on a GPU; the figures go to benchmarks/results/activation_memory.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lightning_rl.models.loading import load_causal_lm
from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.ops.saved_activations import OffloadedForwards, SavedInPlace
from lightning_rl.packing.tree import pack_sequences
from lightning_rl.planner.memory_plan import Hardware, Training, plan_memory
from lightning_rl.planner.model_census import count_model

RESULTS = Path(__file__).resolve().parent / "results" / "activation_memory.json"
SETTINGS = {"none": (False, False), "checkpointing": (True, False), "offload": (False, True), "both": (True, True)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MB = 2**20


def model_config(args: argparse.Namespace) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(args.hidden // 128, 1), head_dim=64, vocab_size=args.vocab, tie_word_embeddings=True,
    )  # fmt: skip


def grpo_row(args: argparse.Namespace, vocab: int):
    """One prompt and its completions, packed as a tree, the loss on the completions only."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
    sequences = [prompt + torch.randint(3, vocab, (args.completion,), generator=g).tolist() for _ in range(args.completions)]
    masks = [[False] * args.prompt + [True] * args.completion for _ in sequences]
    return pack_sequences(sequences, masks)


def _measure(setting: str, folder: str, args: argparse.Namespace, grads_file: str, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    checkpointing, offload = SETTINGS[setting]
    device = torch.device(args.device)
    model = load_causal_lm(folder, gradient_checkpointing=checkpointing).to(device, DTYPES[args.dtype]).train()
    offloaded = OffloadedForwards(model) if offload else None
    row = grpo_row(args, model.config.vocab_size).to(device)
    with torch.no_grad():  # the packing probe, once per model, outside the measured step
        packed_logprobs(model, row)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    saved = SavedInPlace()
    start = time.perf_counter()
    with saved:
        loss = -packed_logprobs(model, row).float().sum()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / MB if device.type == "cuda" else None
    torch.save({name: p.grad.float().cpu() for name, p in model.named_parameters()}, grads_file)
    queue.put({
        "setting": setting, "peak_extra_mb": None if peak is None else round(peak, 1), "saved_in_place_mb": round(saved.bytes / MB, 2),
        "host_mb": round((offloaded.host_bytes if offloaded else 0) / MB, 2), "seconds": round(seconds, 3), "loss": float(loss),
        "unique_tokens": row.num_unique_tokens, "flat_tokens": row.num_flat_tokens,
    })  # fmt: skip


def planned(args: argparse.Namespace, tokens: int) -> dict[str, dict[str, float]]:
    census = count_model(model_config(args), [])
    out = {}
    for setting, (checkpointing, offload) in SETTINGS.items():
        training = Training(1, 1, tokens, activation_checkpointing=checkpointing, offload_activations=offload,
                            compute_bytes=DTYPES[args.dtype].itemsize)  # fmt: skip
        plan = plan_memory(census, training, Hardware(gpu_memory_gb=80))
        device = next(term.bytes for term in plan.terms if term.name.startswith("activations"))
        out[setting] = {"planned_device_mb": round(device / MB, 2), "planned_host_mb": round(plan.host_activation_bytes / MB, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = str(Path(scratch) / "model")
        torch.manual_seed(0)
        Qwen3ForCausalLM(model_config(args)).save_pretrained(folder)
        grads = {}
        for setting in SETTINGS:
            queue = context.Queue()
            grads_file = str(Path(scratch) / f"{setting}.pt")
            process = context.Process(target=_measure, args=(setting, folder, args, grads_file, queue))
            process.start()
            results.append(queue.get())
            process.join()
            grads[setting] = torch.load(grads_file)
    plans = planned(args, results[0]["unique_tokens"])
    for result in results:
        base, mine = grads["none"], grads[result["setting"]]
        result["grads_equal"] = all(torch.equal(base[name], mine[name]) for name in base)
        result["max_rel_grad_diff"] = max(float((mine[n] - base[n]).norm() / base[n].norm().clamp_min(1e-30)) for n in base)
        result["loss_equal"] = result["loss"] == results[0]["loss"]
        result.update(plans[result["setting"]])
    report = {
        "machine": f"{platform.machine()} {args.device}" + (f" {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "note": "a shared machine: memory figures hold, seconds are indicative",
        "model": {"family": "qwen3", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "dtype": args.dtype},
        "row": {"prompt": args.prompt, "completions": args.completions, "completion": args.completion},
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
