"""The PIECEWISE step graph, on a CPU: the driver form of a launch (parameter layout, config,
refusals), StepAttention's and the Triton backend's parts of the per-step binding (planned, not
launched), BreakableGraph's hand-over to the step graph and its fallback, the step graph's build /
update / launch decisions and errors (a FAKE driver records them), and that the C source compiles.
GPU tests (tests/test_triton_gpu.py, tests/test_engine_cuda.py) run the real one against Triton's
launches bit for bit and against eager and HF tokens."""

from __future__ import annotations

import ctypes
import gc
import struct
from types import SimpleNamespace

import pytest
import torch

from launch.driver_launch import kernel_launch
from launch import native_build
from runner.cudagraph import breakable, step_graph
from launch.break_point import StepGraphLink
from runner.cudagraph.breakable import BreakableGraph, BreakRecord, StepGraphReplay
from runner.cudagraph.step_graph import StepGraph

SIGNATURE = {"q": "*fp32", "cache": "*bf16", "out": "*fp32", "scale": "fp32", "n": "i32", "BLOCK": "constexpr",
             "stride": "i64", "flag": "i1", "half": "fp16", "count": "u32"}


def fake_kernel(signature=SIGNATURE, **metadata) -> SimpleNamespace:
    meta = dict(num_warps=4, num_ctas=1, shared=2048, launch_pdl=True, launch_cooperative_grid=False,
                global_scratch_size=0, profile_scratch_size=0)
    meta.update(metadata)
    return SimpleNamespace(src=SimpleNamespace(signature=dict(signature)), metadata=SimpleNamespace(**meta),
                           function=0xF00D)


ARGS = (0x1000, 0x2000, 0x3000, 0.125, -7, 64, 1 << 40, 1, 1.5, 3)


def test_driver_form_lays_out_every_non_constexpr_argument_in_an_8_byte_slot():
    launch = kernel_launch(fake_kernel(), (5, 2), ARGS)
    assert launch is not None and launch.function == 0xF00D
    assert list(launch.config) == [5, 2, 1, 128, 2048]    # grid, 32 * warps, shared bytes
    raw = bytes(launch.blob)
    slots = [raw[8 * i:8 * i + 8] for i in range(len(launch.blob))]
    assert len(slots) == 9 + 2                   # 9 parameters (BLOCK is a constexpr) + two scratch pointers
    assert [struct.unpack("<Q", s)[0] for s in slots[:3]] == [0x1000, 0x2000, 0x3000]
    assert struct.unpack("<f", slots[3][:4])[0] == 0.125               # a float as its fp32 bits
    assert struct.unpack("<i", slots[4][:4])[0] == -7
    assert struct.unpack("<q", slots[5])[0] == 1 << 40
    assert slots[6][0] == 1 and struct.unpack("<e", slots[7][:2])[0] == 1.5
    assert struct.unpack("<I", slots[8][:4])[0] == 3
    assert slots[9] == slots[10] == bytes(8)                            # no scratch
    base = ctypes.addressof(launch.blob)
    assert [launch.params[i] for i in range(11)] == [base + 8 * i for i in range(11)]


def test_driver_form_is_worked_out_once_per_kernel_and_rebound_per_launch():
    kernel = fake_kernel()
    first = kernel_launch(kernel, (5,), ARGS)
    second = kernel_launch(kernel, (9, 3, 2), (0x4000,) + ARGS[1:4] + (11,) + ARGS[5:])
    assert first is second
    assert list(second.config)[:3] == [9, 3, 2]
    assert second.blob[0] == 0x4000 and struct.unpack("<i", bytes(second.blob)[32:36])[0] == 11


@pytest.mark.parametrize("change, why", [
    (dict(num_ctas=2), "cluster"),
    (dict(launch_cooperative_grid=True), "cooperative"),
    (dict(global_scratch_size=16), "scratch"),
    (dict(profile_scratch_size=8), "scratch"),
    (dict(tensordesc_meta=[{}]), "descriptor"),
])
def test_driver_form_refuses_what_it_cannot_lay_out_like_triton(change, why):
    assert kernel_launch(fake_kernel(**change), (1,), ARGS) is None


