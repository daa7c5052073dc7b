"""Breakable capture, the graph wrappers and the capture phase, on a CPU with a FAKE graph.

`FakeGraphForTests` stands in for torch.cuda.CUDAGraph: while it captures, the toy ops'
"kernels" (thunks handed to `launch`) are recorded, not run, as a stream capture records
kernels without running them; `replay()` runs the recorded thunks. That makes the replay
order and the values checkable without a GPU.
"""

from __future__ import annotations

import gc
import logging
import re
from dataclasses import dataclass

import pytest
import torch
from torch.overrides import TorchFunctionMode

from attention.forward_context import ForwardContext, get_forward_context, set_forward_context
from configs.graph_mode import CUDAGraphMode as M
from launch.break_point import PreparedBreak
from runner.cudagraph import (AddressCheck, AddressMismatchError, BatchDescriptor as BD, BreakableCapture, CapturePhase,
                              CUDAGraphWrapper, active_capture, break_point, capture_all, measure_graph_memory)

EVENTS: list[tuple] = []


class FakeGraphForTests:
    capturing: "FakeGraphForTests | None" = None
    count = 0

    def __init__(self) -> None:
        FakeGraphForTests.count += 1
        self.id, self.thunks, self.pool = FakeGraphForTests.count, [], "unset"

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:
        if FakeGraphForTests.capturing is not None:
            raise RuntimeError("fake graphs cannot nest either")
        self.pool, self.capture_error_mode, FakeGraphForTests.capturing = pool, capture_error_mode, self
        self.mode = _RecordCopies()
        self.mode.__enter__()
        EVENTS.append(("begin", self.id))

    def capture_end(self) -> None:
        FakeGraphForTests.capturing = None
        self.mode.__exit__(None, None, None)
        EVENTS.append(("end", self.id))

    def replay(self) -> None:
        EVENTS.append(("replay", self.id))
        for thunk in self.thunks:
            thunk()


class _RecordCopies(TorchFunctionMode):
    """While a fake graph captures, `Tensor.copy_` (the FULL wrapper's copy into its persistent
    output) is recorded into it rather than run, like every other captured kernel."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        graph = FakeGraphForTests.capturing
        if func is torch.Tensor.copy_ and graph is not None:
            graph.thunks.append(lambda: func(*args, **kwargs))
            return args[0]
        return func(*args, **kwargs)


def launch(thunk) -> None:
    """A toy 'kernel': recorded into the fake graph being captured, else run now."""
    graph = FakeGraphForTests.capturing
    graph.thunks.append(thunk) if graph is not None else thunk()


@pytest.fixture(autouse=True)
def _clean():
    EVENTS.clear()
    FakeGraphForTests.capturing = None
    yield
    assert active_capture() is None and FakeGraphForTests.capturing is None


SCALE = {"value": torch.tensor(2.0)}  # a global "context" the break op reads when it runs


def _scale() -> torch.Tensor:
    try:
        return get_forward_context().attn_metadata.scale
    except RuntimeError:  # no forward context: the breakable-capture tests
        return SCALE["value"]


@break_point
def toy_attention(x: torch.Tensor, *, out: torch.Tensor) -> None:
    EVENTS.append(("attention",))
    scale = _scale()
    launch(lambda: torch.mul(x, scale, out=out))


def toy_forward(x: torch.Tensor, layers: int = 1) -> torch.Tensor:
    """(x * 3) -> attention (* scale) -> (+ 1), `layers` times; every op writes a buffer
    allocated here, by Python, as a captured graph's allocations happen at capture."""
    for _ in range(layers):
        h = torch.empty_like(x)
        launch(lambda x=x, h=h: torch.mul(x, 3.0, out=h))
        a = torch.empty_like(h)
        toy_attention(h, out=a)
        x = torch.empty_like(a)
        launch(lambda a=a, y=x: torch.add(a, 1.0, out=y))
    return x


def expected(x, scale, layers=1):
    for _ in range(layers):
        x = x * 3.0 * scale + 1.0
    return x


