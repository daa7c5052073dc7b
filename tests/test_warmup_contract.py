"""Issue 4: the warm-up contract as a state machine, on a CPU, with a clearly named fake graph.

The real capture/replay is covered by the `cuda` tests; here the graph primitive is
`NoOpGraphForTests` (it records that capture happened and replays nothing), and the mode
resolution is forced to a graph mode, so every decision the runner makes around capture runs.
"""

from __future__ import annotations

import logging

import pytest
import torch

from attention.backends.base import AttentionCGSupport
from attention.backends.torch_sdpa import TorchSDPABackend
from checkpoints import make_tiny_checkpoint
from configs import CUDAGraphMode, EngineConfig
from models import load_hf_config, model_spec
from runner import model_runner as model_runner_module
from runner.executor import start_model_runner
from runner.model_runner import ModelRunner


class NoOpGraphForTests:
    """Stands in for torch.cuda.CUDAGraph on a CPU: counts captures, replays nothing."""
    captures = 0

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:
        NoOpGraphForTests.captures += 1

    def capture_end(self) -> None:
        """Nothing was recorded, so there is nothing to close."""

    def replay(self) -> None:
        """Nothing was recorded, so nothing runs."""


class KVRequiredBackend(TorchSDPABackend):
    """Like a hybrid / linear-attention model: its decode path needs the KV cache, always."""
    cudagraph_support = AttentionCGSupport.ALWAYS
    calls_without_cache = 0

    def forward(self, layer, query, key, value, out, kv_cache, metadata):
        if kv_cache is None:
            if metadata.uniform_decode:
                raise AssertionError("decode without a KV cache")
            KVRequiredBackend.calls_without_cache += 1
        super().forward(layer, query, key, value, out, kv_cache, metadata)


@pytest.fixture()
def runner_factory(tmp_path, monkeypatch):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama_gqa", with_tokenizer=False)
    spec = model_spec(load_hf_config(path))
    monkeypatch.setattr(model_runner_module, "get_attention_backend", lambda name, kernel=None: KVRequiredBackend())

    def make(mode: str) -> ModelRunner:
        monkeypatch.setattr(model_runner_module, "resolve_cudagraph_mode", lambda requested, support, device: requested)
        config = EngineConfig.from_kwargs(model=str(path), cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8],
                                          max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=32, device="cpu")
        runner = ModelRunner(config, spec, str(path), torch.device("cpu"), torch.float32, 128)
        runner.graph_factory = NoOpGraphForTests
        return runner, config
    return make


@pytest.mark.parametrize("mode, expected_graphs", [
    ("FULL_AND_PIECEWISE", 4 + 4),   # FULL uniform-decode keys 1,2,4,8 and PIECEWISE keys 1,2,4,8
    ("FULL", 4 + 4),                 # FULL uniform-decode and FULL mixed keys
    ("PIECEWISE", 4 + 4),            # PIECEWISE mixed keys and, mode PIECEWISE only, decode keys (with the head)
    ("FULL_DECODE_ONLY", 4),
])
def test_profile_run_skips_capture_then_capture_sets_ready(runner_factory, caplog, mode, expected_graphs):
    runner, config = runner_factory(mode)
    NoOpGraphForTests.captures = 0
    KVRequiredBackend.calls_without_cache = 0
    runner.load_model()
    with caplog.at_level(logging.INFO, logger="runner.graph_start_up"):
        runner.profile_run()
    assert "cudagraph capture skipped: no KV cache yet" in caplog.text
    assert not runner.cuda_graph_ready and not runner.dispatcher.ready
    assert NoOpGraphForTests.captures == 0 and KVRequiredBackend.calls_without_cache > 0
    # Not ready: every dispatch decision is eager.
    assert runner.dispatcher.dispatch(4, 4, True) == (CUDAGraphMode.NONE, None)
    runner.initialize_kv_cache(32)
    runner.capture_cudagraphs()
    assert runner.cuda_graph_ready and runner.dispatcher.ready
    captured = sum(w.num_captured for w in (runner.full, runner.piecewise) if w is not None)
    assert captured == expected_graphs == runner.capture_summary.num_graphs
    mode_now, desc = runner.dispatcher.dispatch(3, 3, True)
    assert mode_now == CUDAGraphMode(mode).decode_mode() and desc.num_tokens == 4
    import gc
    import weakref
    graphs = [entry.graph for w in (runner.full, runner.piecewise) if w is not None for entry in w._entries.values()]
    for graph in graphs:
        graph.cycle = graph   # a graph in a reference cycle: only the garbage collector frees it
    alive = [weakref.ref(graph) for graph in graphs]
    del graphs, graph
    gc.freeze()   # as a serving process does after start-up (quiet_garbage_collector)
    try:
        runner.release_cuda_graphs()  # what a parallel rank does before destroying its NCCL groups
        assert alive and not any(ref() for ref in alive)   # frozen, in cycles, and freed all the same
    finally:
        gc.unfreeze()
    assert all(w.num_captured == 0 for w in (runner.full, runner.piecewise) if w is not None)


