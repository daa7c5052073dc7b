"""Mode resolution and the dispatcher (keys, padding, per-step choice): pure logic, CPU."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings, strategies as st

from attention.backends.base import AttentionCGSupport as S
from configs.graph_mode import CUDAGraphMode as M
from runner.cudagraph import BatchDescriptor as BD, CudagraphDispatcher, default_capture_sizes, resolve_cudagraph_mode
from runner.cudagraph import mode_resolution

NONE, PW, FULL, FDO, FAP = M.NONE, M.PIECEWISE, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE
CUDA_TABLE = {  # requested -> resolved for (ALWAYS, UNIFORM_DECODE, NEVER)
    NONE: (NONE, NONE, NONE),
    PW: (PW, PW, PW),
    FULL: (FULL, FAP, PW),
    FDO: (FDO, FDO, NONE),
    FAP: (FAP, FAP, PW),
}
SUPPORTS = (S.ALWAYS, S.UNIFORM_DECODE, S.NEVER)


@pytest.fixture(autouse=True)
def _fresh_log_once():
    mode_resolution._reported.clear()
    yield
    mode_resolution._reported.clear()


@pytest.mark.parametrize("requested", list(M))
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("device", ["cuda", "cpu", "mps"])
def test_resolution_table(requested, support, device, caplog):
    caplog.set_level(logging.INFO, logger="runner.cudagraph.mode_resolution")
    expected = CUDA_TABLE[requested][SUPPORTS.index(support)] if device == "cuda" else NONE
    assert resolve_cudagraph_mode(requested, support, device) == expected
    records = [r for r in caplog.records if r.name == "runner.cudagraph.mode_resolution"]
    if expected == requested:
        assert records == []
    else:  # never silently: one line naming the requested mode, the support and the result
        assert len(records) == 1
        message = records[0].getMessage()
        assert requested.name in message and support.name in message and f"-> {expected.name}" in message
        assert records[0].levelno == (logging.INFO if device != "cuda" else logging.WARNING)


def test_fallback_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="runner.cudagraph.mode_resolution")
    for _ in range(3):
        assert resolve_cudagraph_mode(FULL, S.NEVER, "cuda") == PW
        assert resolve_cudagraph_mode(FAP, S.ALWAYS, "cpu") == NONE
    assert len(caplog.records) == 2


def test_default_capture_sizes():
    assert default_capture_sizes() == [1, 2, 4, 8, 16, 24, 32] + list(range(48, 257, 16)) + list(range(288, 513, 32))
    assert len(default_capture_sizes()) == 29
    assert default_capture_sizes(300) == [1, 2, 4, 8, 16, 24, 32] + list(range(48, 257, 16)) + [288]
    assert default_capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32]
    assert default_capture_sizes(3) == [1, 2]
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(1024)[-3:] == [960, 992, 1024]


def test_default_capture_sizes_hold_max_num_seqs():
    """The largest decode batch gets its own size, so its FULL key exists (no padding past max_num_seqs)."""
    assert default_capture_sizes(512, max_num_seqs=100) == sorted(default_capture_sizes() + [100])
    assert default_capture_sizes(512, max_num_seqs=256) == default_capture_sizes()
    assert default_capture_sizes(64, max_num_seqs=100) == default_capture_sizes(64)   # above the largest size
    with_it = CudagraphDispatcher(FAP, default_capture_sizes(512, max_num_seqs=100), max_num_seqs=100)
    grid_alone = CudagraphDispatcher(FAP, default_capture_sizes(), max_num_seqs=100)
    with_it.mark_ready()
    grid_alone.mark_ready()
    assert with_it.dispatch(97, 97, uniform_decode=True) == (FULL, BD(100, 100, True))
    assert grid_alone.dispatch(97, 97, uniform_decode=True) == (PW, BD(112, 0, False))


def test_custom_sizes_sorted_and_deduplicated():
    d = CudagraphDispatcher(PW, [8, 3, 3, 1], max_num_seqs=4)
    assert d.capture_sizes == [1, 3, 8] and d.max_capture_size == 8
    assert d.padded_sizes == [0, 1, 3, 3, 8, 8, 8, 8, 8]
    with pytest.raises(ValueError):
        CudagraphDispatcher(PW, [0, 4], max_num_seqs=4)


def test_padding_table_default_sizes():
    d = CudagraphDispatcher(FAP, default_capture_sizes(64), max_num_seqs=256)
    assert len(d.padded_sizes) == 65
    assert [d.padded_sizes[n] for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25, 33, 48, 49, 64)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 24, 24, 32, 48, 48, 64, 64]


SIZES = [1, 2, 4, 8, 16, 24, 32]


def test_keys_per_mode():
    d = CudagraphDispatcher(FAP, SIZES, max_num_seqs=10)
    assert d.keys(FULL) == [BD(n, n, True) for n in (8, 4, 2, 1)]  # only sizes <= max_num_seqs
    assert d.keys(PW) == [BD(n, 0, False) for n in reversed(SIZES)]
    d = CudagraphDispatcher(FULL, SIZES, max_num_seqs=10)
    assert d.keys(PW) == []
    assert set(d.keys(FULL)) == {BD(n, n, True) for n in (1, 2, 4, 8)} | {BD(n, min(n, 10), False) for n in SIZES}
    d = CudagraphDispatcher(FDO, SIZES, max_num_seqs=64)
    assert d.keys(FULL) == [BD(n, n, True) for n in reversed(SIZES)] and d.keys(PW) == []
    d = CudagraphDispatcher(PW, SIZES, max_num_seqs=64)   # mode PIECEWISE: decode steps get graphs with the head
    assert d.keys(FULL) == [] and set(d.keys(PW)) == {BD(n, 0, u) for n in SIZES for u in (False, True)}
    d = CudagraphDispatcher(PW, SIZES, max_num_seqs=10)
    assert set(d.keys(PW)) == {BD(n, 0, False) for n in SIZES} | {BD(n, 0, True) for n in (1, 2, 4, 8)}
    d = CudagraphDispatcher(NONE, SIZES, max_num_seqs=64)
    assert d.all_keys_to_capture() == [] and d.padded_sizes == [0]


def test_all_keys_largest_first():
    d = CudagraphDispatcher(FAP, SIZES, max_num_seqs=64)
    pairs = d.all_keys_to_capture()
    assert len(pairs) == 2 * len(SIZES)
    assert [k.num_tokens for _, k in pairs] == sorted((k.num_tokens for _, k in pairs), reverse=True)
    assert pairs[0] == (FULL, BD(32, 32, True)) and pairs[1] == (PW, BD(32, 0, False))
    assert all((m == FULL) == k.uniform_decode for m, k in pairs)


def _ready(mode, sizes=SIZES, max_num_seqs=64):
    d = CudagraphDispatcher(mode, sizes, max_num_seqs)
    d.mark_ready()
    return d


@pytest.mark.parametrize("num_tokens, num_reqs, uniform, expected", [
    (1, 1, True, (FULL, BD(1, 1, True))),
    (3, 3, True, (FULL, BD(4, 4, True))),
    (17, 17, True, (FULL, BD(24, 24, True))),
    (3, 1, False, (PW, BD(4, 0, False))),
    (17, 5, False, (PW, BD(24, 0, False))),
    (32, 32, True, (FULL, BD(32, 32, True))),
    (33, 33, True, (NONE, None)),  # larger than the largest capture size
    (500, 3, False, (NONE, None)),
])
def test_dispatch_full_and_piecewise(num_tokens, num_reqs, uniform, expected):
    assert _ready(FAP).dispatch(num_tokens, num_reqs, uniform) == expected


def test_dispatch_not_ready_is_none():
    d = CudagraphDispatcher(FAP, SIZES, max_num_seqs=64)
    assert d.dispatch(4, 4, True) == (NONE, None) and d.dispatch(5, 2, False) == (NONE, None)
    d.mark_ready()
    assert d.dispatch(4, 4, True) == (FULL, BD(4, 4, True))


def test_dispatch_full_decode_only_mixed_is_none():
    d = _ready(FDO)
    assert d.dispatch(5, 2, False) == (NONE, None)
    assert d.dispatch(5, 5, True) == (FULL, BD(8, 8, True))


def test_uniform_past_max_num_seqs_falls_back_to_mixed_mode():
    # 6 requests pad to 8 > max_num_seqs=6: no uniform key of size 8
    assert _ready(FAP, max_num_seqs=6).dispatch(6, 6, True) == (PW, BD(8, 0, False))
    assert _ready(FDO, max_num_seqs=6).dispatch(6, 6, True) == (NONE, None)
    assert _ready(FULL, max_num_seqs=6).dispatch(6, 6, True) == (FULL, BD(8, 6, False))
    assert _ready(FAP, max_num_seqs=6).dispatch(4, 4, True) == (FULL, BD(4, 4, True))


def test_dispatch_full_mode_pads_requests():
    d = _ready(FULL, max_num_seqs=10)
    assert d.dispatch(5, 2, False) == (FULL, BD(8, 8, False))
    assert d.dispatch(20, 7, False) == (FULL, BD(24, 10, False))
    assert d.dispatch(2, 2, True) == (FULL, BD(2, 2, True))


def test_dispatch_piecewise_ignores_request_counts_and_keeps_decode_steps_apart():
    """Mode PIECEWISE: one graph per size serves every mixed batch; a uniform-decode batch gets the
    size's decode graph (it also computes the decode head), or the mixed one past max_num_seqs."""
    d = _ready(PW)
    assert d.dispatch(3, 1, False) == d.dispatch(3, 2, False) == (PW, BD(4, 0, False))
    assert d.dispatch(3, 3, True) == (PW, BD(4, 0, True))
    assert _ready(PW, max_num_seqs=6).dispatch(6, 6, True) == (PW, BD(8, 0, False))
    assert _ready(FAP).dispatch(3, 1, False) == (PW, BD(4, 0, False))   # FULL serves FAP's decode steps