# ---- breakable capture ---------------------------------------------------------------------
def test_segments_breaks_and_replay_order():
    x = torch.randn(3, 4)
    with BreakableCapture(pool="pool-1", graph_factory=FakeGraphForTests) as capture:
        y = toy_forward(x, layers=2)
    graph = capture.graph
    assert len(graph.segments) == 3 and len(graph.breaks) == 2  # segments = breaks + 1
    assert {s.pool for s in graph.segments} == {"pool-1"}  # one shared pool
    ids = [s.id for s in graph.segments]
    assert EVENTS == [("begin", ids[0]), ("end", ids[0]), ("attention",), ("begin", ids[1]), ("end", ids[1]),
                      ("attention",), ("begin", ids[2]), ("end", ids[2])]  # break ops ran eagerly at capture
    EVENTS.clear()
    x.copy_(torch.randn(3, 4))  # new input into the static buffer, new context value
    SCALE["value"] = torch.tensor(5.0)
    try:
        graph.replay()
    finally:
        SCALE["value"] = torch.tensor(2.0)
    assert EVENTS == [("replay", ids[0]), ("attention",), ("replay", ids[1]), ("attention",), ("replay", ids[2])]
    torch.testing.assert_close(y, expected(x, 5.0, layers=2))  # break ops read the CURRENT context


def test_nesting_raises_and_state_recovers():
    with BreakableCapture(None, FakeGraphForTests):
        with pytest.raises(RuntimeError, match="already active"):
            with BreakableCapture(None, FakeGraphForTests):
                pass
    with BreakableCapture(None, FakeGraphForTests) as capture:  # usable again
        toy_forward(torch.ones(2, 2))
    assert len(capture.graph.segments) == 2


def test_fresh_tensor_output_raises_at_capture():
    @break_point
    def bad_attention(x, *, out):
        return x * 2

    with pytest.raises(RuntimeError, match="bad_attention returned a fresh tensor"):
        with BreakableCapture(None, FakeGraphForTests):
            bad_attention(torch.ones(2), out=torch.empty(2))
    assert torch.equal(bad_attention(torch.ones(2), out=torch.empty(2)), torch.full((2,), 2.0))  # eager: fine


def test_out_positional_and_returning_out_are_accepted():
    @break_point
    def positional(x, out):
        out.copy_(x)
        return out

    @break_point
    def no_out(x, scale):
        return None

    with BreakableCapture(None, FakeGraphForTests) as capture:
        o = torch.empty(2)
        assert positional(torch.ones(2), o) is o
    assert len(capture.graph.breaks) == 1 and capture.graph.breaks[0].args[1] is o
    with pytest.raises(RuntimeError, match="no caller-provided out"):
        with BreakableCapture(None, FakeGraphForTests):
            no_out(torch.ones(2), 3)


def test_prepare_replay_is_asked_once_at_capture_and_its_replay_runs_instead():
    """A break point's `prepare_replay` gets the recorded inputs at capture; replays call the replay
    of the PreparedBreak it returned (None: the op itself)."""
    prepared, replays = [], []

    def scaled(x, *, out):
        EVENTS.append(("op",))
        launch(lambda: torch.mul(x, 2.0, out=out))

    def prepare(x, *, out):
        prepared.append((x, out))
        return PreparedBreak(lambda: replays.append("fast")) if len(prepared) == 1 else None

    op = break_point(scaled, prepare_replay=prepare)
    with BreakableCapture(None, FakeGraphForTests) as capture:
        a, b = torch.empty(2), torch.empty(2)
        op(torch.ones(2), out=a)
        op(torch.ones(2), out=b)
    assert [o for _, o in prepared] == [a, b] and capture.graph.breaks[0].replay is not None
    EVENTS.clear()
    capture.graph.replay()
    assert replays == ["fast"] and EVENTS.count(("op",)) == 1   # the second break: the op itself
    torch.testing.assert_close(b, torch.full((2,), 2.0))