def test_capture_outside_the_capture_phase_raises(runner_factory):
    runner, _ = runner_factory("PIECEWISE")
    runner.load_model()
    runner.initialize_kv_cache(32)
    runner.dispatcher.mark_ready()
    runner.cuda_graph_ready = True  # pretend: graphs "ready" but never captured
    from runner.scheduler import ScheduledRequest, SchedulerOutput
    from configs import SamplingParams
    sched = SchedulerOutput([ScheduledRequest("r", [5, 6, 7], 0, [0], True, SamplingParams(temperature=0), 0)],
                            3, [], [])
    with pytest.raises(RuntimeError, match="outside the capture phase"):
        runner.execute(sched)


def test_start_up_sequence_on_cpu_leaves_graphs_off(runner_factory, tmp_path):
    """The real CPU path: mode resolves to NONE, start-up completes, nothing is captured."""
    runner, config = runner_factory("FULL_AND_PIECEWISE")
    runner.cudagraph_mode = CUDAGraphMode.NONE
    runner.dispatcher.mode = CUDAGraphMode.NONE
    blocks = start_model_runner(runner, config)
    assert blocks == 32 and not runner.cuda_graph_ready


def test_start_up_batches_run_through_the_model_in_each_keys_mode(runner_factory):
    """kernels_compiled_ahead's pass: the profile batch without a KV cache, then every capture key
    once, in its runtime mode, through the model itself (no graph captured), against a scratch KV
    cache that is dropped afterwards."""
    from attention.forward_context import get_forward_context
    runner, _ = runner_factory("FULL_AND_PIECEWISE")
    NoOpGraphForTests.captures = 0
    runner.load_model()
    seen = []

    def spy(input_ids, positions, intermediate):
        context = get_forward_context()
        seen.append((context.runtime_mode, context.batch_descriptor, input_ids.shape[0],
                     context.kv_caches is not None and context.kv_caches[0].shape[1] == 1))
        return runner.model_forward(input_ids, positions, intermediate)

    runner._run_start_up_batches(spy)
    keys = runner.dispatcher.all_keys_to_capture()
    assert seen[0] == (CUDAGraphMode.NONE, None, runner._profile_batch()[0], False)
    assert [(mode, desc, desc.num_tokens, True) for mode, desc in keys] == seen[1:]
    assert {entry[0] for entry in seen[1:]} == {CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE}
    assert NoOpGraphForTests.captures == 0 and runner.kv_caches is None
    assert runner.full.num_captured == runner.piecewise.num_captured == 0


