"""Expert parallelism under FSDP2: the experts split over ranks compute what the whole layer computes.

Real gloo process groups and real Lightning runs of the tiny Muse Spark recipe (routed experts, sliding and
full attention); the reference is the same layer or the same run with the experts sharded like any weight.
"""

import copy
import csv
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from safetensors.torch import load_file
from transformers import MuseSparkTextConfig
from transformers.models.muse_spark.modeling_muse_spark import MuseSparkMoE

from lightning_rl.rollout.vllm_server_process import free_port
from lightning_rl.strategies.expert_parallel import ExpertParallelError, distribute_experts, expert_mesh
from lightning_rl.strategies.fsdp2 import FSDP2Strategy
from support.distributed import leave_worker
from support.recipe_runs import checkpoint_elements, exported, run_on_two, run_tiny_muse, run_with_check, stopped_and_resumed

WORLD = 2


def _layer_check(rank: int, port: int, implementation: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        config = MuseSparkTextConfig(
            hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_hidden_size=8,
            moe_intermediate_size=12, num_local_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
        config._experts_implementation = implementation
        torch.manual_seed(0)
        layer = MuseSparkMoE(config)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.3)
        dense = copy.deepcopy(layer)
        # Each rank routes its own tokens (a different count on each); the dense layer sees every rank's.
        inputs = [torch.randn(7 + r, 16, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]
        (split,) = distribute_experts(layer, expert_mesh("cpu", WORLD, WORLD))
        assert tuple(split.gate_up_proj.to_local().shape) == (2, 24, 8)  # two of the four experts here

        mine = inputs[rank].clone().requires_grad_()
        out = layer(mine)
        out.square().sum().backward()
        for r, x in enumerate(inputs):
            x = x.clone().requires_grad_()
            want = dense(x)
            want.square().sum().backward()
            if r == rank:
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(mine.grad, x.grad, rtol=1e-5, atol=1e-5)
        # The sum over ranks of every gradient is the dense layer's gradient over all tokens.
        dense_grads = dict(dense.named_parameters())
        for name, p in layer.named_parameters():
            if isinstance(p.grad, DTensor):  # the experts' gradient comes out divided by the group (FSDP2 then averages)
                grad = p.grad.full_tensor() * WORLD
            else:
                grad = p.grad.clone()
                dist.all_reduce(grad)
            torch.testing.assert_close(grad, dense_grads[name].grad, rtol=1e-5, atol=1e-5, msg=name)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_worker()


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_split_experts_layer_equals_the_whole_layer(implementation):
    torch.multiprocessing.spawn(_layer_check, args=(free_port(), implementation), nprocs=WORLD)


def _ep(size: int) -> str:
    return f"--trainer.strategy.init_args.expert_parallel_size={size}"


def test_full_fine_tuning_with_split_experts_matches_plain_fsdp2(tiny_muse_path, tmp_path):
    """4 ranks: experts split over pairs and sharded over the two pairs, against every weight sharded 4-way."""
    common = ("--trainer.devices=4", "--model.lora=null", "--trainer.max_steps=3")
    runs = {}
    for size in (1, 2):
        done = run_tiny_muse(tiny_muse_path, tmp_path / f"ep{size}", *common, _ep(size))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[size] = exported(tmp_path / f"ep{size}")
    want, got = runs[1], runs[2]
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    initial = load_file(tiny_muse_path / "model.safetensors")
    moved = [name for name in got if ".experts." in name and not torch.equal(got[name], initial[name])]
    assert len(moved) >= 8, moved  # the experts trained (gate_up and down of every layer), not just passed through


def test_split_experts_resume_exactly(tiny_muse_path, tmp_path):
    """SIGTERM after step 3 of 4, resume from the checkpoint saved on it: the distributed checkpoint holds the split experts."""
    common = ("--model.lora=null", "--trainer.max_steps=4", "--checkpoint_every_n_steps=2", _ep(2))
    reference, killed_dir = stopped_and_resumed(tiny_muse_path, tmp_path, 3, *common)
    assert json.loads((killed_dir / "summary.json").read_text())["micro_batches"] == 4  # the whole run, across the resume
    want, got = exported(reference), exported(killed_dir)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)


def test_each_rank_reads_only_its_experts(tiny_muse_path, tmp_path):
    result = run_with_check(tiny_muse_path, tmp_path, _ep(2))
    diff = result["diff"]
    assert diff["compared"] > 0 and diff["differ"] == [] and diff["missing"] == [], diff
    total = checkpoint_elements(tiny_muse_path)
    reads = [report["elements_read"] for (report,) in result["ranks"]]
    assert all(0.4 * total < r < 0.6 * total for r in reads), (reads, total)


def test_layouts_expert_parallelism_cannot_split_are_refused(tiny_path, tmp_path):
    with pytest.raises(ExpertParallelError, match="expert_parallel_size 3 must be a positive divisor of the 2 processes"):
        expert_mesh("cpu", 2, 3)
    with pytest.raises(ExpertParallelError, match="must be a positive integer"):
        FSDP2Strategy(expert_parallel_size=0)
    # A dense model: one clear line before any step, naming the recipe key.
    done = run_tiny_muse(tiny_path, tmp_path / "dense", "--model.lora=null", _ep(2))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "trainer.strategy: expert_parallel_size=2, but Qwen3ForCausalLM has no routed-experts module" in done.stderr
    assert "Traceback" not in done.stderr


def test_split_experts_train_the_same_from_a_whole_model_loaded_first(tiny_muse_path, tmp_path):
    """sharded_loading=false: every rank loads the whole model, then keeps its experts; same steps, same weights."""
    common = ("--model.lora=null", "--trainer.max_steps=2", _ep(2))
    runs = {}
    for sharded in (True, False):
        out = tmp_path / f"sharded-{sharded}"
        done = run_tiny_muse(tiny_muse_path, out, *common, f"--trainer.strategy.init_args.sharded_loading={str(sharded).lower()}")
        assert done.returncode == 0, done.stderr[-3000:]
        runs[sharded] = exported(out)
    for name, tensor in runs[True].items():
        torch.testing.assert_close(runs[False][name], tensor, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("async_mode", [False, True])
def test_router_replay_in_grpo_with_split_experts(tmp_path, async_mode):
    """The tiny MoE GRPO recipe with its experts split over both ranks: the trainer's forward, tokens sent to the
    experts' ranks, chooses the experts the engine recorded at every step, synchronous or generating ahead."""
    done = run_on_two(
        "recipes/tiny/grpo_moe.yaml", tmp_path, "--trainer.max_steps=2", f"--model.async_mode={str(async_mode).lower()}",
        "--model.max_staleness=0", '--model.rewards=[{"function": "test_mismatch:token_spread"}]',  # a gradient every step
        # tiny-moe is saved one tensor per expert: each rank reads only its experts' tensors straight into its shard
        "--trainer.strategy.class_path=lightning_rl.strategies.fsdp2.FSDP2Strategy", _ep(2),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (metrics,) = tmp_path.glob("csv/version_*/metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("train/mismatch/route_agreement")]
    assert len(rows) == 2
    assert all(float(r["train/mismatch/route_agreement"]) == 1.0 for r in rows), rows
    assert float(rows[0]["train/grad_norm"]) > 0  # the second step's routes come from weights the first one moved