def test_break_point_outside_capture_just_runs():
    a = torch.empty(2)
    assert toy_attention(torch.ones(2), out=a) is None
    assert EVENTS == [("attention",)] and torch.equal(a, torch.full((2,), 2.0))


def test_error_inside_capture_ends_the_segment():
    with pytest.raises(ValueError, match="boom"):
        with BreakableCapture(None, FakeGraphForTests):
            raise ValueError("boom")
    assert EVENTS[-1][0] == "end"


# ---- the wrappers --------------------------------------------------------------------------
@dataclass
class ToyMetadata:
    scale: torch.Tensor


CALLS = {"forward": 0}


def counted_forward(x: torch.Tensor) -> torch.Tensor:
    CALLS["forward"] += 1
    return toy_forward(x)


def _context(mode, desc, scale=2.0, metadata=None):
    return ForwardContext(metadata or ToyMetadata(torch.tensor(scale)), None, None, mode, desc)


def _wrappers(address_check=False):
    phase = CapturePhase()
    piecewise = CUDAGraphWrapper(counted_forward, M.PIECEWISE, "pool", phase, address_check, FakeGraphForTests)
    full = CUDAGraphWrapper(piecewise, M.FULL, "pool", phase, address_check, FakeGraphForTests)
    return phase, piecewise, full


def test_pass_through_when_mode_differs_or_no_descriptor():
    phase, piecewise, full = _wrappers()
    x = torch.ones(2, 3)
    for ctx in (_context(M.NONE, None), _context(M.PIECEWISE, None), _context(M.NONE, BD(2, 0, False))):
        with set_forward_context(ctx):
            torch.testing.assert_close(full(x), expected(x, 2.0))
    assert piecewise.num_captured == full.num_captured == 0 and EVENTS.count(("attention",)) == 3


def test_piecewise_capture_in_phase_then_replay():
    phase, piecewise, full = _wrappers()
    x, desc = torch.randn(4, 3), BD(4, 0, False)
    with phase.capturing(), set_forward_context(_context(M.PIECEWISE, desc)):
        y = full(x)
    torch.testing.assert_close(y, expected(x, 2.0))  # the capturing call returns real values
    assert (piecewise.num_captured, full.num_captured, piecewise.num_replays) == (1, 0, 0)
    assert CALLS["forward"] >= 2  # warm-up + capture
    calls = CALLS["forward"]
    for scale in (3.0, 0.5):
        x.copy_(torch.randn(4, 3))
        with set_forward_context(_context(M.PIECEWISE, desc, scale)):  # new metadata object each step
            y2 = full(x)
        assert y2 is y
        torch.testing.assert_close(y2, expected(x, scale))
    assert CALLS["forward"] == calls  # no Python forward: replayed
    assert piecewise.num_replays == 2 and piecewise.replays_by_descriptor == {desc: 2}


def test_full_capture_does_not_break_and_replays():
    phase, piecewise, full = _wrappers()
    x, desc = torch.randn(2, 3), BD(2, 2, True)
    metadata = ToyMetadata(torch.tensor(2.0))
    with phase.capturing(), set_forward_context(_context(M.FULL, desc, metadata=metadata)):
        y = full(x)
    torch.testing.assert_close(y, expected(x, 2.0))
    assert (full.num_captured, piecewise.num_captured) == (1, 0)
    begins = [e for e in EVENTS if e[0] == "begin"]
    assert len(begins) == 1  # attention did not break the FULL capture
    x.copy_(torch.randn(2, 3))
    metadata.scale.fill_(4.0)  # FULL graphs read metadata at its captured address
    with set_forward_context(_context(M.FULL, desc, metadata=metadata)):
        y2 = full(x)
    assert y2 is y and full.num_replays == 1 and full.replays_by_descriptor[desc] == 1
    torch.testing.assert_close(y2, expected(x, 4.0))


def test_capture_outside_phase_raises():
    _, _, full = _wrappers()
    with set_forward_context(_context(M.FULL, BD(2, 2, True))):
        with pytest.raises(RuntimeError, match="capture outside the capture phase"):
            full(torch.ones(2, 3))


