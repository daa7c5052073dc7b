"""`graphrunner bench sampler` runs on a CPU at tiny sizes and writes its raw results."""

from __future__ import annotations

import json

from runner.cli import main as cli_main


def test_sampler_benchmark_smoke(tmp_path, capsys):
    assert cli_main(["bench", "sampler", "--device", "cpu", "--vocab", "300", "--batch", "1", "3", "--iters", "2",
                     "--warmup", "1", "--step-ms", "5", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sampler.json").read_text())
    assert {(r["scenario"], r["batch"]) for r in rows} == {(s, b) for s in ("greedy", "random", "penalties", "bitmask")
                                                           for b in (1, 3)}
    assert all(len(r["times_ms"]) == 2 and r["median_ms"] > 0 for r in rows)
    assert all(len(r["host_times_ms"]) == 2 and 0 < r["host_median_ms"] <= r["median_ms"] for r in rows)
    assert "% of step" in capsys.readouterr().out