def test_queued_sampling_repeats_the_profile_runs_sampler_call_without_logprobs(runner_factory, monkeypatch):
    """kernels_compiled_ahead queues the sampler kernels the profile run launches: the same sampler
    call on as many rows (launches only queued, so no logprobs, whose gather would read the draw's
    unwritten tokens), the draw at a temperature alone (no top-k/top-p: no candidate lists), and
    the greedy argmax variants on the rank that samples."""
    from runner import greedy
    runner, _ = runner_factory("FULL_AND_PIECEWISE")
    runner.load_model()
    calls, sampler = [], runner.sampling.sampler

    def spy(logits, metadata):
        calls.append((tuple(logits.shape), logits.dtype, metadata.max_num_logprobs, metadata.no_top_k,
                      metadata.no_top_p, metadata.all_random))
        return sampler(logits, metadata)

    monkeypatch.setattr(runner.sampling, "sampler", spy)
    queued = []
    monkeypatch.setattr(greedy, "queue_variants", lambda *args: queued.append(args))
    runner.profile_run()
    runner.queue_sampling_variants()
    rows = min(runner.max_num_reqs, sum(runner.profile_lengths()))
    expected = ((rows, runner.spec.vocab_size), torch.float32)
    assert calls == [(*expected, 5, False, False, True), (*expected, None, False, False, True),
                     (*expected, None, True, True, True)]
    assert queued == [(runner.spec.vocab_size, (torch.float32, torch.float32), runner.device)]


def test_the_queue_pass_queues_the_models_kernels_before_the_samplers(runner_factory, monkeypatch):
    """The compiles start in the order they are queued: the model's (the profile run meets them
    first; the attention kernels are the longest) before the sampler's and the argmax's. The
    model's batches run through one layer of each kind (`DecoderModel.kinds_only`)."""
    from contextlib import contextmanager, nullcontext
    from runner import graph_start_up
    runner, _ = runner_factory("FULL_AND_PIECEWISE")
    runner.load_model()
    order = []

    @contextmanager
    def compile_ahead(threads):
        yield True
    monkeypatch.setattr(graph_start_up, "compile_ahead", compile_ahead)
    monkeypatch.setattr(graph_start_up, "queuing_launches", nullcontext)
    monkeypatch.setattr(runner, "_compiles_ahead", lambda: True)
    decoder = runner.model.model
    kinds = decoder.one_layer_of_each_kind()

    def start_up_batches(forward):
        assert decoder._forwarded_layers == kinds
        order.append("model")
    monkeypatch.setattr(runner, "_run_start_up_batches", start_up_batches)
    monkeypatch.setattr(runner, "queue_sampling_variants", lambda: order.append("sampler"))
    with runner.kernels_compiled_ahead():
        assert order == ["model", "sampler"]   # queued on entry, before the block's start-up work
    assert order == ["model", "sampler"] and decoder._forwarded_layers is None


def test_a_start_up_with_graphs_leaves_a_record_the_next_one_finds(runner_factory, monkeypatch, tmp_path):
    """record_start_up writes the record of this configuration, with its graph reserve, once its
    graphs are captured (only where kernels compile ahead: a GPU with graphs), and earlier_start_up
    finds it; another configuration does not."""
    runner, _ = runner_factory("FULL_AND_PIECEWISE")
    runner.config.kernel.cache_dir = str(tmp_path)
    runner.record_start_up()   # on a CPU nothing compiles ahead: no record
    assert runner.earlier_start_up() is None and not (tmp_path / "triton").exists()
    monkeypatch.setattr(runner, "_compiles_ahead", lambda: True)
    runner.cuda_graph_ready = False
    runner.graph_reserve_bytes = 94 << 20
    runner.record_start_up()   # graphs not captured: no record
    assert runner.earlier_start_up() is None
    runner.cuda_graph_ready = True
    runner.record_start_up()
    assert runner.earlier_start_up().graph_reserve_bytes == 94 << 20
    runner.config.scheduler.max_num_seqs = 4
    assert runner.earlier_start_up() is None
    runner.config.kernel.cache_dir = str(tmp_path / "file")
    (tmp_path / "file").write_text("")   # a cache folder that cannot be made: a warning, no error
    runner.record_start_up()
    assert runner.earlier_start_up() is None