def test_address_check_catches_moved_kwarg_and_metadata():
    phase = CapturePhase()
    wrapper = CUDAGraphWrapper(lambda *, x: toy_forward(x), M.PIECEWISE, None, phase, True, FakeGraphForTests)
    x, desc = torch.ones(2, 3), BD(2, 0, False)
    with phase.capturing(), set_forward_context(_context(M.PIECEWISE, desc)):
        wrapper(x=x)
    with set_forward_context(_context(M.PIECEWISE, desc, 7.0)):
        wrapper(x=x)  # same buffer, new metadata: fine for PIECEWISE
        with pytest.raises(AddressMismatchError, match=r"kwargs\[x\]"):
            wrapper(x=x.clone())
    full_phase, _, full = _wrappers(address_check=True)
    with full_phase.capturing(), set_forward_context(_context(M.FULL, BD(2, 2, True))):
        full(x)
    with set_forward_context(_context(M.FULL, BD(2, 2, True))):  # a new scale tensor: moved
        with pytest.raises(AddressMismatchError, match=r"attn_metadata\.scale"):
            full(x)


def _captured_full(address_check, sizes=(2, 1)):
    """A FULL wrapper with one captured graph per size; returns it and each size's inputs."""
    phase = CapturePhase()
    kwargs = {} if address_check is None else {"address_check": address_check}
    wrapper = CUDAGraphWrapper(counted_forward, M.FULL, None, phase, graph_factory=FakeGraphForTests, **kwargs)
    inputs = {}
    with phase.capturing():
        for n in sizes:
            x, metadata = torch.ones(n, 3), ToyMetadata(torch.tensor(2.0))
            with set_forward_context(_context(M.FULL, BD(n, n, True), metadata=metadata)):
                wrapper(x)
            inputs[n] = x, metadata
    return wrapper, inputs


def _replay(wrapper, n, x, metadata):
    with set_forward_context(_context(M.FULL, BD(n, n, True), metadata=metadata)):
        return wrapper(x)


def test_address_check_runs_by_default_on_each_graphs_first_replay_only():
    wrapper, inputs = _captured_full(None)
    assert wrapper.address_check is AddressCheck.FIRST_REPLAY and wrapper.address_record_seconds > 0
    x2, metadata2 = inputs[2]
    moved = ToyMetadata(torch.tensor(2.0))
    with pytest.raises(AddressMismatchError, match=r"FULL graph replay of .*num_tokens=2.*\n.*changed:\n"
                                                   r"  attn_metadata\.scale: 0x[0-9a-f]+ -> 0x[0-9a-f]+"):
        _replay(wrapper, 2, x2, moved)
    assert wrapper.num_replays == 0  # the moved input was refused, not replayed
    _replay(wrapper, 2, x2, metadata2)  # the first replay at the captured addresses: checked, passes
    assert (wrapper.first_replay_checks, wrapper.num_replays) == (1, 1)
    checked = wrapper.first_replay_check_seconds
    _replay(wrapper, 2, x2, moved)  # later replays of that graph are not checked: serving pays nothing
    assert wrapper.first_replay_check_seconds == checked and wrapper.num_replays == 2
    x1, _ = inputs[1]
    with pytest.raises(AddressMismatchError, match=r"num_tokens=1.*\n.*changed:\n  args\[0\]"):
        _replay(wrapper, 1, x1.clone(), inputs[1][1])  # the other graph's first replay is still checked


def test_debug_address_check_checks_every_replay():
    wrapper, inputs = _captured_full(True, sizes=(2,))
    assert wrapper.address_check is AddressCheck.EVERY_REPLAY
    for _ in range(3):
        _replay(wrapper, 2, *inputs[2])
    with pytest.raises(AddressMismatchError, match=r"attn_metadata\.scale"):
        _replay(wrapper, 2, inputs[2][0], ToyMetadata(torch.tensor(2.0)))
    assert wrapper.first_replay_checks == 0  # "first replay" bookkeeping is for FIRST_REPLAY only


