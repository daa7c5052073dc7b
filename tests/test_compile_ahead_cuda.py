"""compile_ahead on a GPU: on an empty Triton cache, start-up compiles the graphs' kernels ahead
(in parallel) and the graph reserve measurement and the captures then compile nothing.

Runs the start-up in a fresh process with its own empty TRITON_CACHE_DIR (in this process the
kernels are long compiled), counting Triton compiles per start-up phase with Triton's
post-compile hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {scripts!r})
from triton import knobs
from model_shapes import write_config
from runner import LLM
from runner import model_runner as mr

counts = {{"phase": "load_and_profile"}}
def on_compile(*args, **kwargs):
    counts[counts["phase"]] = counts.get(counts["phase"], 0) + 1
    fn = kwargs.get("fn")
    what = {{k: v for k, v in (kwargs.get("compile") or {{}}).items() if k in ("constants", "signature", "num_warps")}}
    counts.setdefault("kernels", []).append([counts["phase"], getattr(fn, "name", str(fn)), str(what)[:600]])
knobs.runtime.jit_post_compile_hook = on_compile

precompile = mr.ModelRunner.precompile_graph_kernels
def phased(self):
    counts["phase"] = "precompile"
    precompile(self)
    counts["phase"] = "reserve_and_capture"
mr.ModelRunner.precompile_graph_kernels = phased

llm = LLM(model=str(write_config("smollm2-135m", {tmp!r})), load_format="dummy", dtype="bfloat16",
          cudagraph_mode="FULL_AND_PIECEWISE", gpu_memory_utilization=0.3, max_model_len=2048)
runner = llm.engine.model_runner
counts.pop("phase")
counts["precompile_s"] = round(runner.precompile_seconds, 2)
counts["capture_s"] = round(runner.capture_summary.seconds, 2)
counts["graphs"] = runner.capture_summary.num_graphs
print("COUNTS " + json.dumps(counts))
"""


def test_capture_compiles_nothing_after_compiling_ahead(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    env.pop("GRAPHRUNNER_COMPILE_THREADS", None)
    script = SCRIPT.format(root=str(ROOT), scripts=str(ROOT / "scripts"), tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    counts = json.loads(done.stdout.split("COUNTS ", 1)[1])
    for phase, name, what in counts.pop("kernels", []):
        print(phase, name, what)
    print(counts)
    assert counts.get("precompile", 0) > 0, counts
    assert counts.get("reserve_and_capture", 0) == 0, counts
    assert counts["graphs"] > 60