def test_driver_form_refuses_unknown_types_tensors_and_mismatched_signatures():
    assert kernel_launch(fake_kernel(dict(SIGNATURE, half="bf16")), (1,), ARGS) is None      # no bf16 packing
    assert kernel_launch(fake_kernel(), (1,), (torch.zeros(1),) + ARGS[1:]) is None          # a tensor, not an address
    assert kernel_launch(fake_kernel(), (1,), ARGS[:-1]) is None                             # one argument short
    swapped = {"n": "i32", "q": "*fp32", "cache": "*bf16", "out": "*fp32"}
    assert kernel_launch(fake_kernel(swapped), (1,), (1, 2, 3, 4)) is None                   # first three not pointers
    assert kernel_launch(SimpleNamespace(function=1), (1,), ARGS) is None                    # no signature at all


_KERNEL = fake_kernel()


def launch_kernel():
    """One fake kernel for the tests that relaunch it (the driver form is worked out per kernel)."""
    return _KERNEL


class FakeDriver:
    """Stands in for the C library's step-graph functions: records what each is given (the
    attention parameters per node as the driver would copy them), returns `fail` where asked."""

    def __init__(self, fail: dict | None = None) -> None:
        self.fail, self.calls, self.nodes = fail or {}, [], {}

    def _nodes(self, n, function, config, slots, values, p):
        for i in range(n):
            for k in range(p):
                slots[k] = values[i * p + k]
            self.nodes[i] = (function, list(config)[:5], list(slots))

    def gr_step_graph(self, n, graphs, function, config, params, slots, values, p, out):
        self.calls.append(("build", list(graphs), params))
        if "build" in self.fail:
            return self.fail["build"]
        self._nodes(n, function, config, slots, values, p)
        out[0], out[1] = 501, 502
        for i in range(n):
            out[2 + i] = 600 + i
        return 0

    def gr_step_update(self, handles, n, function, config, params, slots, values, p):
        self.calls.append(("update", list(handles)))
        self._nodes(n, function, config, slots, values, p)
        return self.fail.get("update", 0)

    def gr_step_launch(self, exec_, stream):
        self.calls.append(("launch", exec_, stream))
        return self.fail.get("launch", 0)

    def gr_step_destroy(self, exec_, graph):
        self.calls.append(("destroy", exec_, graph))


def test_step_graph_is_built_once_then_relaunched_and_updated_only_when_the_launch_changes():
    driver = FakeDriver()
    graph = StepGraph([11, 12, 13], [(1, 2, 3), (4, 5, 6)], driver)
    launch = kernel_launch(launch_kernel(), (4,), ARGS)
    graph.run(launch, stream=77)
    assert driver.calls[0] == ("build", [11, 12, 13], ctypes.addressof(launch.params))
    assert driver.calls[1] == ("launch", 501, 77)
    assert driver.nodes[0][0] == 0xF00D and driver.nodes[0][1] == [4, 1, 1, 128, 2048]
    assert driver.nodes[0][2][:3] == [1, 2, 3] and driver.nodes[1][2][:3] == [4, 5, 6]    # each layer's pointers
    assert driver.nodes[1][2][3:] == list(launch.blob)[3:]
    driver.calls.clear()
    same = kernel_launch(launch_kernel(), (4,), ARGS)
    graph.run(same, stream=77)                     # the same launch: nothing to update
    assert driver.calls == [("launch", 501, 77)] and graph.updates == 0
    changed = kernel_launch(launch_kernel(), (6,), ARGS[:4] + (2,) + ARGS[5:])   # another grid and count
    driver.calls.clear()
    graph.run(changed, stream=78)
    assert driver.calls == [("update", [501, 502, 600, 601]), ("launch", 501, 78)] and graph.updates == 1
    assert driver.nodes[1][1][0] == 6 and struct.unpack("<i", struct.pack("<Q", driver.nodes[1][2][4])[:4])[0] == 2
    assert graph.runs == 3
    with pytest.raises(ValueError, match="segments"):
        StepGraph([11, 12], [(1, 2, 3), (4, 5, 6)], driver)


