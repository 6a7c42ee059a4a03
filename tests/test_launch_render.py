"""Rendering sbatch scripts: the layout checks, the script's contents, and the checked-in script."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lightning_rl.errors import RecipeError
from lightning_rl.launch import slurm
from lightning_rl.launch.layout import Allocation
from lightning_rl.launch.recipe_view import LaunchError, RecipeView
from lightning_rl.launch.render import SlurmOptions, render_slurm_script
from support.paths import REPO, TOY_TRAIN

MUSE_RECIPE = Path("recipes/muse_spark_open/lora_sft_8x8.yaml")
MUSE_SCRIPT = Path("launch/slurm/muse_spark_open_lora_sft_8x8.sbatch")
# The exact command the checked-in script was rendered with (kept in sync by the test below).
MUSE_RENDER = ["slurm", str(MUSE_RECIPE), "--nodes", "8", "--gpus-per-node", "8", "--partition", "h100",
               "--time", "2-00:00:00", "--cpus-per-task", "16", "--dry-run"]  # fmt: skip


def recipe(tmp_path: Path, trainer: dict | None = None, task: str = "sft") -> RecipeView:
    """A recipe the launcher renders from (``RecipeView.parse`` reads it as ``run`` would, overrides applied)."""
    data = {"task": task, "model": {"model_name_or_path": "org/model"}, "trainer": {"accelerator": "gpu", **(trainer or {})}}
    if task == "sft":
        data["data"] = {"train_data": str(TOY_TRAIN)}
    else:  # a GRPO launch puts the rollouts on a server node
        data["model"]["engine"] = {"class_path": "lightning_rl.rollout.vllm_server.VLLMServerEngine", "init_args": {}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return RecipeView(path, data)


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
    script = render(view, nodes=2, gpus=1, run_overrides=("--output_dir=runs/a b", "--ckpt_path=last"))
    assert "--gpus-per-node" not in script.split("set -euo")[0]
    assert "'--output_dir=runs/a b' --ckpt_path=last" in script and script.count("--ckpt_path=last") == 1


def test_a_launch_refuses_to_start_from_another_checkpoint_at_every_requeue(tmp_path: Path) -> None:
    """Every start of a requeued job runs the same command: a checkpoint path given there was taken again each time,
    training again what the job had trained since."""
    view = recipe(tmp_path, {"accelerator": "cpu"})
    view = RecipeView.parse(view.path, ["--ckpt_path=/runs/old/checkpoints/step=100.ckpt"])
    with pytest.raises(LaunchError, match=r"^ckpt_path: /runs/old/checkpoints/step=100.ckpt: a launched job resumes from its own last"):
        render(view, nodes=1, gpus=1, run_overrides=("--ckpt_path=/runs/old/checkpoints/step=100.ckpt",))
    # null too: the first start trained, and every requeued start was refused, its run folder taken.
    view = recipe(tmp_path, {"accelerator": "cpu"})
    with pytest.raises(LaunchError, match=r"^ckpt_path: null: a launched job resumes from its own last"):
        render(RecipeView.parse(view.path, ["--ckpt_path=null"]), nodes=1, gpus=1, run_overrides=("--ckpt_path=null",))


def test_grpo_splits_trainer_and_vllm_nodes(tmp_path: Path) -> None:
    view = recipe(tmp_path, task="grpo")
    data = yaml.safe_load(view.path.read_text())
    data["model"]["engine"]["init_args"] = {"server_options": {"dtype": "bfloat16", "max_model_len": 4096, "log_path": "x.log"}}
    script = render(RecipeView(view.path, data), nodes=3, gpus=8, inference=1)
    server = next(line for line in script.splitlines() if "vllm.entrypoints.openai.api_server" in line)
    for flag in ["--model org/model", "--dtype bfloat16", "--max-model-len 4096", "--tensor-parallel-size 8", "--port 8000"]:
        assert flag in server
    # GPU nodes: vLLM's own NCCL backend, which the trainer's engine on transport "auto" then follows.
    assert '"backend": "nccl"' in server and "WeightSyncWorker" in server and "log_path" not in server
    assert "--no-enable-chunked-prefill" not in server  # the server node's devices decide, not the rendering machine's
    assert "srun --kill-on-bad-exit=1 --nodes=2 --ntasks=16 --ntasks-per-node=8" in script
    assert "--trainer.num_nodes=2 --trainer.devices=8" in script
    assert '--model.engine.init_args.url="$SERVER_URL" --model.engine.init_args.transfer_address="$MASTER_ADDR"' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    # SLURM's warning signal reaches every step: the server ignores it (vLLM has no handler, and it ended the server
    # while the trainer saved its checkpoint). The wrapper as rendered, run on a real process, survives the signal.
    wrapper = 'bash -c \'trap "" USR1; exec "$@"\' vllm-server '
    assert wrapper in server, server
    server_like = subprocess.Popen(["bash", "-c", 'trap "" USR1; exec "$@"', "vllm-server", sys.executable, "-c", "import time; time.sleep(3)"])
    time.sleep(1)
    server_like.send_signal(signal.SIGUSR1)
    assert server_like.wait(timeout=30) == 0  # a Python without the wrapper ends at once, rc -10


@pytest.mark.parametrize(("task", "override", "message"), [
    ("sft", "--model.chunk_size=0", "model.chunk_size must be >= 1, got 0"),
    ("grpo", "--model.lora.r=0", "model.lora.r must be >= 1, got 0"),
    ("grpo", "--model.num_iterations=0", "model.num_iterations must be >= 1, got 0"),
])  # fmt: skip
def test_a_value_the_module_refuses_is_refused_by_launch_and_plan_before_the_queue_wait(tmp_path: Path, task, override, message) -> None:
    """`plan` and `launch` read a recipe through `RecipeView.parse`: the module's own checks run there, on no model."""
    view = recipe(tmp_path, {"accelerator": "cpu"}, task=task)
    RecipeView.parse(view.path, sized_only=True)  # the recipe as written passes
    with pytest.raises(RecipeError, match=f"^{re.escape(message)}"):
        RecipeView.parse(view.path, [override], sized_only=True)


