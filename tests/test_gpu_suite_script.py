"""scripts/gpu_suite.sh on a CPU: its stages are named for what they measure, a wrong stage is
refused before anything runs, and a stage that runs without a GPU (the address check) writes its
raw output under --out and ends with the table of steps. scripts/tp_soak.sh (the tp-soak stage)
keeps every run's log and trace, reports each run (also into a summary file as it goes), runs
every run cold with the push tests only when asked, soaks several GPU pairs side by side when
asked, and kills a run past its time limit after dumping what it can of it."""

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
          "profile", "pp", "tp-soak"}
SOAK = SUITE.parent / "tp_soak.sh"


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


def test_soak_keeps_each_runs_log_and_reports_it(tmp_path):
    """Without two GPUs the multigpu tests skip, so a run passes at once: one line per run, the
    first with empty kernel caches and the NCCL engines first, the second in the files' order."""
    done = subprocess.run(["bash", str(SOAK), str(tmp_path), "2"], capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("run ")]
    assert [line.split(":")[0] for line in lines] == ["run 1 (empty caches, NCCL first)", "run 2 (warm caches, push first)"]
    assert all("skipped" in line and "rc 0" in line for line in lines)
    assert (tmp_path / "summary.txt").read_text().splitlines() == lines   # kept as each run ends

    def order(run: int) -> list[str]:
        log = (tmp_path / f"run{run}.log").read_text()
        return re.findall(r"^tests/\S+::(test_multigpu\S+) SKIPPED", log, flags=re.M)

    parity = "test_multigpu_tp2_matches_tp1_in_graph_modes"
    kernel_tests = ["test_multigpu_push_all_reduce_equals_nccl",
                    "test_multigpu_a_peer_that_never_pushes_fails_the_step_after_the_timeout"]
    assert order(1) == [f"{parity}[nccl-FULL]", f"{parity}[nccl-FULL_AND_PIECEWISE]", *kernel_tests,
                        f"{parity}[push-FULL]", f"{parity}[push-FULL_AND_PIECEWISE]"]
    four_gpus = "test_multigpu_tp2_pp2_matches_tp1_in_graph_modes"   # skipped on a pair of GPUs too
    assert order(2) == [*kernel_tests, f"{parity}[push-FULL]", f"{parity}[push-FULL_AND_PIECEWISE]",
                        f"{parity}[nccl-FULL]", f"{parity}[nccl-FULL_AND_PIECEWISE]",
                        f"{four_gpus}[FULL]", f"{four_gpus}[FULL_AND_PIECEWISE]"]


def test_soak_cold_push_runs_every_run_cold_with_the_push_tests_only_on_each_gpu_pair(tmp_path):
    """TP_SOAK_ORDER=cold-push with TP_SOAK_PAIRS=2: one soak per pair of the visible GPUs, each into
    its own folder, its lines prefixed with the pair and its GPUs, every run cold with the push tests
    only; a wrong order, or more pairs than the GPUs allow, is refused."""
    done = subprocess.run(["bash", str(SOAK), str(tmp_path), "2"], capture_output=True, text=True, timeout=300,
                          env=dict(ENV, TP_SOAK_ORDER="cold-push", TP_SOAK_PAIRS="2", CUDA_VISIBLE_DEVICES="4,5,6,7"))
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    for pair, gpus in ((0, "4,5"), (1, "6,7")):
        prefix = f"pair {pair} (GPUs {gpus}): "
        lines = [line.removeprefix(prefix) for line in done.stdout.splitlines() if line.startswith(prefix + "run ")]
        assert [re.sub(r", page cache dropped", "", line.split(":")[0]) for line in lines] == [
            "run 1 (empty caches, push only)", "run 2 (empty caches, push only)"]
        folder = tmp_path / f"pair{pair}"
        assert (folder / "summary.txt").read_text().splitlines() == lines
        log = (folder / "run2.log").read_text()
        assert "test_multigpu_tp2_matches_tp1_in_graph_modes[push-FULL] SKIPPED" in log and "nccl-FULL" not in log
        # every process of a run traced (the pytest process at least: it imports the traced modules)
        assert list(folder.glob("run1-trace-*.txt")) and list(folder.glob("run2-trace-*.txt"))
    refused = subprocess.run(["bash", str(SOAK), str(tmp_path / "x"), "1"], capture_output=True, text=True,
                             timeout=60, env=dict(ENV, TP_SOAK_ORDER="random"))
    assert refused.returncode == 2 and "TP_SOAK_ORDER: alternate or cold-push, not 'random'" in refused.stderr
    refused = subprocess.run(["bash", str(SOAK), str(tmp_path / "x"), "1"], capture_output=True, text=True,
                             timeout=60, env=dict(ENV, TP_SOAK_PAIRS="3", CUDA_VISIBLE_DEVICES="0,1"))
    assert refused.returncode == 2 and "TP_SOAK_PAIRS=3 needs 6 GPUs, not 0 1" in refused.stderr


def test_soak_kills_a_run_past_its_limit_and_stops(tmp_path):
    done = subprocess.run(["bash", str(SOAK), str(tmp_path), "3"], capture_output=True, text=True, timeout=120,
                          env=dict(ENV, RUN_S="2", STALL_S="1"))
    assert done.returncode == 1
    assert "run 1 (empty caches, NCCL first): killed after 2 s" in done.stdout and "run 2" not in done.stdout
    assert "run 1 (empty caches, NCCL first): killed after 2 s" in (tmp_path / "summary.txt").read_text()
    assert (tmp_path / "run1-stacks-killed.txt").exists()
    assert not [path for path in tmp_path.iterdir() if path.is_dir()]   # one flat folder
