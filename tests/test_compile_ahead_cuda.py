"""compile_ahead on a GPU: on an empty Triton cache, every kernel the start-up compiles was queued
ahead (by `kernels_compiled_ahead`'s forwards), none at its first launch.

Runs the start-up in a fresh process with its own empty kernel cache folder (KernelConfig.cache_dir) (in this process the
kernels are long compiled), with a fixed KV block count: a budget from gpu_memory_utilization
would count the memory this test process still holds. Every compile inside compile_ahead is submitted through Triton's
AsyncCompileMode.submit, which is wrapped to record, per submit, whether launches were being
queued then and whether the variant is new (a launch of a kernel still compiling submits again
and gets the pending compile: "again"); Triton's cache hook, called just before, names it. After
start-up, generating batches of several sizes compiles no greedy-argmax variant (start-up queued
them all: runner/greedy.queue_variants); the hook lists what serving did compile. A second
start-up on the filled cache skips the queue pass and compiles nothing, and takes the graph reserve
the first measured from its record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
sys.path.insert(0, {root!r})
from triton import knobs
from runner.benchmarks.model_shapes import write_config
from runner import LLM

from triton.runtime._async_compile import AsyncCompileMode
from launch.compile_ahead import compiling_ahead

asked, naming, serving = [], {{"name": "?"}}, []
def on_cache_miss(*args, **kwargs):
    naming["name"] = getattr(kwargs.get("fn"), "name", "?")
    if naming.get("ready"):
        serving.append(naming["name"])
knobs.runtime.jit_cache_hook = on_cache_miss
submit = AsyncCompileMode.submit
def recording_submit(self, key, *args, **kwargs):
    asked.append(["queued" if compiling_ahead() else "at first launch",
                  "again" if key in self.future_kernels else "new", naming["name"]])
    return submit(self, key, *args, **kwargs)
AsyncCompileMode.submit = recording_submit

llm = LLM(model=str(write_config("smollm2-135m", {tmp!r})), load_format="dummy", dtype="bfloat16",
          cudagraph_mode="FULL_AND_PIECEWISE", num_kv_blocks=4096, max_model_len=2048,
          compile_threads=None,   # one thread per CPU up to 16, whatever the environment says
          cache_dir={cache!r})    # Triton compiles into <cache_dir>/triton: empty here
runner = llm.engine.model_runner
naming["ready"] = True   # from here on a compile happens inside serving
from configs import SamplingParams
for batch in (1, 3, 7, 2):   # mixed prefill batches: the eager greedy argmax of `batch` rows
    llm.generate([[5 + i] * (9 + i) for i in range(batch)], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
print("COUNTS " + json.dumps({{"asked": asked, "serving": serving, "queue_s": round(runner.precompile_seconds, 2),
                              "wait_s": round(runner.compile_wait_seconds, 2),
                              "capture_s": round(runner.capture_summary.seconds, 2),
                              "graphs": runner.capture_summary.num_graphs,
                              "reserve": runner.graph_reserve_bytes}}))
"""


def _start_up(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("COUNTS ", 1)[1])


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_start_up_compiles_every_kernel_ahead(tmp_path):
    """The first start-up on an empty cache queues every compile; the second, in a fresh process on
    the same cache, finds the first's record (runner/start_up_record.py), skips the queue pass and
    compiles nothing (the cache gains no kernel), and sizes its KV cache with the recorded reserve."""
    cache = tmp_path / "kernel-cache"
    script = SCRIPT.format(root=str(ROOT), tmp=str(tmp_path), cache=str(cache))
    result = _start_up(script)
    filled = _files(cache / "triton")
    again = _start_up(script)
    print({k: v for k, v in again.items() if k != "asked"})
    assert again["queue_s"] == 0 and not again["asked"] and again["graphs"] == result["graphs"]
    assert again["reserve"] == result["reserve"] > 0   # recorded by the first, not measured again
    assert _files(cache / "triton") == filled
    for how, new, name in result["asked"]:
        print(how, new, name)
    print({k: v for k, v in result.items() if k != "asked"})
    compiled = [(how, name) for how, new, name in result["asked"] if new == "new"]
    late = [name for how, name in compiled if how != "queued"]
    assert compiled and not late, late
    assert not [name for name in result["serving"] if "argmax" in name], result["serving"]
    from runner.cudagraph import default_capture_sizes
    sizes = default_capture_sizes(512, max_num_seqs=256)   # every default graph: the engine's defaults
    assert result["graphs"] == len(sizes) + len([s for s in sizes if s <= 256]) == 50


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "qwen3-0.6b shape"])
def test_one_layer_of_each_kind_queues_every_variant(tmp_path, family):
    """The compile-ahead pass forwards one layer of each kind (`DecoderModel.kinds_only`) and must
    queue exactly the kernel variants that forwarding every layer queues: the same launch keys
    (kernel, its arguments' specialisation, constexprs and options) over the profile batch and
    every capture key, for tiny checkpoints of the families whose layers differ (Gemma 2's
    alternating window, Gemma 3's local / global tables) and Qwen3-0.6B's 28 layers."""
    from launch import compile_ahead as ahead
    from runner import LLM
    from runner.benchmarks.model_shapes import write_config
    from checkpoints import make_tiny_checkpoint
    if family.endswith("shape"):
        path = write_config("qwen3-0.6b", tmp_path)
    else:
        path, _ = make_tiny_checkpoint(tmp_path / family, family, with_tokenizer=False)
    with LLM(model=str(path), load_format="dummy", dtype="bfloat16", cudagraph_mode="FULL_AND_PIECEWISE",
             num_kv_blocks=256, max_model_len=256, cache_dir=str(tmp_path / "kernel-cache")) as llm:
        runner = llm.engine.model_runner
        decoder = runner.model.model
        runner.kv_caches = None   # as at start-up: the profile batch runs without a KV cache
        with ahead.compile_ahead(4), ahead.queuing_launches():
            runner._run_start_up_batches(runner.model_forward)   # leaves kv_caches None
            every = set(ahead._queued)
            ahead._queued.clear()
            with decoder.kinds_only():
                runner._run_start_up_batches(runner.model_forward)
            kinds_only = set(ahead._queued)
    print(family, len(decoder.one_layer_of_each_kind()), "of", len(decoder.layers), "layers;",
          len(every), "variants")
    assert len(every) > 10 and kinds_only == every
