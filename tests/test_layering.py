"""The package's layers run one way. Each top-level part of ``lightning_rl`` may import only the parts listed for it
below, the parts form no circle, and no import of ours hides inside a function (where it would dodge a circle)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support.paths import REPO

PACKAGE = REPO / "lightning_rl"

# part -> the parts it may import. A part is a subpackage or a top-level module of lightning_rl.
ALLOWED = {
    "errors": set(),
    "stopping": {"errors"},
    "validation": {"errors"},
    "packing": set(),
    "dotted": set(),
    "console": set(),
    "device_policy": set(),
    "toy": set(),
    "disk_space": {"errors"},
    "checkpoints": {"errors", "disk_space"},
    "losses": {"errors"},
    "rewards": {"dotted", "errors", "models", "stopping"},
    "rollout": {"data", "dotted", "errors", "models", "packing", "rewards", "stopping", "tools", "validation"},
    "tools": {"dotted", "stopping"},
    "attention": {"packing", "device_policy", "errors"},
    "models": {"toy", "errors", "validation", "packing", "disk_space"},
    "ops": {"attention", "packing", "device_policy", "models"},
    "data": {"packing", "device_policy", "models", "toy", "errors", "validation"},
    "strategies": {"models", "checkpoints", "device_policy", "ops", "errors", "validation"},
    "modules": {"attention", "callbacks", "checkpoints", "data", "device_policy", "errors", "losses", "models", "ops", "packing", "rewards", "run_folder", "toy",
                "rollout", "stopping", "strategies", "validation"},  # tools only through the rollout collector
    "callbacks": {"checkpoints", "ops", "strategies", "errors", "stopping"},
    "run_folder": set(),
    "same_run": {"errors", "validation"},
    "recipe": {"callbacks", "checkpoints", "console", "dotted", "errors", "models", "rollout", "run_folder", "same_run", "strategies", "toy",
               "trl_names", "validation"},  # toy: the embedded data file, a stand-in for launch's checks of data values
    "launch": {"models", "rollout", "recipe", "errors", "strategies", "validation"},
    "planner": {"launch", "device_policy", "errors", "models", "validation"},
    "env_report": {"strategies"},
    "recipe_reference": {"recipe", "dotted", "rollout"},
    "trl_names": set(),
    "trl_migration": {"recipe_reference", "trl_names"},
    "cli": {"callbacks", "checkpoints", "console", "data", "errors", "models", "modules", "strategies", "launch", "env_report", "recipe",
            "run_folder", "stopping"},
}
# Imports of ours inside a function, each for a reason other than a circle.
DEFERRED = {
    ("rollout/vllm_server.py", "lightning_rl.rollout.nccl_transport"): "needs vLLM, an optional dependency, at import",
    ("cli.py", "lightning_rl.recipe"): "needs jsonargparse, which `lightning-rl env` must run without",
}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module of ours imported, whether the import sits inside a function or class body) for one file."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
            if isinstance(node, ast.ImportFrom):  # `from lightning_rl import x` imports the part x
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "lightning_rl" else [node.module]
            else:
                names = [a.name for a in node.names]
            found += [(n, node.col_offset > 0) for n in names if n and n.startswith("lightning_rl.")]
    return found


def violations(files: list[Path]) -> list[str]:
    problems, edges = [], {}
    for path in files:
        part = part_of(path)
        for module, deferred in imports(path):
            target = module.split(".")[1]
            if target == part or target == "__init__":
                continue
            edges.setdefault(part, set()).add(target)
            if target not in ALLOWED.get(part, set()):
                problems.append(f"{path.relative_to(PACKAGE)}: {part} imports {module}")
            rel = str(path.relative_to(PACKAGE))
            if deferred and (rel, module) not in DEFERRED:
                problems.append(f"{rel}: imports {module} inside a function")
    for start in edges:  # a circle among parts
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    problems.append("circle: " + " -> ".join(trail + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
    return problems


def test_layers_run_one_way():
    files = sorted(PACKAGE.rglob("*.py"))
    assert {part_of(f) for f in files} - {"__init__"} <= set(ALLOWED), "a new part of the package needs a rule here"
    assert violations(files) == []


def test_the_check_catches_a_forbidden_direction_and_a_circle(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "strategies").mkdir()
    (tmp_path / "models" / "loading.py").write_text("from lightning_rl.strategies.fsdp2 import FSDP2Strategy\n")
    (tmp_path / "strategies" / "fsdp2.py").write_text("def f():\n    from lightning_rl.models.loading import x\n")
    (tmp_path / "strategies" / "xla.py").write_text("from lightning_rl import recipe\n")
    found = violations(sorted(tmp_path.rglob("*.py")))
    assert "models/loading.py: models imports lightning_rl.strategies.fsdp2" in found
    assert "strategies/fsdp2.py: imports lightning_rl.models.loading inside a function" in found
    assert "strategies/xla.py: strategies imports lightning_rl.recipe" in found
    assert any(p.startswith("circle: ") for p in found)


def rollout_side_problems(files: list[Path]) -> list[str]:
    """What runs on the rollout thread (everything under ``rollout/``) imports no Lightning and never reads a
    ``.trainer``: it is given what it needs, so it could run in a process of its own."""
    problems = []
    for path in files:
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] != "rollout":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names] if isinstance(node, ast.Import) else []
            problems += [f"{rel}: imports {n}" for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")]
            if isinstance(node, ast.Attribute) and node.attr in ("trainer", "_trainer"):
                problems.append(f"{rel}:{node.lineno}: reads .{node.attr}")
    return problems


def test_the_rollout_side_knows_no_lightning_module_or_trainer():
    assert rollout_side_problems(sorted(PACKAGE.rglob("*.py"))) == []


# Imports every module named with Lightning blocked; prints those that fail, and why (one needing vLLM, an optional
# dependency, is skipped where vLLM is not installed).
_IMPORT_WITHOUT_LIGHTNING = """
import importlib, json, sys
sys.modules.update(dict.fromkeys(["lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"]))
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("vllm"):
            failed[name] = str(error)
