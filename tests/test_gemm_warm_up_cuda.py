"""The cuBLAS warm-up in a real start-up on a GPU (runner/gemm_warm_up.py): it runs every planned
call on its thread without an error, leaves the engine's greedy tokens as they are without it,
and sizes the KV cache the same in every start-up of one configuration (its workspace and buffers
are allocated before the profile run resets its peak, whatever the thread's timing).

Each start-up runs in a fresh process (the cuBLAS state and the memory this test process holds
would otherwise carry over), with the KV cache sized from gpu_memory_utilization."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, logging, sys
sys.path.insert(0, {root!r})
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from runner.benchmarks.model_shapes import write_config
from runner import LLM
from configs import SamplingParams
llm = LLM(model=str(write_config("smollm2-135m", {tmp!r})), load_format="dummy", dtype="bfloat16",
          cudagraph_mode="FULL_AND_PIECEWISE", gpu_memory_utilization=0.3, max_model_len=1024,
          cache_dir={cache!r}, gemm_warm_up={on})
outs = llm.generate([[5 + i] * (7 + 3 * i) for i in range(6)], SamplingParams(temperature=0.0, max_tokens=12),
                    use_tqdm=False)
print("RESULT " + json.dumps({{"blocks": llm.engine.executor.num_blocks,
                               "block_bytes": llm.engine.model_runner.kv_cache_bytes_per_block(),
                               "tokens": [o.outputs[0].token_ids for o in outs]}}))
"""


def _start(tmp_path: Path, on: bool) -> tuple[dict, str]:
    script = SCRIPT.format(root=str(ROOT), tmp=str(tmp_path / "ckpt"), cache=str(tmp_path / "cache"), on=on)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), done.stderr


def test_warm_up_runs_keeps_tokens_and_sizes_the_cache_alike_every_time(tmp_path):
    off, off_log = _start(tmp_path, False)   # fills the kernel cache
    _start(tmp_path, True)                   # leaves its record (runner/start_up_record.py): its own config
    first, first_log = _start(tmp_path, True)
    second, _ = _start(tmp_path, True)
    assert "cuBLAS warm-up: first calls of" in first_log and "warm-up stopped" not in first_log
    assert "cuBLAS warm-up" not in off_log
    assert first["tokens"] == second["tokens"] == off["tokens"]
    # Two start-ups alike (both from the record) get the same KV cache, however the thread ran.
    assert first["blocks"] == second["blocks"]
