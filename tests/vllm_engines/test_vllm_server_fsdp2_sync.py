"""FSDP2 training on two real processes (gloo, a real Lightning Trainer), then a live sync into the vLLM server.

The pytest side runs this file as a script (Lightning's launcher starts the second rank). Both ranks join
every gather of `sync_weights`; rank 0 streams the gathered tensors to the server over the gloo transfer
group and samples from it. The server must then give the log-probs of the gathered, trained model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from engine_checks import LOGPROB_ATOL, load_trainer_model, max_logprob_error
from support.distributed import leave_worker

from lightning_rl.rollout.base import Rollout

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def run_worker(folder: str, url: str, out: Path) -> None:
    import lightning as L
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from lightning_rl.rollout.base import SamplingConfig
    from lightning_rl.rollout.vllm_server import VLLMServerEngine
    from lightning_rl.strategies import FSDP2Strategy  # noqa: F401  importing the package registers "fsdp2"
    from lightning_rl.models.weights import sync_weights

    class CausalLM(L.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def train_dataloader(self) -> DataLoader:
            rows = torch.randint(3, 300, (8, 12), generator=torch.Generator().manual_seed(0))
            return DataLoader(rows, batch_size=2)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1.0)  # large steps: the weights visibly move

    module = CausalLM(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa"))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    engine = VLLMServerEngine(url=url) if trainer.global_rank == 0 else None
    report = sync_weights(module, engine, version=STEPS)
    full = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True))  # every rank joins
    if engine is not None:
        batch = engine.generate(PROMPTS, n=2, sampling=SamplingConfig(max_new_tokens=10, seed=3))
        torch.save(full, out / "gathered.pt")
        rollouts = [{"prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids, "logprobs": r.logprobs,
                     "weight_version": r.weight_version} for r in batch.rollouts]
        (out / "rank0.json").write_text(json.dumps({"rollouts": rollouts, "sent": report.names}))
    leave_worker()


def test_fsdp2_sync_puts_the_gathered_model_on_the_server(server_engine, tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK"}}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(tiny_model_dir), server_engine.url, str(tmp_path)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert "lm_head.weight" not in result["sent"]  # tied: sent once, as the input embedding
    trained = load_trainer_model(tiny_model_dir)
    gathered = torch.load(tmp_path / "gathered.pt")
    assert max((gathered[n] - p).abs().max().item() for n, p in trained.state_dict().items()) > 1e-3
    trained.load_state_dict(gathered)
    rollouts = [Rollout(group_id=0, **r) for r in result["rollouts"]]
    assert all(r.weight_version == STEPS for r in rollouts)
    assert max_logprob_error(trained, rollouts) < LOGPROB_ATOL


if __name__ == "__main__":
    run_worker(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