print(json.dumps(failed))
"""


def modules_needing_lightning(names: list[str]) -> dict[str, str]:
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT_LIGHTNING, *names], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_rollout_side_imports_without_lightning():
    """The rule above reads each file's own imports; this imports every module of ``rollout/`` with Lightning
    blocked, so one that reaches Lightning through another part (a datamodule beside the renderer it needs) fails
    too. The control: the prompts' datamodule, a LightningDataModule, does not import so."""
    names = [f"lightning_rl.{'.'.join(p.relative_to(PACKAGE).with_suffix('').parts)}" for p in sorted((PACKAGE / "rollout").rglob("*.py"))]
    assert len(names) > 10 and modules_needing_lightning(names) == {}
    assert list(modules_needing_lightning(["lightning_rl.data.prompts"])) == ["lightning_rl.data.prompts"]


def test_the_grpo_module_keeps_to_the_training_side():
    """``modules/grpo.py`` holds the training side only (advantages, rows, loss, step, push, logging, state): what
    grows past 650 lines belongs to a part of its own."""
    lines = len((PACKAGE / "modules" / "grpo.py").read_text().splitlines())
    assert lines <= 650, f"modules/grpo.py has {lines} lines"


def test_the_rollout_rules_catch_lightning_the_trainer_and_tools_crossing_over(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    for part in ("rollout", "modules", "tools"):
        (tmp_path / part).mkdir()
    (tmp_path / "rollout" / "collector.py").write_text("import lightning as L\nfrom lightning.pytorch import Trainer\n\ndef f(module):\n    return module.trainer.datamodule\n")
    (tmp_path / "modules" / "grpo.py").write_text("from lightning_rl.tools import ToolExecutor\n")
    (tmp_path / "tools" / "executor.py").write_text("from lightning_rl.rollout.base import Rollout\n")
    files = sorted(tmp_path.rglob("*.py"))
    assert rollout_side_problems(files) == [
        "rollout/collector.py: imports lightning", "rollout/collector.py: imports lightning.pytorch", "rollout/collector.py:5: reads .trainer",
    ]
    found = violations(files)
    assert "modules/grpo.py: modules imports lightning_rl.tools" in found  # modules reach tools through the collector
    assert "tools/executor.py: tools imports lightning_rl.rollout.base" in found


def test_no_test_module_imports_another_and_no_port_is_hard_coded():
    """What tests share lives in tests/support; a test picks a free port rather than a number of its own."""
    imports, ports = [], []
    for path in sorted((REPO / "tests").rglob("*.py")):
        text = path.read_text()
        imports += [f"{path.relative_to(REPO)}: {line.strip()}" for line in text.splitlines()
                    if re.match(r"\s*(from|import) test_\w+", line)]  # fmt: skip
        ports += [f"{path.relative_to(REPO)}: {m[0]}" for m in re.finditer(r"(?<![\w.])(?:29\d{3}|MASTER_PORT\W+\d+)\b", text)]
    assert imports == [], imports
    assert ports == [], ports
