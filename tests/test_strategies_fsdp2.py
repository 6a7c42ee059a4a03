"""FSDP2 strategy and live weight sync: two real processes, gloo, a real Lightning Trainer, a tiny Qwen3.

The pytest side builds a tiny model folder, runs this file as a script (Lightning's launcher starts the
second rank), and checks what each rank wrote. The engine is the transformers rollout engine
(``HFRolloutEngine``, loaded through ``from_pretrained``), which receives weights through ``push_weights``.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import Tensor

from support.distributed import leave_worker

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
SGD_LR = 1.0
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def build_tiny_model(folder: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)


# ---------------------------------------------------------------------------------------------- worker side


class LiveBytes:
    """Bytes of streamed tensors still referenced anywhere, and the most alive at once."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def track(self, named_tensors):
        for name, tensor in named_tensors:
            size = tensor.untyped_storage().nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._release, size)
            yield name, tensor
            del tensor

    def _release(self, size: int) -> None:
        self.live -= size


class StallingTarget:
    """Reads two tensors, then stops answering for longer than the sync timeout."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s

    def push_weights(self, named_tensors, version: int) -> None:
        for index, _ in enumerate(named_tensors):
            if index == 1:
                time.sleep(self.stall_s)


def training_rows() -> list[Tensor]:
    return list(torch.randint(0, 96, (16, 12), generator=torch.Generator().manual_seed(1)))


def packed_loss(model: torch.nn.Module, rows: Tensor) -> Tensor:
    """Mean negative log-prob of a packed row, through the chunked LM head that runs after the forward."""
    from lightning_rl.ops.packed_forward import packed_logprobs
    from lightning_rl.packing.tree import pack_sequences

    return -packed_logprobs(model, pack_sequences(rows.tolist())).mean()


def unsharded_reference(folder: str) -> dict[str, Tensor]:
    """The same STEPS of SGD on one process: each step averages the two ranks' batches, as FSDP2 reduces them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    rows = training_rows()
    for step in range(STEPS):
        per_rank = [torch.stack([rows[4 * step + r], rows[4 * step + r + 2]]) for r in range(2)]
        loss = sum(packed_loss(model, batch) for batch in per_rank) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


def merged_reference(full: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """``base + scaling * B @ A`` under Hugging Face names, from the gathered peft state dict."""
    merged = {}
    for name, value in full.items():
        if ".lora_" in name:
            continue
        stem = name.removesuffix(".base_layer.weight")
        if stem != name:
            value = value + scaling * full[f"{stem}.lora_B.default.weight"] @ full[f"{stem}.lora_A.default.weight"]
        merged[name.removeprefix("base_model.model.").replace(".base_layer", "")] = value
    return merged


def prompt_logprobs(model: torch.nn.Module, prompt: Tensor) -> Tensor:
    with torch.no_grad():
        logits = model(input_ids=prompt).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, prompt[:, 1:, None]).squeeze(-1)