def test_step_graph_names_what_the_driver_refused_and_frees_what_it_built():
    launch = kernel_launch(fake_kernel(), (4,), ARGS)
    with pytest.raises(RuntimeError, match=r"instantiating it \(CUresult 700\)"):
        StepGraph([11, 12], [(1, 2, 3)], FakeDriver({"build": (3 << 16) | 700})).run(launch, 1)
    with pytest.raises(RuntimeError, match=r"launching it \(CUresult 1\)"):
        StepGraph([11, 12], [(1, 2, 3)], FakeDriver({"launch": (5 << 16) | 1})).run(launch, 1)
    driver = FakeDriver()
    graph = StepGraph([11, 12], [(1, 2, 3)], driver)
    graph.run(launch, 1)
    del graph
    gc.collect()
    assert driver.calls[-1] == ("destroy", 501, 502)


def test_step_graph_needs_kept_graphs_and_can_be_switched_off(monkeypatch):
    class Segment:
        def __init__(self, handle):
            self.handle = handle

        def raw_cuda_graph(self):
            return self.handle

    monkeypatch.setattr(step_graph, "library", lambda: FakeDriver())
    graph = step_graph.make_step_graph([Segment(1), Segment(2), Segment(3)], [(7, 8, 9), (4, 5, 6)])
    assert graph is not None and list(graph.graphs) == [1, 2, 3]
    assert step_graph.make_step_graph([Segment(1), object(), Segment(3)], [(7, 8, 9), (4, 5, 6)]) is None  # a fake
    assert step_graph.make_step_graph([Segment(1), Segment(0), Segment(3)], [(7, 8, 9), (4, 5, 6)]) is None  # not kept


@pytest.mark.parametrize("enabled", [True, False])
def test_a_capture_asks_for_a_step_graph_only_when_switched_on(monkeypatch, enabled):
    """CompilationConfig.step_graph reaches the capture: off, the graph replays from Python."""
    from tests.test_breakable_capture import FakeGraphForTests
    asked = []
    monkeypatch.setattr(breakable, "native_step_graph", lambda segments, breaks: asked.append(1) or "whole")
    with breakable.BreakableCapture(None, FakeGraphForTests, step_graph=enabled) as capture:
        pass
    assert bool(asked) == enabled
    assert capture.graph.step_graph == ("whole" if enabled else None)


@pytest.mark.parametrize("whole", ["whole", None], ids=["step-graph", "python-replay"])
def test_kept_segments_are_instantiated_at_capture_only_without_a_step_graph(monkeypatch, whole):
    """A graph with a step graph leaves its kept segments for their first Python replay (torch
    instantiates a kept graph there); one that replays them from Python every step has them
    instantiated when its capture ends."""
    from tests.test_breakable_capture import FakeGraphForTests, toy_forward

    class KeptFactory:
        def __call__(self):
            return FakeGraphForTests()

        def kept(self):
            graph = FakeGraphForTests()
            graph.kept, graph.instantiated = True, 0
            graph.instantiate = lambda: setattr(graph, "instantiated", graph.instantiated + 1)
            return graph

    monkeypatch.setattr(breakable, "native_step_graph", lambda segments, breaks: whole)
    with breakable.BreakableCapture(None, KeptFactory()) as capture:
        toy_forward(torch.ones(3), layers=2)
    segments = capture.graph.segments
    assert len(segments) == 3
    assert [segment.instantiated for segment in segments] == [0 if whole else 1] * 3


class Log:
    def __init__(self):
        self.events = []

    def segment(self, i):
        graph = SimpleNamespace(replay=lambda: self.events.append(f"seg{i}"))
        return graph

    def record(self, i, group) -> BreakRecord:
        """Break i, prepared with a replay that logs and a link into `group`'s step graph."""
        return BreakRecord(op=None, args=(), kwargs={}, replay=lambda: self.events.append(f"break{i}"),
                           step_graph=StepGraphLink(group, (i, i, i)))


