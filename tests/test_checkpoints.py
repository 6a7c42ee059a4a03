"""Staged checkpoints (lightning_rl/checkpoints.py): what a kill at each moment of a write leaves, which checkpoint
`--ckpt_path=last` then takes, and the one line it says. Checkpoints here are small real files and folders in the
layouts Lightning writes (a torch.save file; a sharded folder with meta.pt and shard files)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch

from lightning_rl import cli, run_folder
from lightning_rl.checkpoints import (
    RESUME_KEYS, ForeignCheckpointError, IncompleteCheckpointError, StagedCheckpointIO, checkpoint_step, clean_staging, commit,
    newest_complete, remove, staging_path, write_manifest,
)  # fmt: skip


def resumable(step: int, **parts) -> dict:
    """A single-file checkpoint's contents: every key a resume reads (``RESUME_KEYS``), ``parts`` over them."""
    return {**dict.fromkeys(RESUME_KEYS, {}), "global_step": step, **parts}


def single(path, step: int) -> None:
    StagedCheckpointIO().save_checkpoint(resumable(step, state_dict={"w": torch.full((4,), float(step))}), path)


def sharded(path, step: int, shards: int = 2) -> None:
    """A sharded checkpoint written the staged way, as FSDP2Strategy.save_checkpoint does."""
    staging = staging_path(path)
    staging.mkdir(parents=True)
    for rank in range(shards):
        (staging / f"__{rank}_0.distcp").write_bytes(bytes([step]) * (100 + rank))
    torch.save({"global_step": step}, staging / "meta.pt")
    write_manifest(staging, step)
    commit(staging, path)


