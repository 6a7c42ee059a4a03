"""Rendering sbatch scripts: the layout checks, the script's contents, and the checked-in script."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from lightning_rl.launch import slurm
from lightning_rl.launch.layout import Allocation
from lightning_rl.launch.recipe_view import LaunchError, RecipeView
from lightning_rl.launch.render import SlurmOptions, render_slurm_script

MUSE_RECIPE = Path("recipes/muse_spark_open/lora_sft_8x8.yaml")
MUSE_SCRIPT = Path("launch/slurm/muse_spark_open_lora_sft_8x8.sbatch")
# The exact command the checked-in script was rendered with (kept in sync by the test below).
MUSE_RENDER = ["slurm", str(MUSE_RECIPE), "--nodes", "8", "--gpus-per-node", "8", "--partition", "h100",
               "--time", "2-00:00:00", "--cpus-per-task", "16", "--dry-run"]  # fmt: skip


def recipe(tmp_path: Path, trainer: dict | None = None, task: str = "sft") -> RecipeView:
    data = {"task": task, "model": {"model_name_or_path": "org/model"}, "trainer": {"accelerator": "gpu", **(trainer or {})}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return RecipeView.load(path)


def render(view: RecipeView, nodes: int = 2, gpus: int = 8, inference: int = 0, **options) -> str:
    return render_slurm_script(view, Allocation(nodes, gpus, inference), SlurmOptions(partition="gpu", **options))


def test_script_runs_one_task_per_gpu_and_handles_preemption(tmp_path: Path) -> None:
    script = render(recipe(tmp_path), nodes=4, gpus=8)
    for line in [
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --signal=SIGUSR1@90",
        "#SBATCH --requeue",
        "srun --kill-on-bad-exit=1 --nodes=4 --ntasks-per-node=8 \\",
        '    --output="$RANK_LOGS/rank-%t.log" --open-mode=append \\',
    ]:
        assert line in script.splitlines(), line
    assert "--trainer.num_nodes=4 --trainer.devices=8 --ckpt_path=last" in script
    assert "export MASTER_ADDR=" in script and "export MASTER_PORT=" in script and "NCCL_IB_HCA" in script
    assert "@{" not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_cpu_recipe_requests_no_gpus_and_overrides_pass_through(tmp_path: Path) -> None:
    view = recipe(tmp_path, {"accelerator": "cpu"})
    script = render(view, nodes=2, gpus=1, run_overrides=("--output_dir=runs/a b", "--ckpt_path=null"))
    assert "--gpus-per-node" not in script.split("set -euo")[0]
    assert "'--output_dir=runs/a b' --ckpt_path=null" in script and "--ckpt_path=last" not in script


def test_grpo_splits_trainer_and_vllm_nodes(tmp_path: Path) -> None:
    view = recipe(tmp_path, task="grpo")
    data = yaml.safe_load(view.path.read_text())
    data["model"]["engine_options"] = {"server_options": {"dtype": "bfloat16", "max_model_len": 4096, "log_path": "x.log"}}
    view.path.write_text(yaml.safe_dump(data))
    script = render(RecipeView.load(view.path), nodes=3, gpus=8, inference=1)
    server = next(line for line in script.splitlines() if "vllm.entrypoints.openai.api_server" in line)
    for flag in ["--model org/model", "--dtype bfloat16", "--max-model-len 4096", "--tensor-parallel-size 8", "--port 8000"]:
        assert flag in server
    # GPU nodes: vLLM's own NCCL backend, which the trainer's engine on transport "auto" then follows.
    assert '"backend": "nccl"' in server and "GlooWeightTransferWorker" not in server and "log_path" not in server
    assert "srun --kill-on-bad-exit=1 --nodes=2 --ntasks=16 --ntasks-per-node=8" in script
    assert "--trainer.num_nodes=2 --trainer.devices=8" in script
    assert '--model.engine_options.url="$SERVER_URL" --model.engine_options.transfer_address="$MASTER_ADDR"' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize(
    ("trainer", "allocation", "message"),
    [
        ({"devices": 8}, (2, 4, 0), "`trainer.devices: 8` asks for more devices per node than the allocation has (--gpus-per-node = 4)"),
        ({"num_nodes": 4}, (2, 8, 0), "`trainer.num_nodes: 4` asks for more trainer nodes than the allocation has (--nodes = 2)"),
        ({"devices": 4}, (2, 8, 0), "would leave 4 of 8 devices per node idle"),
        ({"strategy": {"class_path": "x.Fsdp", "init_args": {"data_parallel_size": 12}}}, (2, 8, 0),
         "2 node(s) x 8 = 16 ranks, but `trainer.strategy.data_parallel_size: 12`"),
        ({"strategy": {"class_path": "x.Fsdp", "init_args": {"data_parallel_size": 8, "tensor_parallel_size": 2}}}, (3, 4, 0),
         "3 node(s) x 4 = 12 ranks, but `trainer.strategy.data_parallel_size: 8` x tensor_parallel_size 2 = 16"),
        ({"strategy": {"class_path": "x.Fsdp", "init_args": {"tensor_parallel_size": 16}}}, (2, 8, 0),
         "must divide the 8 devices of one node"),
        ({"strategy": {"class_path": "x.Fsdp", "init_args": {"expert_parallel_size": 16}}}, (2, 8, 0),
         "`trainer.strategy.expert_parallel_size: 16` must divide the 8 devices of one node"),
    ],
)  # fmt: skip
def test_layout_errors_name_the_key_and_the_numbers(tmp_path: Path, trainer: dict, allocation: tuple, message: str) -> None:
    with pytest.raises(LaunchError) as err:
        render(recipe(tmp_path, trainer), *allocation)
    assert message in str(err.value)
    assert str(tmp_path / "recipe.yaml") in str(err.value)


def test_a_cpu_grpo_server_runs_the_gloo_backend_and_a_bad_transport_is_named(tmp_path: Path) -> None:
    view = recipe(tmp_path, {"accelerator": "cpu"}, task="grpo")
    server = next(line for line in render(view, nodes=2, gpus=1, inference=1).splitlines() if "api_server" in line)
    assert '"backend": "gloo"' in server and "GlooWeightTransferWorker" in server
    data = yaml.safe_load(view.path.read_text())
    data["model"]["engine_options"] = {"transport": "mpi"}
    view.path.write_text(yaml.safe_dump(data))
    with pytest.raises(LaunchError, match="`model.engine_options.transport` must be one of auto, gloo, nccl, got 'mpi'"):
        render(RecipeView.load(view.path), nodes=2, gpus=1, inference=1)


def test_task_specific_layout_errors(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="needs exactly one vLLM server node"):
        render(recipe(tmp_path, task="grpo"))
    with pytest.raises(LaunchError, match="--inference-nodes is for GRPO"):
        render(recipe(tmp_path), inference=1)
    with pytest.raises(LaunchError, match="leaves no trainer node"):
        render(recipe(tmp_path, task="grpo"), nodes=1, inference=1)


def test_missing_partition_and_bad_time_fail_before_anything_is_written(tmp_path: Path, capsys) -> None:
    view = recipe(tmp_path)
    script = tmp_path / "job.sbatch"
    code = slurm.main(["slurm", str(view.path), "--nodes", "2", "--gpus-per-node", "8", "--script", str(script)])
    assert code == 2 and not script.exists()
    assert "no partition given: pass --partition" in capsys.readouterr().err
    with pytest.raises(LaunchError, match="is not a SLURM time"):
        render(view, time="two days")


def test_bad_recipe_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="recipe file not found"):
        RecipeView.load(tmp_path / "absent.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(LaunchError, match="a recipe is a YAML mapping"):
        RecipeView.load(tmp_path / "list.yaml")
    (tmp_path / "notask.yaml").write_text("model: {}\n")
    with pytest.raises(LaunchError, match="missing key `task`"):
        render(RecipeView.load(tmp_path / "notask.yaml"))


def test_checked_in_muse_script_is_what_the_launcher_renders(capsys) -> None:
    assert slurm.main(MUSE_RENDER) == 0
    assert capsys.readouterr().out == MUSE_SCRIPT.read_text(), "re-render launch/slurm/ with the command in MUSE_RENDER"
    script = MUSE_SCRIPT.read_text()
    assert "#SBATCH --nodes=8" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--trainer.num_nodes=8 --trainer.devices=8" in script
