"""No code runs from a file: a crafted pickle, planted wherever a run reads checkpoints, never runs.

The crafted files are real: pickles whose ``__reduce__`` opens a marker file for writing, saved with ``torch.save``
(and, for a sharded checkpoint, with torch.distributed.checkpoint itself); a negative control shows that reading them
the unsafe way does create the marker. Each is put where `lightning-rl run` of the tiny SFT recipe (in this process)
would read it: `--ckpt_path FILE` or FOLDER, `last.ckpt` in OUTPUT_DIR/checkpoints, `hpc_ckpt_N.ckpt` in OUTPUT_DIR, a
`*.ckpt.staging` leftover. The run must end with one `error:` line, or pass over the file naming it, and the marker
must never appear. A scan of the package's source (with its own negative control) keeps unsafe loads out; every
checkpoint the tasks write here loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_rl import cli
from lightning_rl.checkpoints import checkpoint_step, write_manifest
from lightning_rl.modules.policy import WRITER
from support.paths import REPO, TOY_TRAIN

PACKAGE = REPO / "lightning_rl"
TINY_SFT = [
    str(REPO / "recipes" / "tiny" / "sft.yaml"), "--data.val_data=null", "--data.max_tokens=256",
    "--model.eval_generations=0", "--model.warmup_steps=1", "--trainer.val_check_interval=null",
    "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--logger.kind=none", "--trainer.max_steps=1",
]  # fmt: skip


class OpensMarker:
    """Unpickled, it calls ``open(marker, "w")``: the file appears if, and only if, the pickle was run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def crafted_file(path: Path, marker: Path) -> Path:
    """A file that looks like a Lightning checkpoint and runs code when unpickled without restriction."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": 5, "state_dict": {}, "payload": OpensMarker(marker)}, path)
    return path


def crafted_sharded(path: Path, marker: Path, where: str) -> Path:
    """A sharded checkpoint in the layout FSDP2 writes (DCP shards, meta.pt, our manifest), with the code in one
    part: ``value`` (a plain value among the shards, which DCP unpickles itself), ``.metadata`` or ``meta.pt``."""
    state = {"state_dict": {"w": torch.ones(2)}, "optimizer_0": {"param_groups": [{"lr": 0.1}]}}
    if where == "value":
        state["optimizer_0"]["param_groups"][0]["lr"] = OpensMarker(marker)
    dcp.save(state, checkpoint_id=path)
    if where == ".metadata":
        (path / ".metadata").write_bytes(pickle.dumps(OpensMarker(marker)))
    torch.save({"global_step": 5, **({"payload": OpensMarker(marker)} if where == "meta.pt" else {})}, path / "meta.pt")
    write_manifest(path, 5)
    return path


def run(capsys, out: Path, *extra: str) -> tuple[int, list[str], str]:
    """`lightning-rl run` of the tiny SFT recipe in this process: exit code, `error:` lines, all of stderr."""
    rows = out.parent / "rows.jsonl"
    rows.write_text("".join(TOY_TRAIN.read_text().splitlines(keepends=True)[:20]))
    code = cli.main(["run", *TINY_SFT, f"--output_dir={out}", f"--data.train_data={rows}", *extra])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")], err


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "code-ran"


def test_the_crafted_files_do_run_code_when_read_unsafely(tmp_path, marker):
    """Negative control: what the tests below refuse is a real exploit, for torch.load and for DCP alike."""
    torch.load(crafted_file(tmp_path / "evil.ckpt", marker), weights_only=False)
    assert marker.exists()
    marker.unlink()
    folder = crafted_sharded(tmp_path / "evil-sharded.ckpt", marker, "value")
    dcp.load({"state_dict": {"w": torch.zeros(2)}, "optimizer_0": {"param_groups": [{"lr": 0.0}]}}, checkpoint_id=folder)
    assert marker.exists()


def test_a_crafted_ckpt_path_file_is_one_line_and_runs_nothing(tmp_path, capsys, marker):
    evil = crafted_file(tmp_path / "evil.ckpt", marker)
    code, errors, _ = run(capsys, tmp_path / "run", f"--ckpt_path={evil}")
    assert code == 2 and errors == [
        f"error: ckpt_path: {evil} is not a checkpoint of this run (it holds io.open, which torch.load(weights_only=True) refuses)"
    ]
    assert not marker.exists()


@pytest.mark.parametrize("where", ["value", ".metadata", "meta.pt"])
def test_a_crafted_sharded_ckpt_path_is_one_line_and_runs_nothing(tmp_path, capsys, marker, where):
    evil = crafted_sharded(tmp_path / "evil.ckpt", marker, where)
    code, errors, _ = run(capsys, tmp_path / "run", f"--ckpt_path={evil}")
    part = "optimizer_0.param_groups.0.lr" if where == "value" else where
    reader = "the reader of checkpoint records" if where == ".metadata" else "torch.load(weights_only=True)"
    assert code == 2 and errors == [
        f"error: ckpt_path: {evil} is not a checkpoint of this run ({part}: it holds io.open, which {reader} refuses)"
    ]
    assert not marker.exists()


@pytest.fixture
def run_folder(tmp_path, capsys) -> Path:
    """The folder of a real one-step run (its checkpoints/last.ckpt at step 1), to plant files in."""
    out = tmp_path / "run"
    code, errors, _ = run(capsys, out)
    assert code == 0 and errors == [] and checkpoint_step(out / "checkpoints" / "last.ckpt") == 1
    return out


@pytest.mark.parametrize("planted", ["checkpoints/last.ckpt", "hpc_ckpt_7.ckpt"])
def test_a_crafted_checkpoint_planted_in_a_run_folder_is_named_and_runs_nothing(run_folder, capsys, marker, planted):
    (run_folder / "checkpoints" / "last.ckpt").unlink()
    crafted_file(run_folder / planted, marker)
    code, errors, _ = run(capsys, run_folder, "--ckpt_path=last", "--trainer.max_steps=2")
    assert code == 2 and errors == [
        f"error: ckpt_path: last: no complete checkpoint in {run_folder}, so the run there cannot be resumed, and "
        f"starting again from step 0 would train over it; passed over {planted}: not a checkpoint of this run, it holds "
        "io.open, which torch.load(weights_only=True) refuses; start it over with --overwrite in place of --ckpt_path, or give "
        "another output_dir"
    ]
    assert not marker.exists()


def test_a_crafted_checkpoint_beside_a_complete_one_is_passed_over_by_name(run_folder, capsys, marker):
    newer = crafted_file(run_folder / "hpc_ckpt_7.ckpt", marker)  # a higher step, and newer
    code, errors, err = run(capsys, run_folder, "--ckpt_path=last", "--trainer.max_steps=2")
    assert code == 0 and errors == []
    assert ("resume: step 1 from checkpoints/last.ckpt, the newest complete checkpoint; passed over hpc_ckpt_7.ckpt: "
            "not a checkpoint of this run, it holds io.open, which torch.load(weights_only=True) refuses") in err  # fmt: skip
    assert newer.exists() and not marker.exists()


def test_crafted_staging_leftovers_are_removed_unopened(run_folder, capsys, marker):
    """What a requeued job's `--ckpt_path=last` cleans up first: a staged file is removed by its name; a staged
    folder is promoted only if its parts pass the safe readers (this one's do not), else removed."""
    crafted_file(run_folder / "checkpoints" / "step=3.ckpt.staging", marker)
    crafted_sharded(run_folder / "hpc_ckpt_7.ckpt.staging", marker, ".metadata")
    code, errors, err = run(capsys, run_folder, "--ckpt_path=last", "--trainer.max_steps=2")
    assert code == 0 and errors == []
    assert ("resume: step 1 from checkpoints/last.ckpt, the newest complete checkpoint; removed "
            "checkpoints/step=3.ckpt.staging, left by a killed write; removed hpc_ckpt_7.ckpt.staging, left by a "
            "killed write") in err  # fmt: skip
    assert not marker.exists()
    assert not list(run_folder.rglob("*.staging"))


def test_lightning_reads_checkpoints_with_weights_only(tmp_path, marker):
    """The second line of defence, should a file change after our check: Lightning's readers as `_fit` calls them
    (``weights_only=True``) refuse the crafted file and a sharded folder's crafted meta.pt."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME

    with pytest.raises(pickle.UnpicklingError):
        TorchCheckpointIO().load_checkpoint(crafted_file(tmp_path / "evil.ckpt", marker), weights_only=True)
    folder = crafted_sharded(tmp_path / "evil-sharded.ckpt", marker, "meta.pt")
    with pytest.raises(pickle.UnpicklingError):  # what lightning's sharded loader does with meta.pt
        torch.load(folder / _METADATA_FILENAME, weights_only=True)
    assert not marker.exists()


def test_a_recipe_with_a_python_yaml_tag_runs_nothing(tmp_path, capsys, marker):
    """Recipes and command-line values are read by safe YAML loaders (ours and jsonargparse's)."""
    tag = f"!!python/object/apply:builtins.open [{marker}, w]"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((REPO / "recipes" / "tiny" / "sft.yaml").read_text() + f"\nseed: {tag}\n")
    assert cli.main(["run", str(recipe), f"--output_dir={tmp_path / 'a'}"]) == 2
    assert "could not determine a constructor for the tag" in capsys.readouterr().err
    code, errors, _ = run(capsys, tmp_path / "b", f"--model.learning_rate={tag}")
    assert code == 2 and len(errors) == 1 and "model.learning_rate must be a number" in errors[0]
    assert not marker.exists()


def test_every_checkpoint_an_sft_run_writes_loads_with_weights_only_and_records_its_writer(tmp_path, capsys):
    """Full fine-tuning and LoRA; the other tasks' checkpoints are checked where their tests write them
    (test_grpo_module, test_grpo_async, test_user_errors' FSDP2 run, test_checkpoints' XLA writer)."""
    for name, extra in (("full", ()), ("lora", ("--model.lora={r: 4, alpha: 8}",))):
        out = tmp_path / name
        code, errors, _ = run(capsys, out, "--checkpoint_every_n_steps=1", *extra)
        assert code == 0 and errors == []
        written = sorted(out.rglob("*.ckpt"))
        assert [p.name for p in written] == ["last.ckpt", "step=1.ckpt"]
        for path in written:
            checkpoint = torch.load(path, weights_only=True)
            assert checkpoint["global_step"] == 1 and checkpoint_step(path) == 1
            assert checkpoint[WRITER]["task"] == "SFTModule"
            assert checkpoint[WRITER]["lora"] == (None if name == "full" else {"r": 4, "alpha": 8, "target_modules": "all-linear"})


# --- the scan ---------------------------------------------------------------------------------------------------

# Unpickling that is allowed, and why. Nothing else in the package may unpickle, eval or exec.
ALLOWED = {
    # The restricted reader of DCP's .metadata: its find_class admits only DCP's record classes and torch dtypes.
    ("checkpoints.py", "pickle.Unpickler"),
    # IPC, not a file: the tool worker reads (function, arguments) from the socket pair its parent, our executor,
    # created and handed to it alone (pass_fds); no other process holds an end of it.
    ("tools/worker.py", "pickle.loads"),
}
UNPICKLERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "marshal.load", "marshal.loads", "dill.load", "dill.loads",
              "shelve.open", "joblib.load", "cloudpickle.load", "cloudpickle.loads", "pandas.read_pickle", "pd.read_pickle",
              "yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all"}  # fmt: skip


def _name(node: ast.AST) -> str:
    """``a.b.c`` of a call's function, as written."""
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _false_or_absent(node: ast.AST | None) -> bool:
    return node is None or (isinstance(node, ast.Constant) and node.value is False)


def unsafe_loads(source: str, file: str) -> list[str]:
    """Every place in ``source`` that could run code from a file, as ``file:line: what``."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(_name(base) == "pickle.Unpickler" for base in node.bases):
            found.append((node.lineno, "pickle.Unpickler"))
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if name in UNPICKLERS:
            found.append((node.lineno, name))
        elif name in ("eval", "exec", "builtins.eval", "builtins.exec"):
            found.append((node.lineno, name))
        elif name.endswith("torch.load") and not _true(_keyword(node, "weights_only")):
            found.append((node.lineno, "torch.load without weights_only=True"))
        elif name.endswith(("np.load", "numpy.load")) and not _false_or_absent(_keyword(node, "allow_pickle")):
            found.append((node.lineno, "numpy.load with allow_pickle"))
        elif name.endswith(".fit") and _keyword(node, "ckpt_path") is not None and not _true(_keyword(node, "weights_only")):
            found.append((node.lineno, "fit(ckpt_path=...) without weights_only=True"))
        if not _false_or_absent(_keyword(node, "trust_remote_code")):
            found.append((node.lineno, "trust_remote_code"))
    return [f"{file}:{line}: {what}" for line, what in sorted(found) if (file, what) not in ALLOWED]


def test_the_scan_finds_each_kind_of_unsafe_load():
    """Negative control: each pattern the scan exists for is found, and the safe spellings are not."""
    unsafe = """
import pickle, yaml, torch, numpy as np
pickle.load(f); pickle.loads(b); yaml.load(s, Loader=yaml.Loader); yaml.unsafe_load(s)
torch.load(p); torch.load(p, weights_only=False); np.load(p, allow_pickle=True); eval(s); exec(s)
AutoModel.from_pretrained(p, trust_remote_code=True); trainer.fit(m, ckpt_path=p)
class R(pickle.Unpickler): pass
"""
    assert sorted(line.split(": ", 1)[1] for line in unsafe_loads(unsafe, "x.py")) == sorted([
        "pickle.load", "pickle.loads", "yaml.load", "yaml.unsafe_load", "torch.load without weights_only=True",
        "torch.load without weights_only=True", "numpy.load with allow_pickle", "eval", "exec", "trust_remote_code",
        "fit(ckpt_path=...) without weights_only=True", "pickle.Unpickler",
    ])  # fmt: skip
    safe = "torch.load(p, weights_only=True); yaml.safe_load(s); np.load(p); trainer.fit(m, ckpt_path=p, weights_only=True)"
    assert unsafe_loads(safe, "x.py") == []


def test_the_package_has_no_unsafe_load():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    found = [hit for path in files for hit in unsafe_loads(path.read_text(), path.relative_to(PACKAGE).as_posix())]
    assert found == []
    # The allow-list names only what is there: an entry whose code went away goes too.
    for file, what in ALLOWED:
        assert what.split(".")[-1] in (PACKAGE / file).read_text(), (file, what)