def test_dispatch_none_mode():
    d = _ready(NONE)
    assert d.dispatch(1, 1, True) == (NONE, None)


@pytest.mark.parametrize("args", [(0, 0, False), (3, 4, False), (4, 0, False), (4, 2, True)])
def test_dispatch_rejects_impossible_batches(args):
    with pytest.raises(ValueError):
        _ready(FAP).dispatch(*args)


@settings(max_examples=300, deadline=None)
@given(mode=st.sampled_from(list(M)), sizes=st.lists(st.integers(1, 64), min_size=1, max_size=8),
       max_num_seqs=st.integers(1, 80), num_tokens=st.integers(1, 90), data=st.data())
def test_dispatch_invariants(mode, sizes, max_num_seqs, num_tokens, data):
    num_reqs = data.draw(st.integers(1, min(num_tokens, max_num_seqs)))
    uniform = data.draw(st.booleans()) and num_reqs == num_tokens
    d = _ready(mode, sizes, max_num_seqs)
    runtime, key = d.dispatch(num_tokens, num_reqs, uniform)
    if runtime == NONE:
        assert key is None
        return
    assert runtime in (FULL, PW) and key in d.keys(runtime)
    assert key.num_tokens == min(s for s in sizes if s >= num_tokens)  # smallest fitting size
    if runtime == PW:
        assert key.num_reqs == 0 and PW in (mode.decode_mode(), mode.mixed_mode())
        assert key.uniform_decode == (uniform and mode.decode_mode() == PW and key.num_tokens <= max_num_seqs)
    else:
        assert num_reqs <= key.num_reqs <= min(key.num_tokens, max_num_seqs)
        assert key.uniform_decode == (key.num_reqs == key.num_tokens and uniform)
        assert (mode.decode_mode() if key.uniform_decode else mode.mixed_mode()) == FULL
    if uniform and mode.decode_mode() == FULL and key.num_tokens <= max_num_seqs:
        assert (runtime, key) == (FULL, BD(key.num_tokens, key.num_tokens, True))
