"""The unified attention kernel's long-context paths against the float64 torch reference: the prefill
tiles (BLOCK_M 128 rows on a GPU, 32 in the interpreter) and split-KV decode with up to MAX_SPLITS
splits, on ragged batches, prefix-cached prefills, scattered (non-contiguous) KV blocks, padding,
GQA, sliding windows and soft-caps. The tile and split choices and the persistent split scratch are
checked here too.

Like tests/test_triton_kernels.py, the kernels run in Triton's interpreter without a GPU (which
needs TRITON_INTERPRET=1 before triton is first imported) and compiled with one; shapes are tiny
because the interpreter is slow. Outputs are poisoned with NaN before every launch.
tests/test_attention_long_context_gpu.py repeats the comparisons at 32k contexts on a GPU.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_TRITON_PRELOADED = "triton" in sys.modules
_ENV_AT_START = dict(os.environ)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

from attention.kernels import unified_attention as ua  # noqa: E402  (after the TRITON_INTERPRET switch)
from tests import paged_batch  # noqa: E402
from tests.paged_batch import PagedBatch, reference_attention  # noqa: E402


@pytest.fixture(autouse=True)
def _kernels_can_run(kernel_switches):
    """Fail loudly (not skip) when the kernels cannot run here; let a split take a single KV tile
    (these contexts are a few tiles long)."""
    if DEVICE == "cpu" and (not INTERPRET or (_TRITON_PRELOADED and "TRITON_INTERPRET" not in _ENV_AT_START)):
        pytest.fail("no GPU and triton is not in interpreter mode: export TRITON_INTERPRET=1 before pytest")
    kernel_switches(min_split_tiles=1)


def make_batch(*args, **kwargs) -> PagedBatch:
    return paged_batch.make_batch(*args, device=DEVICE, **kwargs)


def run(b: PagedBatch, *, prefill_tiles: bool | None = None, num_splits: int | None = None,
        window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    out = torch.full_like(b.query, float("nan"))
    ua.unified_attention(b.query, b.kv_cache, out, b.query_start_loc, b.seq_lens, b.block_table, b.scale,
                         num_splits=num_splits, sliding_window=window, soft_cap=soft_cap, prefill_tiles=prefill_tiles)
    return out


def check(b: PagedBatch, out: torch.Tensor, window: int | None = None, soft_cap: float | None = None) -> None:
    assert torch.isfinite(out).all(), "a row was left unwritten (NaN poison survived)"
    assert (out[b.num_actual_tokens:] == 0).all(), "padded token rows must be zeroed"
    ref = reference_attention(b, window, soft_cap)[: b.num_actual_tokens]
    torch.testing.assert_close(out[: b.num_actual_tokens].cpu().double(), ref, atol=1e-5, rtol=1e-5)


# A ragged step: a chunk of a prompt on a cached prefix (context not a multiple of the KV tile, so
# its q blocks have unmasked tiles, then diagonal ones), a decode, a fresh prefill, a short chunk.
RAGGED = dict(query_lens=[37, 1, 21, 3], context_lens=[45, 70, 0, 100])


@pytest.mark.parametrize("prefill_tiles", [False, True], ids=["decode-tiles", "prefill-tiles"])
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 16), ((6, 2), 24)], ids=["gqa4", "gqa3-d24"])
def test_both_tiles_match_the_reference_on_a_ragged_prefix_cached_batch(prefill_tiles, heads, head_dim):
    b = make_batch(RAGGED["query_lens"], RAGGED["context_lens"], num_q_heads=heads[0], num_kv_heads=heads[1],
                   head_dim=head_dim, block_size=16, pad_tokens=3, pad_reqs=1, seed=31)
    check(b, run(b, prefill_tiles=prefill_tiles, num_splits=1))


@pytest.mark.parametrize("window,soft_cap", [(9, None), (None, 1.5), (40, 2.0)])
def test_prefill_tiles_with_sliding_window_and_soft_cap(window, soft_cap):
    b = make_batch(RAGGED["query_lens"], RAGGED["context_lens"], num_q_heads=4, num_kv_heads=2, head_dim=16,
                   block_size=16, pad_tokens=1, seed=32)
    check(b, run(b, prefill_tiles=True, num_splits=1, window=window, soft_cap=soft_cap), window, soft_cap)


def test_prefill_tiles_split_kv_goes_through_the_merge_kernel():
    """A short chunk on a long cached prefix may split with the prefill tiles: their partials are
    merged by the separate kernel (the in-kernel merge is for the decode tiles' 16 rows)."""
    b = make_batch([5, 2], [150, 90], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, pad_tokens=2,
                   pad_reqs=1, seed=33)
    plan = ua._plan(b.query, b.kv_cache, torch.empty_like(b.query), b.query_start_loc, b.seq_lens, b.block_table,
                    b.scale, 3, None, prefill_tiles=True)
    assert plan.merge is not None
    check(b, run(b, prefill_tiles=True, num_splits=3))


@pytest.mark.parametrize("fused_merge", [True, False])
def test_decode_with_every_split_active(fused_merge, kernel_switches):
    """MAX_SPLITS splits, each one KV tile, merged (in the kernel: four splits per chunk load),
    beside requests that fill only a few splits; a window and a soft-cap on the split path too."""
    kernel_switches(fused_merge=fused_merge)
    tile = ua.launch_config(torch.device(DEVICE))["BLOCK_N"]
    contexts = [ua.MAX_SPLITS * tile - 1, 3 * tile + 5, 2]
    b = make_batch([1, 1, 1], contexts, num_q_heads=4, num_kv_heads=1, head_dim=16, block_size=16, pad_tokens=1,
                   pad_reqs=1, seed=34)
    check(b, run(b, prefill_tiles=False, num_splits=ua.MAX_SPLITS))
    check(b, run(b, prefill_tiles=False, num_splits=ua.MAX_SPLITS, window=100, soft_cap=3.0), 100, 3.0)
    assert all(int(t.abs().sum()) == 0 for t in ua._tickets.values()), "every merge ticket back at zero"


def test_tile_choice_from_the_longest_query_or_the_padded_shape():
    assert not ua.use_prefill_tiles(64, 64)                   # a uniform decode graph
    assert not ua.use_prefill_tiles(8, 2)                     # too few tokens for the prefill tiles
    assert ua.use_prefill_tiles(512, 4)                       # a mixed graph, mostly prefill
    assert ua.use_prefill_tiles(300, 200, max_query_len=100)  # eager: the longest query decides
    assert not ua.use_prefill_tiles(300, 200, max_query_len=ua.PREFILL_MIN_QUERY - 1)


def test_split_counts_fill_an_h100_for_decode_and_spare_long_prefills(monkeypatch):
    monkeypatch.setattr(ua, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert [ua.default_num_splits(b, b, 8, cuda) for b in (1, 2, 8, 32)] == [64, 32, 8, 2]
    assert ua.default_num_splits(1, 1, 8, cuda, max_seq_len=32768) == 64
    assert ua.default_num_splits(1, 1, 8, cuda, max_seq_len=1024) == 2   # eager: 4 KV tiles (of 128) a split at least
    prefill_blocks = -(-8192 // ua.tile_sizes(32, 8, True, cuda)[1]) + 1
    assert ua.default_num_splits(8192, prefill_blocks, 8, cuda, max_seq_len=32768) == 1


def test_split_scratch_is_one_persistent_buffer(monkeypatch):
    """Every launch's partials live at the same addresses (FULL graphs replay them), sized for
    SPLIT_ROWS x heads rows at once; a larger need grows it and keeps the old one alive."""
    monkeypatch.setattr(ua, "_scratch_buffers", {})
    monkeypatch.setattr(ua, "_retired_scratch", [])
    device = torch.device("cpu")
    acc, m, s = ua.split_scratch(device, 64, 16, num_q_heads=4)
    again = ua.split_scratch(device, 128, 16, num_q_heads=4)
    assert (acc.data_ptr(), m.data_ptr(), s.data_ptr()) == tuple(t.data_ptr() for t in again)
    assert acc.numel() == 64 * 16 and m.numel() == s.numel() == 64
    assert s.data_ptr() - m.data_ptr() >= ua.SPLIT_ROWS * 4 * 4, "max and sum rows do not overlap"
    grown = ua.split_scratch(device, ua.SPLIT_ROWS * 8, 16, num_q_heads=4)
    assert grown[0].data_ptr() != acc.data_ptr() and len(ua._retired_scratch) == 1



def test_graph_style_launches_pick_the_captures_merge(kernel_switches):
    """KernelConfig.fused_merge auto: an eager launch (it knows the step's max_seq_len) merges in the
    kernel; a FULL-mode launch (no max_seq_len) takes the separate merge kernel even outside a
    capture, so the start-up's forwards that queue the captures' compiles (launch/compile_ahead.py)
    queue the variants the FULL graphs launch."""
    kernel_switches(fused_merge=None)
    device = torch.device(DEVICE)
    assert ua._merge_tickets(device, 8, eager=False) is None
    assert ua._merge_tickets(device, 8, eager=True) is not None
    b = make_batch([1, 1], [3 * ua.launch_config(device)["BLOCK_N"] + 5, 7], num_q_heads=4, num_kv_heads=1,
                   head_dim=16, block_size=16, pad_tokens=0, pad_reqs=0, seed=35)
    graph_style = ua._plan(b.query, b.kv_cache, torch.empty_like(b.query), b.query_start_loc, b.seq_lens,
                           b.block_table, b.scale, 4, None)
    eager = ua._plan(b.query, b.kv_cache, torch.empty_like(b.query), b.query_start_loc, b.seq_lens,
                     b.block_table, b.scale, 4, 200)
    assert graph_style.merge is not None and eager.merge is None
