"""The PIECEWISE layer loop in C, on a CPU: the driver form of a launch (parameter layout, config,
refusals), StepAttention's and the Triton backend's parts of the per-step binding, BreakableGraph's
hand-over to the loop and its fallback, the loop's arguments and errors (a FAKE C function records
them), and that the C source compiles. A GPU test (tests/test_triton_gpu.py) runs the real loop
against Triton's launches bit for bit."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace

import pytest
import torch

from attention.kernels.driver_launch import kernel_launch
from runner.cudagraph import native_loop
from runner.cudagraph.breakable import BreakableGraph, BreakRecord
from runner.cudagraph.native_loop import LayerLoop

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
    assert list(launch.config) == [5, 2, 1, 128, 2048, 1, 0, 0]    # grid, 32 * warps, shared, PDL, not cooperative
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


class FakeLoopFunction:
    """Stands in for the C `gr_layer_loop`: records what it is given, returns `status`."""

    def __init__(self, status: int = 0) -> None:
        self.status, self.calls = status, []

    def __call__(self, n, graphs, stream, function, config, params, slots, values, p):
        self.calls.append(dict(n=n, graphs=list(graphs), stream=stream, function=function, config=list(config),
                               params=params, slots=slots, values=list(values)[:n * p], p=p))
        return self.status


def test_layer_loop_passes_the_segments_the_launch_and_each_layers_pointers():
    launch = kernel_launch(fake_kernel(), (4,), ARGS)
    run = FakeLoopFunction()
    loop = LayerLoop([11, 12, 13], [(1, 2, 3), (4, 5, 6)], run)
    loop.run(launch, stream=77)
    (call,) = run.calls
    assert call["n"] == 2 and call["graphs"] == [11, 12, 13] and call["stream"] == 77
    assert call["function"] == 0xF00D and call["config"][:5] == [4, 1, 1, 128, 2048]
    assert call["params"] == ctypes.addressof(launch.params) and call["slots"] is launch.blob
    assert call["values"] == [1, 2, 3, 4, 5, 6] and call["p"] == 3
    assert loop.runs == 1
    with pytest.raises(ValueError, match="segments"):
        LayerLoop([11, 12], [(1, 2, 3), (4, 5, 6)], run)


def test_layer_loop_names_what_the_driver_refused():
    launch = kernel_launch(fake_kernel(), (4,), ARGS)
    with pytest.raises(RuntimeError, match=r"attention launch of break 2 \(CUresult 700\)"):
        LayerLoop([11, 12, 13], [(1, 2, 3), (4, 5, 6)], FakeLoopFunction((4 << 16) | 700)).run(launch, 1)
    with pytest.raises(RuntimeError, match=r"segment 2 \(CUresult 1\)"):
        LayerLoop([11, 12, 13], [(1, 2, 3), (4, 5, 6)], FakeLoopFunction((3 << 16) | 1)).run(launch, 1)


def test_layer_loop_needs_exec_handles_and_can_be_switched_off(monkeypatch):
    class Segment:
        def __init__(self, handle):
            self.handle = handle

        def raw_cuda_graph_exec(self):
            return self.handle

    monkeypatch.setattr(native_loop, "library", lambda: SimpleNamespace(gr_layer_loop=FakeLoopFunction()))
    loop = native_loop.layer_loop([Segment(1), Segment(2), Segment(3)], [(7, 8, 9)])
    assert loop is not None and list(loop.execs) == [2, 3]     # the first segment is replayed from Python
    assert native_loop.layer_loop([Segment(1), object(), Segment(3)], [(7, 8, 9)]) is None   # a fake graph
    monkeypatch.setattr(native_loop, "ENABLED", False)
    assert native_loop.layer_loop([Segment(1), Segment(2), Segment(3)], [(7, 8, 9)]) is None


class Log:
    def __init__(self):
        self.events = []

    def segment(self, i):
        graph = SimpleNamespace(replay=lambda: self.events.append(f"seg{i}"))
        return graph

    def replay(self, i, group):
        def call():
            self.events.append(f"break{i}")
        call.loop_group, call.patched = group, (i, i, i)
        return call


def make_graph(log: Log, layers: int, bound, group=None) -> BreakableGraph:
    group = group or SimpleNamespace()
    segments = [log.segment(i) for i in range(layers + 1)]
    breaks = [BreakRecord(op=None, args=(), kwargs={}, replay=log.replay(i, group)) for i in range(layers)]
    loop = SimpleNamespace(run=lambda launch, stream: log.events.append(("loop", launch, stream)))
    return BreakableGraph(segments, breaks, (loop, lambda: bound()))


def test_breakable_graph_hands_the_layers_after_the_first_to_the_loop():
    log = Log()
    graph = make_graph(log, 3, lambda: ("launch", 5))
    graph.replay()
    assert log.events == ["seg0", "break0", ("loop", "launch", 5)]


def test_breakable_graph_replays_from_python_when_the_step_cannot_take_the_loop():
    log = Log()
    graph = make_graph(log, 3, lambda: None)
    graph.replay()
    assert log.events == ["seg0", "break0", "seg1", "break1", "seg2", "break2", "seg3"]


def test_layer_loop_is_offered_only_when_every_break_shares_one_group(monkeypatch):
    from runner.cudagraph import breakable
    log, group = Log(), SimpleNamespace(loop_binder=lambda replays: (lambda: None))
    monkeypatch.setattr(native_loop, "layer_loop", lambda segments, patched: ("loop over", len(segments), patched))
    segments = [log.segment(i) for i in range(3)]
    same = [BreakRecord(None, (), {}, log.replay(i, group)) for i in range(2)]
    loop, bind = breakable.layer_loop(segments, same)
    assert loop == ("loop over", 3, [(1, 1, 1)]) and bind() is None
    mixed = [same[0], BreakRecord(None, (), {}, log.replay(1, SimpleNamespace(loop_binder=group.loop_binder)))]
    assert breakable.layer_loop(segments, mixed) is None
    generic = [BreakRecord(None, (), {}, None), same[1]]
    assert breakable.layer_loop(segments, generic) is None
    refusing = SimpleNamespace(loop_binder=lambda replays: None)
    assert breakable.layer_loop(segments, [BreakRecord(None, (), {}, log.replay(i, refusing)) for i in range(2)]) is None


def test_step_attention_offers_its_bound_launch_in_driver_form_once_per_step(monkeypatch):
    from attention.kernels import unified_attention as ua
    from tests.test_triton_kernels import make_batch

    class FakeLaunch:
        def __call__(self, grid, *args, **options):
            return "compiled kernel"

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
    step.call_keyed(key, b.query, b.kv_cache, out, b.scale)
    assert step.native_launch(key) == ("driver form", 99)
    assert step.native_launch(key) == ("driver form", 99) and len(made) == 1
    kernel, grid, args = made[0]
    want = ua._plan(b.query, b.kv_cache, out, b.query_start_loc, b.seq_lens, b.block_table, b.scale, None, 17)
    assert kernel == "compiled kernel" and grid == want.grid and args[:3] == (0, 0, 0)
    assert args[3:] == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in want.args[3:])
    assert step.native_launch(("another key",)) is None


def test_triton_backend_binds_the_loop_only_for_the_step_it_was_captured_for(monkeypatch):
    from attention.backends import triton_paged
    from attention.forward_context import ForwardContext, set_forward_context
    from configs import CUDAGraphMode

    class FakeStepAttention:
        def __init__(self, *args):
            self.bound = None

        def call_addressed(self, key, addresses, query, kv_cache, out, scale):
            self.bound = key

        def native_launch(self, key):
            return ("launch", 5) if key is self.bound else None

    monkeypatch.setattr(triton_paged, "StepAttention", FakeStepAttention)
    backend = triton_paged.TritonPagedBackend()
    caches = [torch.zeros(2, 3, 4, 2, 8) for _ in range(3)]
    q, out = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)
    replays = [backend.prepare_replay(SimpleNamespace(scale=0.5, cache_index=i), q, None, None, out, caches[i])
               for i in range(3)]
    assert all(r.loop_group is backend for r in replays)
    assert replays[1].patched == (q.data_ptr(), caches[1].data_ptr(), out.data_ptr())
    bind = backend.loop_binder(replays)

    def metadata():
        return SimpleNamespace(query_start_loc=None, seq_lens=None, block_table=None, max_seq_len=9)

    with set_forward_context(ForwardContext(metadata(), caches, backend, CUDAGraphMode.PIECEWISE)):
        assert bind() is None                  # no StepAttention for this step yet
        replays[0]()                           # the first break binds it
        assert bind() == ("launch", 5)
    with set_forward_context(ForwardContext(metadata(), caches, backend, CUDAGraphMode.PIECEWISE)):
        assert bind() is None                  # a new step: the old step's launch is not offered
    with set_forward_context(ForwardContext(metadata(), [caches[0], caches[1].clone(), caches[2]], backend,
                                            CUDAGraphMode.PIECEWISE)):
        replays[0]()
        assert bind() is None                  # another KV cache than the one captured
    with set_forward_context(ForwardContext(metadata(), caches, backend, CUDAGraphMode.FULL)):
        assert bind() is None
    other = backend.prepare_replay(SimpleNamespace(scale=0.25, cache_index=0), q, None, None, out, caches[0])
    assert backend.loop_binder([replays[0], other]) is None   # layers with different launches


def test_the_c_loop_compiles(tmp_path):
    include, cc = native_loop.cuda_header_dir(), native_loop.compiler()
    if include is None or cc is None:
        pytest.skip("no cuda.h from Triton or no C compiler here")
    built = native_loop.build(include, cc, tmp_path)
    assert native_loop.build(include, cc, tmp_path) == built        # cached by source hash
    lib = ctypes.CDLL(str(built))
    assert hasattr(lib, "gr_init") and hasattr(lib, "gr_layer_loop")