def test_address_check_off_never_checks():
    wrapper, inputs = _captured_full(AddressCheck.OFF, sizes=(2,))
    _replay(wrapper, 2, inputs[2][0].clone(), ToyMetadata(torch.tensor(2.0)))
    assert wrapper.address_check_seconds == 0 and wrapper.num_replays == 1


def test_first_replay_checks_report_their_cost_once_all_graphs_passed(caplog):
    wrapper, inputs = _captured_full(None)
    with caplog.at_level(logging.INFO, logger="runner.cudagraph.wrapper"):
        _replay(wrapper, 2, *inputs[2])
        assert "cudagraph address check" not in caplog.text  # one graph still unchecked
        _replay(wrapper, 1, *inputs[1])
        _replay(wrapper, 1, *inputs[1])
    lines = [r.getMessage() for r in caplog.records if "cudagraph address check" in r.getMessage()]
    assert len(lines) == 1
    assert re.search(r"all 2 FULL graphs replayed at their captured addresses; recording them at capture took "
                     r"\d+\.\d+ s, their first-replay checks \d+\.\d+ s", lines[0])
    assert wrapper.address_check_seconds == wrapper.address_record_seconds + wrapper.first_replay_check_seconds > 0


@pytest.mark.parametrize("check, debug, expected", [
    (True, False, AddressCheck.FIRST_REPLAY),
    (True, True, AddressCheck.EVERY_REPLAY),
    (False, True, AddressCheck.EVERY_REPLAY),
    (False, False, AddressCheck.OFF),
])
def test_address_check_mode_from_the_config(check, debug, expected):
    from configs import EngineConfig
    config = EngineConfig.from_kwargs(model="x", check_cudagraph_addresses=check, debug_cudagraph_addresses=debug)
    compilation = config.compilation
    assert AddressCheck.from_config(compilation.check_cudagraph_addresses,
                                    compilation.debug_cudagraph_addresses) is expected
    assert EngineConfig.from_kwargs(model="x").compilation.check_cudagraph_addresses is True


def test_full_output_is_persistent_for_dataclass_outputs():
    @dataclass
    class Pair:
        hidden: torch.Tensor
        residual: torch.Tensor

    phase = CapturePhase()
    wrapper = CUDAGraphWrapper(lambda x: Pair(toy_forward(x), x * 1), M.FULL, None, phase, False, FakeGraphForTests)
    x = torch.randn(2, 2)
    with phase.capturing(), set_forward_context(_context(M.FULL, BD(2, 2, True))):
        out = wrapper(x)
    assert isinstance(out, Pair)
    torch.testing.assert_close(out.hidden, expected(x, 2.0))


def test_full_output_pool_fields_stay_in_the_graph_and_are_not_copied():
    """A dataclass's `pool_fields` (a decode step's logits) are returned as the graph's own tensor,
    updated by each replay, while the other fields are copied into the shared buffers; graphs of
    outputs with and without pool fields share the buffers that match."""
    @dataclass
    class Decoded:
        hidden: torch.Tensor
        logits: torch.Tensor
        pool_fields = ("logits",)

    def forward(x):
        hidden = toy_forward(x)
        if x.shape[0] == 1:   # "uniform decode": the logits too
            logits = torch.empty(1, 5)
            launch(lambda: torch.mul(hidden.sum(dim=1, keepdim=True), torch.ones(1, 5), out=logits))
            return Decoded(hidden, logits)
        return Decoded(hidden, None)

    phase = CapturePhase()
    wrapper = CUDAGraphWrapper(forward, M.FULL, None, phase, False, FakeGraphForTests)
    x2, x1 = torch.randn(2, 2), torch.randn(1, 2)
    with phase.capturing():
        with set_forward_context(_context(M.FULL, BD(2, 2, False))):
            out2 = wrapper(x2)
        with set_forward_context(_context(M.FULL, BD(1, 1, True))):
            out1 = wrapper(x1)
    assert out2.logits is None
    assert out1.hidden.data_ptr() == out2.hidden.data_ptr()   # one shared buffer for hidden
    copies_before = len(wrapper._shared_output)
    x1.copy_(torch.randn(1, 2))
    with set_forward_context(_context(M.FULL, BD(1, 1, True))):
        again = wrapper(x1)
    assert again.logits.data_ptr() == out1.logits.data_ptr() and len(wrapper._shared_output) == copies_before
    torch.testing.assert_close(again.hidden, expected(x1, 2.0))
    torch.testing.assert_close(again.logits, expected(x1, 2.0).sum(dim=1, keepdim=True).expand(1, 5))


