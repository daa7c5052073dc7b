"""`graphrunner bench fused_ops` runs its kernels on a CPU (Triton's interpreter) at tiny sizes and
writes its raw results."""

from __future__ import annotations

import json
import os

import pytest
import torch

from runner.cli import main as cli_main


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_fused_ops_benchmark_smoke(tmp_path, capsys):
    assert cli_main(["bench", "fused_ops", "--device", "cpu", "--tokens", "1", "3", "--heads", "4", "2", "16",
                     "--rows", "1", "2", "--vocab", "1500", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fused_ops.json").read_text())
    assert [r["tokens"] for r in result["rope_and_cache"]] == [1, 3]
    assert all(r["us"] > 0 and r["us_with_qk_norms"] > 0 for r in result["rope_and_cache"])
    assert [r["rows"] for r in result["race"]] == [1, 2] and all(r["us"] > 0 for r in result["race"])
    assert "with q/k norms" in capsys.readouterr().out


def test_fused_ops_benchmark_refuses_a_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the benchmark itself")
    with pytest.raises(SystemExit):
        cli_main(["bench", "fused_ops", "--device", "cpu"])