@pytest.mark.parametrize("trainer", [
    {"strategy": "neuron"}, {"strategy": "xla_static"},
    {"accelerator": {"class_path": "lightning_rl.strategies.xla.NeuronAccelerator"}}, {"accelerator": "tpu"},
])  # fmt: skip
def test_a_neuron_or_xla_job_asks_for_whole_nodes_not_gpus(tmp_path: Path, trainer: dict) -> None:
    """A Trainium node's devices are no SLURM GPU resource: `--gpus-per-node` there is a job sbatch refuses."""
    script = render(recipe(tmp_path, {"accelerator": "auto", **trainer}), nodes=2, gpus=32)
    assert "#SBATCH --exclusive" in script and "--gpus-per-node" not in script
    assert "--trainer.num_nodes=2 --trainer.devices=32" in script


def test_an_embedded_model_is_built_by_the_server_python_and_served_from_its_folder(tmp_path: Path) -> None:
    """`tiny` is no hub id: the server would have looked it up online. Its command builds the folder and serves it."""
    view = recipe(tmp_path, {"accelerator": "cpu"}, task="grpo")
    view.data["model"]["model_name_or_path"] = "tiny"
    view.data["model"]["engine"]["init_args"] = {"server_options": {"python": sys.executable}}
    server = next(line for line in render(view, nodes=2, gpus=1, inference=1).splitlines() if "api_server" in line)
    model = server.split("--model ", 1)[1].split(" --host", 1)[0]
    folder = subprocess.run(["bash", "-c", f"echo {model}"], text=True, capture_output=True, check=True,
                            env={**os.environ, "LIGHTNING_RL_CACHE": str(tmp_path / "cache")}).stdout.strip()
    assert (Path(folder) / "config.json").is_file() and Path(folder).is_relative_to(tmp_path / "cache")
    assert "--model tiny" not in server


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