def test_full_graphs_of_one_wrapper_share_their_output_buffers():
    """Largest first: every later graph's output is a view [:rows] of the first one's buffers, so
    the graphs together hold one output, not one each; a larger later output grows the buffers."""
    phase = CapturePhase()
    wrapper = CUDAGraphWrapper(lambda x: (toy_forward(x), x * 1), M.FULL, None, phase, False, FakeGraphForTests)
    outs = {}
    with phase.capturing():
        for rows in (4, 2, 1, 8):
            x = torch.randn(rows, 3)
            with set_forward_context(_context(M.FULL, BD(rows, rows, True))):
                outs[rows] = wrapper(x)
            torch.testing.assert_close(outs[rows][0], expected(x, 2.0))
            torch.testing.assert_close(outs[rows][1], x)
    base = outs[4][0].data_ptr(), outs[4][1].data_ptr()
    assert all((outs[n][0].data_ptr(), outs[n][1].data_ptr()) == base for n in (2, 1))
    assert [o.shape[0] for o in outs[2]] == [2, 2] and outs[8][0].data_ptr() != base[0]
    assert wrapper.warm_ups == 2   # the first capture, and 8's, whose output outgrew the buffers


def _capture_sizes(mode, sizes, **kwargs):
    """A wrapper of `mode` that captured one graph per size (in order); the graphs' capture modes."""
    phase = CapturePhase()
    wrapper = CUDAGraphWrapper(counted_forward, mode, None, phase, False, FakeGraphForTests, **kwargs)
    begun = len(EVENTS)
    with phase.capturing():
        for rows in sizes:
            x = torch.randn(rows, 3)
            with set_forward_context(_context(mode, BD(rows, rows if mode == M.FULL else 0, mode == M.FULL))):
                torch.testing.assert_close(wrapper(x), expected(x, 2.0))
            for _ in range(2):   # replays compute with the step's inputs
                x.copy_(torch.randn(rows, 3))
                with set_forward_context(_context(mode, BD(rows, rows if mode == M.FULL else 0, mode == M.FULL))):
                    torch.testing.assert_close(wrapper(x), expected(x, 2.0))
    return wrapper, [e for e in EVENTS[begun:] if e[0] == "begin"]


@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_only_the_first_capture_warms_up_and_later_ones_capture_relaxed(mode):
    """A warm-up costs about a capture: the wrapper runs the forward eagerly before its first capture
    only, then captures each later size at once in CUDA's relaxed mode (which lets a kernel variant
    load inside the capture); the replays still compute each step's values."""
    CALLS["forward"] = 0
    wrapper, begins = _capture_sizes(mode, (4, 2, 1))
    assert wrapper.warm_ups == 1 and CALLS["forward"] == 1 + 3
    graphs = [e.graph for e in wrapper._entries.values()]
    modes = [g.capture_error_mode for g in graphs] if mode == M.FULL else \
        [{s.capture_error_mode for s in g.segments} for g in graphs]
    assert modes == (["global", "relaxed", "relaxed"] if mode == M.FULL else [{"global"}, {"relaxed"}, {"relaxed"}])
    assert len(begins) == (3 if mode == M.FULL else 3 * 2)   # one attention break per PIECEWISE graph