def run_worker(mode: str, folder: str, out: str) -> None:
    import lightning as L
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from lightning_rl.rollout.hf import HFRolloutEngine
    from lightning_rl.strategies import FSDP2Strategy  # importing the package registers "fsdp2"
    from lightning_rl.models.weights import (
        WeightSyncError, WeightSyncTimeoutError, hf_name, iter_adapter_weights, iter_full_weights, sync_weights,
    )

    class CausalLMModule(L.LightningModule):
        """The smallest module the strategy must handle: a HF model and the packed log-prob loss SFT uses."""

        def __init__(self, model: torch.nn.Module, lora: bool) -> None:
            super().__init__()
            self.model, self.lora = model, lora

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            return packed_loss(self.model, batch)

        def train_dataloader(self) -> DataLoader:
            # An explicit, unshuffled split (rank r reads rows r, r + 2, ...), so the reference can replay it.
            rows = training_rows()
            return DataLoader(rows, batch_size=2, sampler=DistributedSampler(rows, shuffle=False))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            params = [p for p in self.parameters() if p.requires_grad]
            # SGD for full training, so the unsharded reference run agrees to rounding (Adam amplifies it).
            return torch.optim.AdamW(params, lr=2e-2) if self.lora else torch.optim.SGD(params, lr=SGD_LR)

    lora = mode == "lora"
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    if lora:
        model = get_peft_model(model, LoraConfig(**LORA))
    module = CausalLMModule(model, lora)
    # By registered name for full training; with the optional features switched on for LoRA.
    strategy = "fsdp2"
    if lora:
        strategy = FSDP2Strategy(mixed_precision="bf16", activation_checkpointing=True, cpu_offload=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy,
        max_steps=STEPS, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)
    rank = trainer.global_rank
    result: dict = {"rank": rank}

    layers = [m for m in module.modules() if isinstance(m, Qwen3DecoderLayer)]
    result["sharded_layers"] = sum(isinstance(m, FSDPModule) for m in layers)
    result["all_dtensor"] = all(isinstance(p, DTensor) for p in module.parameters())
    result["checkpointing"] = any(getattr(m, "gradient_checkpointing", False) for m in module.modules())

    local_before = {n: p.to_local().clone() for n, p in module.named_parameters()}
    full = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True))
    engine = HFRolloutEngine(folder) if rank == 0 else None
    report = sync_weights(module, engine, version=STEPS)
    result["sent"] = report.names
    result["unchanged_after_sync"] = all(
        torch.equal(local_before[n], p.to_local()) for n, p in module.named_parameters()
    )
    # A consumer that keeps nothing (deque with maxlen 0) sees one gathered tensor alive at a time.
    live = LiveBytes()
    collections.deque(live.track(iter_full_weights(module)), maxlen=0)
    result["peak_live_bytes"] = live.peak
    prompt = torch.tensor([[5, 17, 42, 8, 9, 33, 2, 71]])
    trainer_logprobs = prompt_logprobs(module.model, prompt)

    if rank == 0:
        initial = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        engine_state = engine.model.state_dict()
        result["engine_version"] = engine.weight_version
        result["largest_tensor_bytes"] = report.largest_tensor_bytes
        result["logprob_max_diff"] = (prompt_logprobs(engine.model, prompt) - trainer_logprobs).abs().max().item()
        if lora:
            expected = merged_reference(full, scaling=8 / 4)
            result["lora_modules"] = sum(".lora_A." in n for n in full)
            result["lora_b_max"] = max(v.abs().max().item() for n, v in full.items() if ".lora_B." in n)
            result["base_frozen"] = all(
                torch.equal(initial[hf_name(n.removeprefix("base_model.model."))], v)
                for n, v in full.items() if ".base_layer." in n
            )
            reference = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**LORA))
            reference.load_state_dict(full)
            reference_adapter = set(get_peft_model_state_dict(reference))
            peft_merged = reference.merge_and_unload().state_dict()
            result["engine_vs_peft_merge"] = max(
                (engine_state[n] - peft_merged[n]).abs().max().item() for n in expected
            )
        else:
            expected = dict(full)
            result["trained_moved"] = max((initial[n] - full[n]).abs().max().item() for n in full)
            reference = unsharded_reference(folder)
            result["fsdp_vs_unsharded_max"] = max((reference[n] - full[n]).abs().max().item() for n in full)
        result["engine_equals_expected"] = {n: torch.equal(engine_state[n], expected[n]) for n in expected}
        result["engine_vs_expected_max"] = max((engine_state[n] - expected[n]).abs().max().item() for n in expected)
    result["compute_dtype"] = str(module.model(input_ids=prompt).logits.dtype)
    if lora:
        adapter = dict(iter_adapter_weights(module))
        if rank == 0:
            result["adapter_names_match"] = set(adapter) == reference_adapter
        # Ranks that would send different tensors are stopped before the first gather.
        try:
            list(iter_full_weights(module) if rank == 0 else iter_adapter_weights(module))
            result["mismatch_error"] = None
        except WeightSyncError as error:
            result["mismatch_error"] = str(error)
    else:
        started = time.perf_counter()
        try:
            # 5 s: room for a loaded machine's group setup and first gathers; the stall is well past it
            sync_weights(module, StallingTarget(12.0) if rank == 1 else None, version=STEPS + 1,
                         timeout=timedelta(seconds=5))
            result["stall_error"] = None
        except WeightSyncTimeoutError as error:
            result["stall_error"] = str(error)
        result["stall_seconds"] = time.perf_counter() - started
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    leave_worker()


