"""The GPU acceptance script, rehearsed on a CPU: ``benchmarks/gpu_acceptance.py --dry-run`` runs every part end to
end at tiny shapes, without the packages the GPU machine lacks, and writes every figure its report promises.
Nothing here is judged on time."""

import inspect
import json
import subprocess
import sys
import textwrap

import pytest

from lightning_rl.modules.sft import SFTModule
from support.machines import GPU_MACHINE_LACKS, WITHOUT_THEM
from support.paths import REPO

SCRIPT = REPO / "benchmarks" / "gpu_acceptance.py"
CASES = {"no_sharing", "shared_prompt_long", "shared_prompt_short", "nested_forks"}
SPAN_CASES = {"long_prompt_spans_rows", "nested_spans_rows"}  # a group spanning rows: flat, sub-groups, cross-row


def python_without_them(code: str, *args: str) -> subprocess.CompletedProcess:
    # The dry run takes about 35 s on a quiet machine; a loaded one has taken over 300.
    return subprocess.run([sys.executable, "-c", WITHOUT_THEM + textwrap.dedent(code), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=900)  # fmt: skip


def test_core_imports_without_what_the_gpu_machine_lacks():
    done = python_without_them("""
        import importlib
        for name in HIDDEN:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                continue
            raise SystemExit(f"{name} was not hidden")
        import lightning_rl.attention.tree_attention, lightning_rl.ops.logprobs, lightning_rl.packing
        import lightning_rl.modules.sft, lightning_rl.modules.grpo, lightning_rl.data.sft, lightning_rl.data.prompts
        print("imported")
    """)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-3000:]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-acceptance")
    done = python_without_them("""
        import runpy
        sys.argv = sys.argv[1:]  # as if the script were run by name
        runpy.run_path(sys.argv[0], run_name="__main__")
    """, str(SCRIPT), "--dry-run", "--out", str(out))  # fmt: skip
    return done, out


def test_dry_run_runs_every_part_and_says_what_is_missing(dry_run):
    done, out = dry_run
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads((out / "gpu_acceptance.json").read_text())
    parts = report["parts"]
    assert list(parts) == ["cuda_tests", "tree_packing", "trainer_steps", "logprob_memory"]
    assert parts["cuda_tests"]["status"] == "skipped" and "no CUDA" in parts["cuda_tests"]["reason"]
    for name in ("tree_packing", "trainer_steps", "logprob_memory"):
        assert parts[name]["status"] == "ok", parts[name].get("traceback")
        assert parts[name]["seconds"] > 0
    # One line names what is missing and that no part is skipped for it.
    line = next(line for line in done.stdout.splitlines() if line.startswith("imports:"))
    assert all(name in line for name in GPU_MACHINE_LACKS) and "skipping no part" in line
    assert report["imports"] == line
    markdown = (out / "gpu_acceptance.md").read_text()
    assert "| tree_packing | ok |" in markdown and "| cuda_tests | skipped |" in markdown
    assert all(f"| {case} | " in markdown for case in SPAN_CASES)
    assert markdown.strip() in done.stdout


def test_dry_run_reports_every_figure(dry_run):
    _, out = dry_run
    parts = json.loads((out / "gpu_acceptance.json").read_text())["parts"]

    packing = parts["tree_packing"]["figures"]
    assert set(packing["cases"]) == CASES | SPAN_CASES
    for name in SPAN_CASES:
        case = packing["cases"][name]
        for layout in ("flat", "subgroups", "cross_row"):
            assert case[layout]["seconds"] > 0 and case[layout]["peak_gib"] > 0 and case[layout]["tokens"] > 0
        # Cross-row forwards the prompt once: fewer rows and tokens than sub-groups, which keep it in every row.
        assert case["cross_row"]["tokens"] < case["subgroups"]["tokens"] <= case["flat"]["tokens"]
        assert case["flop_bound"] > 1 and case["speedup_over_subgroups"] > 0
    for case in (packing["cases"][name] for name in CASES):
        for layout in ("flat", "tree"):
            assert case[layout]["seconds"] > 0 and case[layout]["peak_gib"] > 0 and case[layout]["tokens"] > 0
        assert case["flat"]["tokens"] >= case["tree"]["tokens"]
    assert packing["cases"]["shared_prompt_long"]["t_over_u"] > 1 and packing["cases"]["no_sharing"]["t_over_u"] == 1

    steps = parts["trainer_steps"]["figures"]
    offered = "verify_packing" in inspect.signature(SFTModule.__init__).parameters
    for task in ("sft", "grpo"):
        figures = steps[task]
        assert figures["steps"] == 2 and figures["peak_memory_mb"] > 0 and figures["wall_seconds"] > 0
        assert figures["verify_packing"] == ("first_step" if offered else "not offered")

    logprobs = parts["logprob_memory"]["figures"]
    for way in ("chunked", "plain"):
        assert logprobs[way]["fits"] and logprobs[way]["peak_extra_gib"] > 0 and logprobs[way]["seconds"] > 0
    assert logprobs["max_abs_diff"] < 1e-4


def test_a_failing_part_fails_the_run_and_hides_no_other_part(tmp_path):
    # The parts' bodies are stand-ins here: what is checked is the frame around them.
    done = python_without_them("""
        sys.path.insert(0, sys.argv[1])
        import gpu_acceptance

        def broken(setting, out):
            raise RuntimeError("kernel mismatch")

        gpu_acceptance.PARTS.update(tree_packing=broken, trainer_steps=lambda setting, out: {"sft": None}, logprob_memory=lambda setting, out: {})
        raise SystemExit(gpu_acceptance.main(["--dry-run", "--out", sys.argv[2]]))
    """, str(SCRIPT.parent), str(tmp_path))  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    parts = json.loads((tmp_path / "gpu_acceptance.json").read_text())["parts"]
    assert parts["tree_packing"]["status"] == "failed" and "RuntimeError: kernel mismatch" in parts["tree_packing"]["error"]
    assert [parts[name]["status"] for name in ("cuda_tests", "trainer_steps", "logprob_memory")] == ["skipped", "ok", "ok"]
    assert "| tree_packing | failed |" in (tmp_path / "gpu_acceptance.md").read_text()


def test_engine_options_are_still_checked_by_name_without_jsonargparse():
    done = python_without_them("""
        from lightning_rl.modules.grpo import GRPOModule
        try:
            GRPOModule(engine={"class_path": "hf", "init_args": {"devise": "cpu"}})
        except ValueError as error:
            print(error.key, error)
        GRPOModule(engine={"class_path": "hf", "init_args": {"device": "cpu"}})
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine.init_args.devise devise: not an option of HFRolloutEngine" in done.stdout
