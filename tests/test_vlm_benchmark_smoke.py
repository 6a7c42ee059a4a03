"""The image-packing benchmark runs end to end at one round and compares like with like: the same rollouts, the
image encoded once under tree packing and once per completion under flat packing. (Its timings are not checked.)"""

from __future__ import annotations

import json
import subprocess
import sys

from support.paths import REPO


def test_the_vlm_packing_benchmark_runs_and_counts_one_image_per_tree(tmp_path):
    out = tmp_path / "vlm.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "vlm_packing.py"), "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(out.read_text())
    assert row["tree_images_encoded"] == 1 and row["flat_images_encoded"] == row["completions"] == 8
    assert row["tree_tokens"] == row["flat_tokens"] - 7 * (32 + row["image_tokens"])  # the shared prompt forwarded once
    assert row["flop_bound"] > 1