# ----------------------------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    build_tiny_model(folder)
    return folder


def launch(mode: str, folder: Path, out: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in {"MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK"}}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, __file__, mode, str(folder), str(out)], env=env, cwd=out, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_full_sync_after_training_matches_gathered_model(tiny_model: Path, tmp_path: Path) -> None:
    ranks = launch("full", tiny_model, tmp_path)
    rank0 = ranks[0]
    assert rank0["sharded_layers"] == 2 and rank0["all_dtensor"]
    assert rank0["trained_moved"] > 1e-3, "the optimizer steps must have changed the weights"
    assert rank0["fsdp_vs_unsharded_max"] < 1e-5, "sharded training must equal the unsharded reference"
    assert rank0["engine_version"] == STEPS
    # Streamed: at most one gathered parameter is alive at a time on the receiving rank.
    assert rank0["peak_live_bytes"] == rank0["largest_tensor_bytes"] == 128 * 64 * 4  # an MLP projection
    assert all(rank0["engine_equals_expected"].values()), rank0["engine_equals_expected"]
    assert rank0["compute_dtype"] == "torch.float32" and rank0["logprob_max_diff"] < 1e-5
    # Tied embeddings: sent once, under the input-embedding name.
    assert "model.embed_tokens.weight" in rank0["sent"] and "lm_head.weight" not in rank0["sent"]
    assert len(rank0["sent"]) == len(set(rank0["sent"]))
    assert all(r["unchanged_after_sync"] for r in ranks)
    # A stalled rank: the waiting rank fails fast, naming the parameter it was gathering.
    # Rank 1 stops reading after its second tensor, so rank 0 is left waiting on the third.
    third = rank0["sent"][2]
    assert f"parameter '{third}' (#3 of {len(rank0['sent'])}) did not complete within 5s" in rank0["stall_error"]
    assert ranks[1]["stall_error"] is not None and "parameter '" in ranks[1]["stall_error"]
    assert max(r["stall_seconds"] for r in ranks) < 60


def test_lora_sync_merges_into_copy_and_leaves_trainer_unchanged(tiny_model: Path, tmp_path: Path) -> None:
    ranks = launch("lora", tiny_model, tmp_path)
    rank0 = ranks[0]
    assert rank0["sharded_layers"] == 2 and rank0["all_dtensor"] and rank0["checkpointing"]
    assert rank0["lora_modules"] == 6 and rank0["lora_b_max"] > 1e-3, "training must have moved the adapters"
    assert rank0["base_frozen"]
    assert rank0["engine_vs_expected_max"] < 1e-6
    assert rank0["engine_vs_peft_merge"] < 1e-6
    # The trainer computes in bf16 (mixed precision), the engine in fp32 with the same fp32 weights.
    assert rank0["compute_dtype"] == "torch.bfloat16"
    assert rank0["logprob_max_diff"] < 0.05
    assert all(r["unchanged_after_sync"] for r in ranks)
    assert all("ranks would sync different tensors (#1:" in r["mismatch_error"] for r in ranks)
    assert not any(".lora_" in n or ".base_layer" in n for n in rank0["sent"])
    assert rank0["adapter_names_match"]


if __name__ == "__main__":
    run_worker(*sys.argv[1:4])
