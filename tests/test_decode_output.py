"""A uniform-decode step in a graph mode computes its logits and greedy tokens inside the graph
(`model_runner.DecodeOutput`); sampling takes them from there. On a CPU, without graphs (the same
forward the graphs capture): what the runner samples from a DecodeOutput equals what it samples
from the hidden rows, greedy and not, and a step where not every row samples uses the hidden rows."""

from __future__ import annotations

import torch

from checkpoints import make_tiny_checkpoint
from configs import CUDAGraphMode, EngineConfig, SamplingParams
from models import load_hf_config, model_spec
from models.layers import decode_step_products
from runner.cudagraph import BatchDescriptor
from runner.model_runner import DecodeOutput, ModelRunner
from runner.scheduler import ScheduledRequest


def _runner(tmp_path) -> ModelRunner:
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama_gqa", with_tokenizer=False)
    config = EngineConfig.from_kwargs(model=str(path), max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=32,
                                      device="cpu")
    runner = ModelRunner(config, model_spec(load_hf_config(path)), str(path), torch.device("cpu"), torch.float32, 128)
    runner.load_model()
    runner.initialize_kv_cache(32)
    return runner


def _decode_step(runner: ModelRunner, desc: BatchDescriptor | None, samples: list[bool]):
    reqs = [ScheduledRequest(f"r{i}", [5 + i], 3 + i, [i], sample, SamplingParams(temperature=0.0), 1)
            for i, sample in enumerate(samples)]
    common = runner.input_batch.prepare([r.token_ids for r in reqs], [r.num_computed_tokens for r in reqs],
                                        [r.block_ids for r in reqs], len(reqs), len(reqs))
    mode = CUDAGraphMode.NONE if desc is None else CUDAGraphMode.FULL
    with torch.inference_mode():
        return reqs, common, runner._forward(len(reqs), common, mode, desc)


def test_graph_mode_decode_step_samples_from_its_own_logits(tmp_path):
    runner = _runner(tmp_path)
    reqs, common, out = _decode_step(runner, BatchDescriptor(3, 3, True), [True] * 3)
    assert isinstance(out, DecodeOutput)
    _, _, hidden = _decode_step(runner, None, [True] * 3)     # eager: the hidden rows only
    assert isinstance(hidden, torch.Tensor) and torch.equal(hidden, out.hidden)
    rows = [0, 1, 2]
    with torch.inference_mode():
        with decode_step_products(True):   # the LM head as a decode step computes it (a CPU's packed weight)
            want = runner.model.compute_logits(hidden)
        assert torch.equal(runner._sampling_logits(reqs, rows, out, common), want)
        assert torch.equal(runner._greedy_tokens(reqs, rows, out, common), want.argmax(dim=-1))
        assert runner._greedy_tokens(reqs, rows, out, common).data_ptr() == out.greedy.data_ptr()
    greedy = runner.sample(reqs, out, common).sampled
    assert greedy == dict(zip(["r0", "r1", "r2"], want.argmax(dim=-1).tolist()))


def test_rows_that_do_not_sample_take_the_hidden_rows(tmp_path):
    """A uniform step whose middle request is a non-final one-token chunk: rows 0 and 2 sample."""
    runner = _runner(tmp_path)
    reqs, common, out = _decode_step(runner, BatchDescriptor(3, 3, True), [True, False, True])
    with torch.inference_mode(), decode_step_products(True):
        want = runner.model.compute_logits(out.hidden[[0, 2]])
        assert torch.equal(runner._sampling_logits(reqs, [0, 2], out, common), want)
    assert runner.sample(reqs, out, common).sampled == {"r0": int(want[0].argmax()), "r2": int(want[1].argmax())}


def test_mixed_descriptors_and_eager_steps_return_hidden(tmp_path):
    runner = _runner(tmp_path)
    assert isinstance(_decode_step(runner, BatchDescriptor(3, 3, False), [True] * 3)[2], torch.Tensor)
    assert isinstance(_decode_step(runner, None, [True] * 3)[2], torch.Tensor)


def test_dropped_runner_is_freed_without_the_cycle_collector(tmp_path):
    """The graph wrappers hold the forward; it must not reference the runner (a cycle would keep a
    dropped engine's memory, GPU memory included, until a gc pass)."""
    import gc
    import weakref

    runner = _runner(tmp_path)
    runner.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE   # as on a GPU: both wrappers
    runner._build_graph_wrappers(None)
    assert runner.full is not None and runner.piecewise is not None
    ref = weakref.ref(runner)
    gc.disable()
    try:
        del runner
        assert ref() is None
    finally:
        gc.enable()
