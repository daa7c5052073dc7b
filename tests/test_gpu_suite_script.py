"""scripts/gpu_suite.sh on a CPU: its stages are named for what they measure, a wrong stage is
refused before anything runs, and a stage that runs without a GPU (the address check) writes its
raw output under --out and ends with the table of steps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

SUITE = Path(__file__).resolve().parent.parent / "scripts" / "gpu_suite.sh"
ENV = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
"""The suite runs `python3`: the environment's of this test run (a project .venv need not be active)."""
STAGES = {"tests", "bench", "decode-hf", "attention", "throughput", "features", "startup", "capture", "replay", "addresses",
          "profile", "pp"}


def test_stages_are_the_documented_ones():
    text = SUITE.read_text()
    accepted = re.search(r"\n    (tests\|[^)]*)\) ;;", text).group(1).split("|")
    assert set(accepted) == STAGES
    documented = set(re.findall(r"^#   ([a-z-]+) ", text, flags=re.M)) - {"bash", "all"}
    assert documented == STAGES


def test_unknown_stage_is_refused(tmp_path):
    done = subprocess.run(["bash", str(SUITE), "--out", str(tmp_path), "no-such-stage"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "unknown stage 'no-such-stage'" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_addresses_stage_writes_under_out_and_prints_the_step_table(tmp_path):
    done = subprocess.run(["bash", str(SUITE), "--out", str(tmp_path), "addresses"], capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\| addresses +\| 0 +\|", done.stdout.splitlines()[-1])
    assert json.loads((tmp_path / "addresses" / "addresses.json").read_text())["tensors"] == 80
    assert "===== addresses:" in (tmp_path / "suite.log").read_text()