def set_mtime(path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def test_a_staged_single_file_replaces_the_old_one_whole(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    single(path, 3)
    single(path, 4)
    assert checkpoint_step(path) == 4
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no staging file left behind
    StagedCheckpointIO().remove_checkpoint(path)
    assert not path.parent.exists() or not any(path.parent.iterdir())


def test_a_sharded_checkpoint_is_complete_only_as_its_manifest_says(tmp_path):
    path = tmp_path / "last.ckpt"
    sharded(path, 5)
    sharded(path, 6)  # replaces a folder: the old one is moved aside, then removed
    assert checkpoint_step(path) == 6 and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["global_step"] == 6 and set(manifest["files"]) == {"__0_0.distcp", "__1_0.distcp", "meta.pt"}

    (path / "__1_0.distcp").write_bytes(b"x")  # a shard of another step, or truncated
    with pytest.raises(IncompleteCheckpointError, match="__1_0.distcp has 1 bytes, the manifest says 101"):
        checkpoint_step(path)
    (path / "__1_0.distcp").unlink()
    with pytest.raises(IncompleteCheckpointError, match="__1_0.distcp is missing"):
        checkpoint_step(path)
    (path / "manifest.json").unlink()  # what an in-place write killed midway leaves: no marker
    with pytest.raises(IncompleteCheckpointError, match="no manifest.json"):
        checkpoint_step(path)


def test_a_truncated_single_file_is_incomplete(tmp_path):
    path = tmp_path / "step=3.ckpt"
    single(path, 3)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(IncompleteCheckpointError, match="unreadable"):
        checkpoint_step(path)


def test_a_single_file_damaged_inside_a_tensor_is_incomplete(tmp_path):
    """The tensors are mapped, not read, when the step is found: damage inside one (its zip record intact) was taken
    for a complete checkpoint, and the restore then failed deep in torch's reader. Each record's checksum tells."""
    path = tmp_path / "step=3.ckpt"
    StagedCheckpointIO().save_checkpoint(resumable(3, state_dict={"w": torch.arange(4096.0)}), path)
    data = bytearray(path.read_bytes())
    at = bytes(data).index(torch.arange(4096.0).numpy().tobytes()[:64])  # the tensor's bytes in the archive
    data[at + 100 : at + 200] = b"x" * 100
    path.write_bytes(bytes(data))
    assert checkpoint_step(path) == 3  # found cheaply, as every checkpoint beside it is
    with pytest.raises(IncompleteCheckpointError, match=r"damaged: its record .*data/0 fails its checksum"):
        checkpoint_step(path, intact=True)  # the one a run resumes from is read whole
    single(tmp_path / "step=2.ckpt", 2)
    os.utime(path, (time.time() + 10, time.time() + 10))  # the damaged one is the newer
    found, passed_over = newest_complete(tmp_path)
    assert found.path.name == "step=2.ckpt" and [(p.name, what) for p, what, _ in passed_over] == [("step=3.ckpt", "incomplete")]
    # An archive written without checksums (a torch.save setting for speed) has none to fail.
    from torch.utils.serialization import config

    config.save.compute_crc32 = False
    try:
        single(tmp_path / "step=4.ckpt", 4)
    finally:
        config.save.compute_crc32 = True
    assert checkpoint_step(tmp_path / "step=4.ckpt", intact=True) == 4


def test_last_is_the_highest_complete_step_whatever_the_name(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    single(checkpoints / "step=3.ckpt", 3)
    single(checkpoints / "last.ckpt", 3)
    single(checkpoints / "last-v1.ckpt", 6)
    sharded(tmp_path / "hpc_ckpt_5.ckpt", 5)
    found, passed_over = newest_complete(tmp_path)
    assert (found.path.name, found.step, passed_over) == ("last-v1.ckpt", 6, [])

    # A newer, higher-named one that is broken is passed over, and named with the reason.
    broken = checkpoints / "step=9.ckpt"
    broken.write_bytes(b"PK\x03\x04 cut short")
    found, passed_over = newest_complete(tmp_path)
    assert found.path.name == "last-v1.ckpt"
    assert [(p.name, what, reason.split(" (")[0]) for p, what, reason in passed_over] == [("step=9.ckpt", "incomplete", "unreadable")]


def test_the_run_an_overwrite_set_aside_is_not_resumed_by_last(tmp_path, capsys):
    """--overwrite renames the earlier run's files in place until its own first step; a kill before that step and a
    requeue with --ckpt_path=last resumed the earlier run's set-aside checkpoint as the newest."""
    (tmp_path / run_folder.RECIPE).write_text(run_folder.marked("task: sft\n"))
    single(tmp_path / "checkpoints" / "last.ckpt", 5)
    (tmp_path / "hf").mkdir(), (tmp_path / "hf" / "model.safetensors").write_bytes(b"weights")
    run_folder.record_export(tmp_path)
    (tmp_path / run_folder.SUMMARY).write_text("{}")
    run_folder.set_aside_run_files(tmp_path)
    (tmp_path / run_folder.RECIPE).write_text(run_folder.marked("task: sft\n"))  # the new run's, as it starts
    assert (tmp_path / "checkpoints" / f"{run_folder.PREFIX}last.ckpt").is_file()
    assert (tmp_path / "hf" / f"{run_folder.PREFIX}model.safetensors").is_file()
    cli.check_run_folder(tmp_path, resuming=True, overwrite=False)  # its set-aside export is no stranger's file in hf/
    assert cli.resume_path(tmp_path, "last") is None  # the overwrite goes on: its first step removes what was set aside
    assert capsys.readouterr().err.strip() == f"resume: no complete checkpoint in {tmp_path}, starting from step 0"


def test_a_file_without_what_lightning_resumes_from_is_passed_over_and_refused_by_name(tmp_path, capsys):
    """A torch.save file with a global_step alone was taken for the newest checkpoint, and the run died in Lightning's
    KeyError ('pytorch-lightning_version'); a weights-only one was refused only once the run had set up."""
    single(tmp_path / "checkpoints" / "step=3.ckpt", 3)
    foreign = tmp_path / "checkpoints" / "step=100.ckpt"
    torch.save({"global_step": 100}, foreign)
    assert cli.resume_path(tmp_path, "last") == str(tmp_path / "checkpoints" / "step=3.ckpt")
    assert capsys.readouterr().err.strip() == (
        "resume: step 3 from checkpoints/step=3.ckpt, the newest complete checkpoint; passed over checkpoints/step=100.ckpt: "
        "not a Lightning checkpoint, it lacks pytorch-lightning_version, state_dict, optimizer_states, lr_schedulers, loops, "
        "which a resume reads: saved with weights only, or by hand"
    )  # fmt: skip
    with pytest.raises(ForeignCheckpointError, match=re.escape(f"ckpt_path: {foreign} is not a Lightning checkpoint (it lacks pytorch-lightning_version, ")):
        cli.resume_path(tmp_path / "other", str(foreign))
    weights_only = {key: value for key, value in resumable(4).items() if key not in ("optimizer_states", "lr_schedulers")}
    torch.save(weights_only, foreign)
    with pytest.raises(ForeignCheckpointError, match=r"is not a Lightning checkpoint \(it lacks optimizer_states, lr_schedulers, which"):
        cli.resume_path(tmp_path / "other", str(foreign))


def test_a_kill_in_the_first_last_ckpt_write_resumes_from_the_complete_step_checkpoint(tmp_path, capsys):
    """The two in-place failures of before: a `last.ckpt/` mixing two steps and a half-written first `last.ckpt`."""
    checkpoints = tmp_path / "checkpoints"
    sharded(checkpoints / "step=3.ckpt", 3)
    mixed = checkpoints / "last.ckpt"  # an in-place write of step 6 killed after one shard: no manifest
    (mixed / "__0_0.distcp").parent.mkdir(parents=True)
    (mixed / "__0_0.distcp").write_bytes(b"6" * 100)
    (mixed / "__1_0.distcp").write_bytes(b"3" * 101)
    torch.save({"global_step": 3}, mixed / "meta.pt")
    assert cli.resume_path(tmp_path, "last") == str(checkpoints / "step=3.ckpt")
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["resume: step 3 from checkpoints/step=3.ckpt, the newest complete checkpoint; passed over "
                    "checkpoints/last.ckpt: incomplete, no manifest.json: the write did not finish"]  # fmt: skip


def test_leftovers_of_a_kill_are_removed_or_finished_never_kept(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    single(checkpoints / "step=4.ckpt", 4)
    # Killed while writing: a partial staging file beside a complete final one.
    (checkpoints / "last.ckpt.staging").write_bytes(b"PK\x03\x04 partial")
    # Killed after the last byte, before the rename: removed by its name all the same, never opened (step=4 stands).
    single(checkpoints / "step=8.ckpt", 8)
    os.replace(checkpoints / "step=8.ckpt", staging_path(checkpoints / "step=8.ckpt"))
    # Killed between the two renames of a folder: the old one moved aside, the complete new one not yet in place.
    sharded(tmp_path / "hpc_ckpt_6.ckpt", 6)
    os.replace(tmp_path / "hpc_ckpt_6.ckpt", staging_path(tmp_path / "hpc_ckpt_6.ckpt"))
    (tmp_path / "hpc_ckpt_5.ckpt.trash").mkdir()
    done = clean_staging(tmp_path)
    assert done == [
        "removed checkpoints/last.ckpt.staging, left by a killed write",
        "removed checkpoints/step=8.ckpt.staging, left by a killed write",
        "renamed the complete hpc_ckpt_6.ckpt.staging into place",
        "removed hpc_ckpt_5.ckpt.trash, left by a killed write",
    ]
    assert sorted(p.name for p in tmp_path.rglob("*.ckpt*") if p.parent in (tmp_path, checkpoints)) == ["hpc_ckpt_6.ckpt", "step=4.ckpt"]
    assert newest_complete(tmp_path)[0].step == 6
    remove(tmp_path / "hpc_ckpt_6.ckpt")
    assert not (tmp_path / "hpc_ckpt_6.ckpt").exists() and clean_staging(tmp_path) == []


def test_resume_names_what_it_cannot_use(tmp_path, capsys):
    assert cli.resume_path(tmp_path, None) is None
    assert cli.resume_path(tmp_path, "last") is None  # a first run under `--ckpt_path=last` (SLURM) starts fresh
    assert capsys.readouterr().err.strip() == f"resume: no complete checkpoint in {tmp_path}, starting from step 0"
    (tmp_path / "recipe.yaml").write_text(run_folder.marked("task: sft\n"))  # its first start, killed before a checkpoint
    assert cli.resume_path(tmp_path, "last") is None and "starting from step 0" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text("{}")  # a run that ended, its checkpoints removed since: not trained over
    with pytest.raises(ForeignCheckpointError, match=re.escape(f"ckpt_path: last: no complete checkpoint in {tmp_path}, so the run there cannot "
                                                               "be resumed, and starting again from step 0 would train over it; start it over "
                                                               "with --overwrite in place of --ckpt_path, or give another output_dir")):
        cli.resume_path(tmp_path, "last")
    (tmp_path / "summary.json").unlink()
    broken = tmp_path / "checkpoints" / "last.ckpt"
    broken.parent.mkdir()
    broken.write_bytes(b"")
    # The folder's only checkpoint is broken: resuming it must not train again from step 0 over the run.
    with pytest.raises(ForeignCheckpointError, match=r"ckpt_path: last: no complete checkpoint in .*train over it; passed over checkpoints/last.ckpt: incomplete, unreadable"):
        cli.resume_path(tmp_path, "last")
    with pytest.raises(ForeignCheckpointError, match=r"ckpt_path: .*last.ckpt is incomplete \(unreadable"):
        cli.resume_path(tmp_path, str(broken))
    with pytest.raises(cli.RecipeError, match="ckpt_path: no such checkpoint"):
        cli.resume_path(tmp_path, str(tmp_path / "nope.ckpt"))
    # A folder that is no sharded checkpoint is not called an interrupted write; a run's folder says how to resume it.
    with pytest.raises(ForeignCheckpointError, match=re.escape(f"ckpt_path: {tmp_path} is not a checkpoint (a folder without the parts "
                                                               f"of a sharded checkpoint); to resume the run in that folder: "
                                                               f"--output_dir={tmp_path} --ckpt_path=last")):
        cli.resume_path(tmp_path / "other", str(tmp_path))
    with pytest.raises(ForeignCheckpointError, match=r"checkpoints is not a checkpoint \(a folder without the parts of a sharded checkpoint\)$"):
        cli.resume_path(tmp_path / "other", str(tmp_path / "checkpoints"))
    recipe = tmp_path / "recipe.yaml"  # a file given for a checkpoint is not called one cut short
    recipe.write_text("task: sft\n")
    with pytest.raises(ForeignCheckpointError, match=r"recipe.yaml is not a checkpoint \(a file torch.save did not write: a checkpoint is a zip archive\)$"):
        cli.resume_path(tmp_path / "other", str(recipe))
    set_mtime(broken, 10**18)
    single(tmp_path / "checkpoints" / "step=2.ckpt", 2)
    assert cli.resume_path(tmp_path, "last", first=False).endswith("step=2.ckpt")  # other ranks stay quiet
    assert capsys.readouterr().err == ""


def test_the_stock_writers_are_replaced_by_staged_ones_and_a_chosen_one_is_kept(tmp_path, monkeypatch):
    from lightning.fabric.plugins.io import xla as lightning_xla
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.plugins.io.xla import XLACheckpointIO

    from lightning_rl.checkpoints import StagedXLACheckpointIO, staged_checkpoint_io

    assert type(staged_checkpoint_io(TorchCheckpointIO())) is StagedCheckpointIO
    # XLACheckpointIO refuses to be built without torch_xla, which cannot be installed beside this torch: the test
    # says it is there (a mock). The staged save below needs nothing from torch_xla; these are CPU tensors.
    monkeypatch.setattr(lightning_xla, "_XLA_AVAILABLE", True)
    xla = staged_checkpoint_io(XLACheckpointIO())
    assert type(xla) is StagedXLACheckpointIO and isinstance(xla, XLACheckpointIO)  # what XLAStrategy accepts
    chosen = StagedCheckpointIO()
    assert staged_checkpoint_io(chosen) is chosen

    path = tmp_path / "checkpoints" / "last.ckpt"
    weight = torch.arange(4.0, requires_grad=True)
    xla.save_checkpoint(resumable(2, state_dict={"w": weight}), path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"] and checkpoint_step(path) == 2
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["w"], weight.detach())
    xla.remove_checkpoint(path)
    assert not path.exists()


def test_a_per_rank_state_resumes_on_another_number_of_ranks_only_between_batches():
    from types import SimpleNamespace

    from lightning_rl.checkpoints import ForeignCheckpointError, every_ranks, this_ranks

    assert every_ranks({"batch": None}) == {"per_rank": [{"batch": None}]}  # one process: its own
    trainer = lambda rank, world: SimpleNamespace(global_rank=rank, world_size=world, ckpt_path="last.ckpt")  # noqa: E731
    working = {"per_rank": [{"batch": {"index": 3}}, {"batch": {"index": 3}}]}
    assert this_ranks(working, trainer(1, 2), lambda s: s["batch"] is not None) == {"batch": {"index": 3}}
    with pytest.raises(ForeignCheckpointError, match="was written by 2 ranks, in the middle of their own rollouts; this run has 1"):
        this_ranks(working, trainer(0, 1), lambda s: s["batch"] is not None)
    between = {"per_rank": [{"batch": None, "history": [1.0]}, {"batch": None, "history": [1.0]}]}
    assert this_ranks(between, trainer(0, 4), lambda s: s["batch"] is not None) == {"batch": None, "history": [1.0]}
    assert this_ranks({"batch": None}, trainer(0, 2), lambda s: False) == {"batch": None}  # an older checkpoint