def test_overwrite_is_refused_when_the_script_is_rendered(tmp_path: Path) -> None:
    """The job resumes on every start, and `run` refuses --overwrite with --ckpt_path: said before the queue wait."""
    with pytest.raises(LaunchError, match="--overwrite: a launched job resumes its run on every start"):
        render(recipe(tmp_path, {}), 2, 8, 0, run_overrides=("--overwrite",))


def test_a_cpu_grpo_server_runs_the_gloo_backend_and_the_engine_is_checked_by_the_run_parser(tmp_path: Path) -> None:
    view = recipe(tmp_path, {"accelerator": "cpu"}, task="grpo")
    server = next(line for line in render(view, nodes=2, gpus=1, inference=1).splitlines() if "api_server" in line)
    assert '"backend": "gloo"' in server and "WeightSyncWorker" in server
    assert "--no-enable-chunked-prefill" in server  # vLLM's CPU build dies on a split prefill (vllm_on_cpu)
    # The engine's options are typed by its signature: the launcher's parse (run's parser) refuses a bad transport.
    with pytest.raises(RecipeError, match="model.engine.transport must be one of auto, gloo, nccl, got mpi"):
        RecipeView.parse(view.path, ["--model.engine.init_args.transport=mpi"])
    data = yaml.safe_load(view.path.read_text())
    data["model"]["engine"] = "hf"
    with pytest.raises(LaunchError, match="`model.engine` must be VLLMServerEngine \\(class_path\\), got HFRolloutEngine"):
        render(RecipeView(view.path, data), nodes=2, gpus=1, inference=1)


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
    for limit in ("two days", "25:99:99", "1-00:60"):  # SLURM carried 99 minutes over into hours, silently
        with pytest.raises(LaunchError, match="is not a SLURM time"):
            render(view, time=limit)
    assert "#SBATCH --time=UNLIMITED" in render(view, time="UNLIMITED")  # no limit, as sbatch takes it


def launch(capsys, *args: str) -> tuple[int, str, list[str]]:
    """`lightning-rl launch slurm ... --dry-run`: its exit code, the script and the `error:` lines."""
    own = list(args[: args.index("--")] if "--" in args else args)
    code = slurm.main(["slurm", *own, "--dry-run", *args[len(own) :]])
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.startswith("error:")]


def test_bad_recipe_files_are_named(tmp_path: Path, capsys) -> None:
    (tmp_path / "list.yaml").write_text("- 1\n")
    (tmp_path / "notask.yaml").write_text("model: {}\n")
    for name, expected in {"absent.yaml": "no such recipe file", "list.yaml": "a recipe is a mapping of keys (task:, model:, data:, ...), not a list", "notask.yaml": "missing key 'task'"}.items():
        assert launch(capsys, str(tmp_path / name), "--nodes", "1", "--gpus-per-node", "1", "--partition", "p") == (
            2, "", [f"error: {tmp_path / name}: {expected} (one of sft, grpo)" if "missing key" in expected else f"error: {tmp_path / name}: {expected}"]
        )