def test_the_largest_graph_of_each_kind_of_batch_warms_up():
    """Uniform-decode and mixed graphs differ (a decode step's computes the logits): the first, largest
    capture of each warms up, as the graph-memory measurement captures those two after a warm-up."""
    phase = CapturePhase()
    wrapper = CUDAGraphWrapper(counted_forward, M.FULL, None, phase, False, FakeGraphForTests)
    with phase.capturing():
        for rows, uniform in ((8, False), (4, False), (4, True), (2, True), (2, False)):
            with set_forward_context(_context(M.FULL, BD(rows, rows, uniform))):
                wrapper(torch.randn(rows, 3))
    modes = {(d.num_tokens, d.uniform_decode): e.graph.capture_error_mode for d, e in wrapper._entries.items()}
    assert wrapper.warm_ups == 2
    assert modes == {(8, False): "global", (4, False): "relaxed", (4, True): "global", (2, True): "relaxed",
                     (2, False): "relaxed"}
    wrapper.release_graphs()   # graphs captured again after a release warm up again
    with phase.capturing(), set_forward_context(_context(M.FULL, BD(2, 2, True))):
        wrapper(torch.randn(2, 3))
    assert wrapper.warm_ups == 3


@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_warm_up_every_capture_warms_each_capture_and_keeps_the_global_mode(mode):
    CALLS["forward"] = 0
    wrapper, _ = _capture_sizes(mode, (4, 2, 1), warm_up_every_capture=True)
    assert wrapper.warm_ups == 3 and CALLS["forward"] == 2 * 3
    for entry in wrapper._entries.values():
        segments = [entry.graph] if mode == M.FULL else entry.graph.segments
        assert {s.capture_error_mode for s in segments} == {"global"}


def test_a_full_capture_needing_a_new_output_buffer_is_dropped_and_redone_after_a_warm_up():
    """Inside a capture a new buffer would come from the graph pool: the capture that finds no shared
    buffer for its output (here a larger one) ends unused, and the size warms up and captures again."""
    CALLS["forward"] = 0
    wrapper, begins = _capture_sizes(M.FULL, (2, 4))
    assert wrapper.warm_ups == 2 and len(begins) == 3 and wrapper.num_captured == 2
    assert CALLS["forward"] == 2 + 3   # warm-up + capture of 2; the dropped capture, warm-up, capture of 4
    assert [e.graph.capture_error_mode for e in wrapper._entries.values()] == ["global", "global"]


# ---- capture phase -------------------------------------------------------------------------
def test_capture_phase_freezes_gc_and_rejects_nesting():
    phase = CapturePhase()
    before = gc.get_freeze_count()
    with phase.capturing():
        assert phase.active and gc.get_freeze_count() > 0
        with pytest.raises(RuntimeError):
            with phase.capturing():
                pass
    assert not phase.active and gc.get_freeze_count() == before


def test_capture_all_order_and_summary(caplog):
    caplog.set_level(logging.INFO, logger="runner.cudagraph.capture")
    seen = []
    summary = capture_all([BD(8, 0, False), BD(4, 0, False)], seen.append, desc="test", estimate_bytes=2**20)
    assert seen == [BD(8, 0, False), BD(4, 0, False)]
    assert (summary.num_graphs, summary.pool_bytes) == (2, 0) and summary.seconds >= 0
    assert len(caplog.records) == 1 and "captured 2 CUDA graphs" in caplog.records[0].getMessage()
    assert "estimate 1.0 MiB" in caplog.records[0].getMessage()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_measure_graph_memory_is_zero_on_cpu():
    assert measure_graph_memory(lambda pool: pytest.fail("must not capture on a CPU")) == 0


@pytest.mark.parametrize("configured, world_size, expected", [
    (None, 1, False), (None, 2, True), (None, 4, True), (True, 1, True), (False, 4, False)])
def test_warm_up_every_capture_auto_is_off_on_one_device_and_on_across_ranks(configured, world_size, expected):
    """Captures without a warm-up are checked on one GPU; under tensor or pipeline parallelism the
    auto value keeps a warm-up before every capture."""
    from configs import EngineConfig
    config = EngineConfig.from_kwargs(model="x", compilation_config={"warm_up_every_capture": configured})
    assert config.compilation.warms_up_every_capture(world_size) is expected