def test_a_recorded_graph_reserve_replaces_the_measurement(runner_factory, monkeypatch):
    """With a recorded reserve the measurement's captures do not run and the KV cache is sized with
    the recorded bytes; without one the reserve is measured (0 on a CPU)."""
    runner, _ = runner_factory("FULL_AND_PIECEWISE")
    monkeypatch.setattr(runner, "device", torch.device("cuda"))   # only the check of the device type reads it
    monkeypatch.setattr(runner, "_build_graph_wrappers", lambda pool: pytest.fail("measured a recorded reserve"))
    assert runner.measure_graph_reserve(recorded=94 << 20) == 94 << 20 == runner.graph_reserve_bytes


@pytest.mark.parametrize("held, agreed, queued", [(True, None, False), (False, None, True), (True, 0, True),
                                                  (False, 1, True)])
def test_start_up_skips_the_queue_pass_only_where_every_rank_holds_the_record(runner_factory, monkeypatch,
                                                                              held, agreed, queued):
    """The queue pass and the reserve's captures run the model's collectives, so ranks skip them
    together: the minimum over the ranks (`agreement.min`) of whether each holds its record."""
    from contextlib import contextmanager

    from runner import executor
    from runner.start_up_record import StartUpRecord
    runner, config = runner_factory("FULL_AND_PIECEWISE")
    monkeypatch.setattr(runner, "earlier_start_up", lambda: StartUpRecord(94 << 20) if held else None)
    seen, reserves = [], []

    @contextmanager
    def compiled_ahead(queue=True):
        seen.append(queue)
        yield
    monkeypatch.setattr(runner, "kernels_compiled_ahead", compiled_ahead)
    monkeypatch.setattr(runner, "measure_graph_reserve", lambda recorded=None: reserves.append(recorded) or 0)

    class OneRankAgreement:   # this rank alone, except that another rank answers `agreed` to the first min
        asked = 0

        def gather(self, value):
            return [value]

        def min(self, value):
            self.asked += 1
            return min(value, agreed) if self.asked == 1 else value

    runner.cudagraph_mode = CUDAGraphMode.NONE
    runner.dispatcher.mode = CUDAGraphMode.NONE
    executor.start_model_runner(runner, config, None if agreed is None else OneRankAgreement())
    assert seen == [queued]
    assert reserves == [None if queued else 94 << 20]


def test_without_the_queue_pass_compiling_ahead_runs_no_forward(runner_factory, monkeypatch):
    runner, _ = runner_factory("FULL_AND_PIECEWISE")
    runner.load_model()
    monkeypatch.setattr(runner, "_compiles_ahead", lambda: True)
    monkeypatch.setattr(runner, "_run_start_up_batches", lambda forward: pytest.fail("queue pass ran"))
    with runner.kernels_compiled_ahead(queue=False):
        ran = True
    assert ran and runner.precompile_seconds == 0.0


def test_compiling_ahead_is_a_plain_block_on_a_cpu(runner_factory, monkeypatch):
    runner, _ = runner_factory("FULL_AND_PIECEWISE")
    runner.load_model()
    monkeypatch.setattr(runner, "_run_start_up_batches", lambda forward: pytest.fail("ran on a CPU"))
    with runner.kernels_compiled_ahead():
        ran = True
    assert ran and runner.precompile_seconds == 0.0 and runner.kv_caches is None


def test_capture_records_addresses_for_the_first_replay_check_by_default(runner_factory, caplog):
    """Production default: every captured graph's addresses are recorded (checked on its first
    replay); the capture summary and one INFO line say what recording cost."""
    from runner.cudagraph import AddressCheck
    runner, _ = runner_factory("FULL_AND_PIECEWISE")
    runner.load_model()
    runner.initialize_kv_cache(32)
    with caplog.at_level(logging.INFO, logger="runner.graph_start_up"):
        runner.capture_cudagraphs()
    assert runner.full.address_check is runner.piecewise.address_check is AddressCheck.FIRST_REPLAY
    assert all(entry.recorder is not None for w in (runner.full, runner.piecewise) for entry in w._entries.values())
    summary = runner.capture_summary
    assert 0 < summary.address_record_seconds < summary.seconds
    assert f"cudagraph address check (first_replay): recorded the addresses of {summary.num_graphs} graphs" in caplog.text