def test_the_recipe_is_read_by_the_run_parser_with_the_overrides_applied(tmp_path: Path, capsys) -> None:
    view = recipe(tmp_path, {"accelerator": "cpu"})
    allocation = ("--nodes", "2", "--gpus-per-node", "8", "--partition", "p")
    assert launch(capsys, str(view.path), *allocation)[0] == 0
    data = yaml.safe_load(view.path.read_text())
    data["model"]["learnin_rate"] = 1e-3  # the job would fail on the cluster, after its wait in the queue
    view.path.write_text(yaml.safe_dump(data))
    assert launch(capsys, str(view.path), *allocation) == (
        2, "", [f"error: {view.path}: line 4: unknown key 'model.learnin_rate' (did you mean 'model.learning_rate'?)"]
    )
    del data["model"]["learnin_rate"]
    view.path.write_text(yaml.safe_dump(data))
    # An override is part of the recipe the job runs: one that undoes the allocation check is refused like the recipe.
    code, script, errors = launch(capsys, str(view.path), *allocation, "--", "--trainer.devices=4")
    assert code == 2 and script == "" and errors == [
        f"error: {view.path}: `trainer.devices: 4` would leave 4 of 8 devices per node idle (--gpus-per-node = 8); "
        "set `trainer.devices: auto` or match the allocation"
    ]
    assert launch(capsys, str(view.path), *allocation, "--", "--trainer.max_stepz=3")[2] == [
        "error: command line: unknown key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)"
    ]
    assert launch(capsys, str(view.path), *allocation, "--", "--model.learning_rat=3")[2] == [
        "error: command line: unknown key 'model.learning_rat' (did you mean 'model.learning_rate'?)"
    ]
    assert launch(capsys, str(view.path), *allocation, "--", "--trainer.accumulate_grad_batches=0")[2] == [
        "error: trainer.accumulate_grad_batches must be >= 1, got 0"
    ]


def test_every_value_is_rendered_quoted(tmp_path: Path, capsys) -> None:
    """Flags and overrides with spaces, quotes and `$(...)` reach sbatch, the shell and `lightning-rl run` as given."""
    view = recipe(tmp_path, {"accelerator": "cpu"})
    (tmp_path / "job").mkdir()
    partition, job, log_dir = "gpu a", 'it\'s "mine" $(touch job/pwned)', str(tmp_path / "job" / "logs $(touch job/pwned) `x` \\ end")
    override = "--output_dir=runs/a b'c\"d $(touch job/pwned)"
    code, script, errors = launch(capsys, str(view.path), "--nodes", "2", "--gpus-per-node", "1", "--partition", partition,
                                  "--job-name", job, "--log-dir", log_dir, "--", override)  # fmt: skip
    assert code == 0 and errors == [], errors
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    directives = dict(shlex.split(line)[1].split("=", 1) for line in script.splitlines() if line.startswith("#SBATCH --") and "=" in line)
    assert directives["--partition"] == partition and directives["--job-name"] == job
    assert directives["--output"] == f"{log_dir}/%x-%j.out"
    srun = shlex.split(script.split("srun --kill-on-bad-exit=1", 1)[1].replace("\\\n", " "))
    assert srun[srun.index("run") + 1 :] == [str(view.path), "--trainer.num_nodes=2", "--trainer.devices=1", "--ckpt_path=last", override]
    rank_logs = next(line for line in script.splitlines() if line.startswith("RANK_LOGS="))
    shell = subprocess.run(["bash", "-c", f'SLURM_JOB_NAME=j SLURM_JOB_ID=7; {rank_logs}; printf %s "$RANK_LOGS"'],
                           cwd=tmp_path, capture_output=True, text=True, check=True)  # fmt: skip
    assert shell.stdout == f"{log_dir}/j-7"
    assert not (tmp_path / "job" / "pwned").exists()
    assert launch(capsys, str(view.path), "--nodes", "2", "--gpus-per-node", "1", "--partition", "p", "--log-dir", "a\nb")[2] == [
        "error: --log-dir 'a\\nb' holds a line break, which a script line cannot hold"
    ]


def test_checked_in_muse_script_is_what_the_launcher_renders(capsys) -> None:
    assert slurm.main(MUSE_RENDER) == 0
    assert capsys.readouterr().out == MUSE_SCRIPT.read_text(), "re-render launch/slurm/ with the command in MUSE_RENDER"
    script = MUSE_SCRIPT.read_text()
    assert "#SBATCH --nodes=8" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--trainer.num_nodes=8 --trainer.devices=8" in script
    # srun (Slurm >= 22.05) takes the CPUs per task from the environment, not from sbatch's request
    assert "#SBATCH --cpus-per-task=16" in script and "export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}" in script


