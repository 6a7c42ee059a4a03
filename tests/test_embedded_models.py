"""The embedded models are built whole by whichever process builds them, inside a process group too.

transformers' ``save_pretrained`` writes the config and weights only on rank 0 of an initialized process group; the
rank of a job that took the cache's lock first once built a folder of tokenizer files alone, and the job failed.
Real gloo process groups, each rank building into a cache of its own so both build.
"""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from lightning_rl.rollout.vllm_server_process import free_port
from lightning_rl.toy.model import tiny_model_path, tiny_moe_path
from support.distributed import leave_worker


def _build_in_group(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cache = Path(root) / f"rank{rank}"
    tiny_model_path(cache)
    tiny_moe_path(cache)
    dist.barrier()
    leave_worker()


def test_every_rank_of_a_process_group_builds_the_embedded_models_whole(tmp_path):
    torch.multiprocessing.spawn(_build_in_group, args=(free_port(), str(tmp_path)), nprocs=2)
    for name in ("tiny-v", "tiny-moe-v"):
        folders = [next((tmp_path / f"rank{rank}").glob(f"{name}[0-9]*")) for rank in (0, 1)]
        weights = [load_file(folder / "model.safetensors") for folder in folders]
        assert all((folder / "config.json").is_file() for folder in folders)
        assert weights[0].keys() == weights[1].keys() and weights[0]
        for key, tensor in weights[0].items():
            torch.testing.assert_close(weights[1][key], tensor, atol=0, rtol=0, msg=key)