def make_graph(log: Log, layers: int, bound, group=None) -> BreakableGraph:
    group = group or SimpleNamespace()
    segments = [log.segment(i) for i in range(layers + 1)]
    breaks = [log.record(i, group) for i in range(layers)]
    fake = SimpleNamespace(run=lambda launch, stream: log.events.append(("step graph", launch, stream)), runs=0)
    return BreakableGraph(segments, breaks, StepGraphReplay(fake, lambda: bound()))


def test_breakable_graph_launches_the_step_graph_when_the_step_offers_its_launch():
    log = Log()
    graph = make_graph(log, 3, lambda: ("launch", 5))
    graph.replay()
    assert log.events == [("step graph", "launch", 5)]


def test_breakable_graph_replays_from_python_when_the_step_cannot_take_the_step_graph():
    log = Log()
    graph = make_graph(log, 3, lambda: None)
    graph.replay()
    assert log.events == ["seg0", "break0", "seg1", "break1", "seg2", "break2", "seg3"]


def test_step_graph_is_offered_only_when_every_break_shares_one_group(monkeypatch):
    from runner.cudagraph import breakable
    log, group = Log(), SimpleNamespace(step_graph_binder=lambda replays: (lambda: None))
    monkeypatch.setattr(step_graph, "make_step_graph", lambda segments, patched: ("graph of", len(segments), patched))
    segments = [log.segment(i) for i in range(3)]
    same = [log.record(i, group) for i in range(2)]
    whole = breakable.native_step_graph(segments, same)
    assert whole.graph == ("graph of", 3, [(0, 0, 0), (1, 1, 1)]) and whole.bind() is None
    other = SimpleNamespace(step_graph_binder=group.step_graph_binder)
    assert breakable.native_step_graph(segments, [same[0], log.record(1, other)]) is None
    assert breakable.native_step_graph(segments, [BreakRecord(None, (), {}, None), same[1]]) is None
    refusing = SimpleNamespace(step_graph_binder=lambda replays: None)
    refused = [log.record(i, refusing) for i in range(2)]
    assert breakable.native_step_graph(segments, refused) is None


@pytest.mark.parametrize("how", ["launched", "planned"])
def test_step_attention_offers_its_bound_launch_in_driver_form_once_per_step(monkeypatch, how):
    """Bound by a launch (`call_keyed`) or without one (`bind_without_launch`, the step graph's way:
    the compiled kernel looked up, nothing launched), the step's launch in driver form has the
    planned grid and arguments, pointers as addresses, the patched three as 0."""
    from attention.kernels import unified_attention as ua
    from tests.test_triton_kernels import make_batch

    launched, compiled = [], {"kernel": "compiled kernel"}

    class FakeLaunch:
        def __call__(self, grid, *args, **options):
            launched.append(grid)
            return "compiled kernel"

        def compiled_kernel(self, args, **options):
            return compiled["kernel"]

        def stream_of(self, device_index):
            return 99

        def direct_launch(self, kernel, grid, stream):
            return None

    made = []
    monkeypatch.setattr(ua, "_attention_launch", FakeLaunch())
    monkeypatch.setattr(ua, "kernel_launch", lambda kernel, grid, args: made.append((kernel, grid, args)) or "driver form")
    b = make_batch([1, 1], [5, 17], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    step = ua.StepAttention(b.query_start_loc, b.seq_lens, b.block_table, max_seq_len=17)
    key = ua.interned_layer_key(b.query, b.kv_cache, b.query, b.scale)
    assert step.native_launch(key) is None                       # nothing bound yet
    out = torch.empty_like(b.query)
    if how == "launched":
        step.call_keyed(key, b.query, b.kv_cache, out, b.scale)
        assert len(launched) == 1
    else:
        compiled["kernel"] = None
        assert not step.bind_without_launch(key, b.query, b.kv_cache, out, b.scale)   # not compiled yet
        compiled["kernel"] = "compiled kernel"
        assert step.bind_without_launch(key, b.query, b.kv_cache, out, b.scale)
        assert step.bind_without_launch(key, b.query, b.kv_cache, out, b.scale)       # bound: same key
        assert not step.bind_without_launch(("another key",), b.query, b.kv_cache, out, b.scale)
        assert not launched
    assert step.native_launch(key) == ("driver form", 99)
    assert step.native_launch(key) == ("driver form", 99) and len(made) == 1
    kernel, grid, args = made[0]
    want = ua._plan(b.query, b.kv_cache, out, b.query_start_loc, b.seq_lens, b.block_table, b.scale, None, 17)
    assert kernel == "compiled kernel" and grid == want.grid and args[:3] == (0, 0, 0)
    assert args[3:] == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in want.args[3:])
    assert step.native_launch(("another key",)) is None