def test_a_submit_where_sbatch_is_missing_is_one_line_and_writes_no_script(tmp_path: Path, monkeypatch, capsys) -> None:
    """A machine without SLURM's client ended in a FileNotFoundError traceback, the script written."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no sinfo
    script = tmp_path / "job.sbatch"
    code = slurm.main(["slurm", "recipes/tiny/sft.yaml", "--nodes", "1", "--gpus-per-node", "1", "--partition", "debug", "--script", str(script)])
    assert code == 2 and not script.exists()
    assert capsys.readouterr().err.strip() == "error: no sbatch on this machine: submit from a SLURM login node, or print the script with --dry-run"


def test_a_data_file_this_machine_lacks_is_said_before_the_queue_wait(tmp_path: Path, capsys) -> None:
    """The job found it missing once it started, after its wait in the queue; a note says so at launch (a node's own
    disk may hold it, so it is not refused)."""
    code = slurm.main(["slurm", str(recipe(tmp_path).path), "--nodes", "1", "--gpus-per-node", "1", "--partition", "p", "--dry-run",
                       "--", f"--data.train_data={tmp_path / 'gone.jsonl'}"])  # fmt: skip
    assert code == 0
    assert f"note: data.train_data: {tmp_path / 'gone.jsonl'} is not on this machine" in capsys.readouterr().err
    # GRPO's prompts are data.train_data too (the note looked for its earlier name alone).
    code = slurm.main(["slurm", "recipes/qwen3/grpo_vllm_server.yaml", "--nodes", "2", "--gpus-per-node", "1", "--inference-nodes", "1",
                       "--partition", "p", "--dry-run", "--", f"--data.train_data={tmp_path / 'gone.jsonl'}"])  # fmt: skip
    assert code == 0
    assert f"note: data.train_data: {tmp_path / 'gone.jsonl'} is not on this machine" in capsys.readouterr().err
    # A Hub dataset's name is no file the job reads either (data is read from files alone).
    code = slurm.main(["slurm", str(recipe(tmp_path).path), "--nodes", "1", "--gpus-per-node", "1", "--partition", "p", "--dry-run",
                       "--", "--data.train_data=trl-lib/Capybara"])  # fmt: skip
    assert code == 0 and "note: data.train_data: trl-lib/Capybara is not on this machine" in capsys.readouterr().err


def test_a_model_folder_this_machine_lacks_is_said_before_the_queue_wait(tmp_path: Path, capsys) -> None:
    """As a data file: a model folder the recipe names and this machine lacks gets a note; a Hub id does not."""
    for model, noted in ((str(tmp_path / "gone"), True), ("./gone", True), ("Qwen/Qwen3-0.6B", False), ("tiny", False)):
        code = slurm.main(["slurm", str(recipe(tmp_path).path), "--nodes", "1", "--gpus-per-node", "1", "--partition", "p", "--dry-run",
                           "--", f"--model.model_name_or_path={model}"])  # fmt: skip
        assert code == 0
        assert (f"note: model.model_name_or_path: {model} is not on this machine" in capsys.readouterr().err) == noted, model


def test_another_launchers_name_is_one_line_naming_the_script_for_it(capsys) -> None:
    """`launch torchrun RECIPE.yaml` took "torchrun" for the recipe, and said --nodes was missing."""
    assert slurm.main(["torchrun", str(REPO / "recipes" / "tiny" / "sft.yaml"), "--nodes", "1", "--gpus-per-node", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: launch torchrun: launch renders SLURM jobs (lightning-rl launch [slurm] RECIPE.yaml --nodes N --gpus-per-node G); "
        "without SLURM, launch/torchrun.sh starts a run on each node")