def test_triton_backend_plans_the_step_graphs_launch_only_for_what_was_captured(monkeypatch):
    from attention.backends import triton_paged
    from attention.forward_context import ForwardContext, set_forward_context
    from configs import CUDAGraphMode

    planned = []

    class FakeStepAttention:
        compiled = True

        def __init__(self, *args):
            self.bound = None

        def bind_without_launch(self, key, query, kv_cache, out, scale):
            planned.append((key, query is q, kv_cache is caches[0], out is out_, scale))
            if FakeStepAttention.compiled:
                self.bound = key
            return FakeStepAttention.compiled

        def native_launch(self, key):
            return ("launch", 5) if key is self.bound else None

    monkeypatch.setattr(triton_paged, "StepAttention", FakeStepAttention)
    backend = triton_paged.TritonPagedBackend()
    caches = [torch.zeros(2, 3, 4, 2, 8) for _ in range(3)]
    q, out_ = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)
    prepared = [backend.prepare_replay(SimpleNamespace(scale=0.5, cache_index=i), q, None, None, out_, caches[i])
                for i in range(3)]
    assert all(p.step_graph.group is backend for p in prepared)
    assert prepared[1].step_graph.patched == (q.data_ptr(), caches[1].data_ptr(), out_.data_ptr())
    replays = [p.replay for p in prepared]
    bind = backend.step_graph_binder(replays)

    def metadata():
        return SimpleNamespace(query_start_loc=None, seq_lens=None, block_table=None, max_seq_len=9, max_query_len=1)

    with set_forward_context(ForwardContext(metadata(), caches, backend, CUDAGraphMode.PIECEWISE)):
        assert bind() == ("launch", 5)          # planned on the first break's recorded tensors
    assert planned == [(replays[0].key, True, True, True, 0.5)]
    FakeStepAttention.compiled = False
    with set_forward_context(ForwardContext(metadata(), caches, backend, CUDAGraphMode.PIECEWISE)):
        assert bind() is None                   # no compiled kernel for this step's launch
    FakeStepAttention.compiled = True
    with set_forward_context(ForwardContext(metadata(), [caches[0], caches[1].clone(), caches[2]], backend,
                                            CUDAGraphMode.PIECEWISE)):
        assert bind() is None                   # another KV cache than the one captured
    with set_forward_context(ForwardContext(metadata(), caches, backend, CUDAGraphMode.FULL)):
        assert bind() is None
    assert len(planned) == 2                    # neither of the last two got as far as planning
    other = backend.prepare_replay(SimpleNamespace(scale=0.25, cache_index=0), q, None, None, out_, caches[0]).replay
    assert backend.step_graph_binder([replays[0], other]) is None   # layers with different launches


def test_the_c_library_compiles(tmp_path):
    include, cc = step_graph.cuda_header_dir(), native_build.compiler()
    if include is None or cc is None:
        pytest.skip("no cuda.h from Triton or no C compiler here")
    built = step_graph.build_library(include, cc, tmp_path)
    assert step_graph.build_library(include, cc, tmp_path) == built        # cached by source hash
    lib = ctypes.CDLL(str(built))
    for name in ("gr_init", "gr_step_graph", "gr_step_update", "gr_step_launch", "gr_step_destroy"):
        assert hasattr(lib, name), name
