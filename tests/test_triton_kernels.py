"""The Triton KV-write and unified-attention kernels against a float64 torch reference.

Without a GPU the kernels run in Triton's interpreter, which must be switched on before `triton`
is first imported (it decides compiled vs interpreted for `tl.sum` & co. at import time):
scripts/test.sh exports TRITON_INTERPRET=1; this module sets it too when it is the first to import
triton. With a GPU (and no TRITON_INTERPRET) the same tests run compiled on CUDA tensors.
Shapes are tiny because the interpreter is slow; tests/test_triton_gpu.py repeats the comparisons
at real sizes. Outputs are poisoned with NaN before every launch so a row the kernel forgot to
write cannot pass by accident.
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

from attention.kernels.kv_write import write_kv  # noqa: E402  (after the TRITON_INTERPRET switch)
from tests import paged_batch  # noqa: E402
from tests.paged_batch import PagedBatch, reference_attention  # noqa: E402
from attention.kernels.unified_attention import unified_attention  # noqa: E402


@pytest.fixture(autouse=True)
def _kernels_can_run():
    """Fail loudly (not skip) when the kernels cannot run here: CI must not lose this coverage."""
    if DEVICE == "cpu" and (not INTERPRET or (_TRITON_PRELOADED and "TRITON_INTERPRET" not in _ENV_AT_START)):
        pytest.fail("no GPU and triton is not in interpreter mode: export TRITON_INTERPRET=1 before pytest")


def make_batch(*args, **kwargs) -> PagedBatch:
    return paged_batch.make_batch(*args, device=DEVICE, **kwargs)


def run_attention(b: PagedBatch, num_splits: int | None = None) -> torch.Tensor:
    out = torch.full_like(b.query, float("nan"))
    unified_attention(b.query, b.kv_cache, out, b.query_start_loc, b.seq_lens, b.block_table,
                      b.scale, num_splits=num_splits)
    return out


def check(b: PagedBatch, out: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(out).all(), "a row was left unwritten (NaN poison survived)"
    assert (out[b.num_actual_tokens:] == 0).all(), "padded token rows must be zeroed"
    ref = reference_attention(b)[: b.num_actual_tokens]
    torch.testing.assert_close(out[: b.num_actual_tokens].cpu().double(), ref, atol=tol, rtol=tol)


# --- KV write ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_slots_and_skips_minus_one(dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens, heads, dim, block_size = 7, 3, 16, 4
    key = torch.randn(num_tokens, heads, dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, heads, dim, generator=gen).to(dtype)
    cache = torch.full((2, 5, block_size, heads, dim), 7.0, dtype=dtype, device=DEVICE)
    slots = torch.tensor([13, -1, 0, 19, 4, -1, 9])
    write_kv(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE))
    expected = torch.full((2, 5, block_size, heads, dim), 7.0, dtype=dtype)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = key[t]
            expected[1, slot // block_size, slot % block_size] = value[t]
    assert torch.equal(cache.cpu(), expected)


def test_write_kv_strided_inputs():
    """key/value as views of a fused qkv projection (non-contiguous rows), as the model passes them."""
    qkv = torch.randn(5, 4 + 2 + 2, 32, device=DEVICE)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    cache = torch.zeros(2, 3, 16, 2, 32, device=DEVICE)
    slots = torch.arange(5, device=DEVICE) * 7
    write_kv(key, value, cache, slots)
    assert torch.equal(cache[0].view(-1, 2, 32)[slots], key)
    assert torch.equal(cache[1].view(-1, 2, 32)[slots], value)


# --- unified attention ------------------------------------------------------------------------

@pytest.mark.parametrize("num_q_heads,num_kv_heads,block_size", [(2, 2, 16), (3, 1, 32), (8, 1, 16)])
def test_decode(num_q_heads, num_kv_heads, block_size):
    b = make_batch([1, 1, 1], [40, 5, 70], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                   head_dim=16, block_size=block_size)
    check(b, run_attention(b, num_splits=1), 1e-5)


def test_prefill_without_context():
    b = make_batch([19, 6], [0, 0], num_q_heads=3, num_kv_heads=1, head_dim=32, block_size=16)
    check(b, run_attention(b, num_splits=1), 1e-5)


def test_chunked_prefill_with_cached_context():
    b = make_batch([21, 3], [35, 16], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    check(b, run_attention(b, num_splits=1), 1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_batch_with_padding_in_one_launch(num_splits):
    """Decode, prefill, chunked prefill and a 1-token-context request together, plus padded token
    rows (slot -1) and padded requests (query len 0, seq len 0), as a captured graph sees them."""
    b = make_batch([1, 9, 4, 1], [50, 0, 20, 0], num_q_heads=4, num_kv_heads=2, head_dim=16,
                   block_size=16, pad_tokens=3, pad_reqs=2, seed=3)
    check(b, run_attention(b, num_splits=num_splits), 1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,soft_cap", [(5, None), (None, 2.0), (37, 1.5), (1, None)],
                         ids=["window", "softcap", "window+softcap", "window1"])
def test_sliding_window_and_soft_cap_match_the_reference(window, soft_cap, num_splits):
    """Gemma-style layers: a sliding window (keys p - window < k <= p; tiles before the block's first
    visible key are skipped, so a window shorter than a tile, one crossing tiles and a window of one
    are all covered) and score soft-capping, in decode, prefill, chunked prefill and padded rows,
    with and without split KV. Scores here are O(1..5): a cap of 1.5-2 bends them visibly."""
    b = make_batch([1, 9, 4, 1, 30], [50, 0, 20, 0, 3], num_q_heads=4, num_kv_heads=2, head_dim=16,
                   block_size=16, pad_tokens=3, pad_reqs=2, seed=7)
    b.query *= 4
    out = torch.full_like(b.query, float("nan"))
    unified_attention(b.query, b.kv_cache, out, b.query_start_loc, b.seq_lens, b.block_table, b.scale,
                      num_splits=num_splits, sliding_window=window, soft_cap=soft_cap)
    assert torch.isfinite(out).all() and (out[b.num_actual_tokens:] == 0).all()
    ref = reference_attention(b, window, soft_cap)[: b.num_actual_tokens]
    torch.testing.assert_close(out[: b.num_actual_tokens].cpu().double(), ref, atol=1e-5, rtol=1e-5)
    if window is not None or soft_cap is not None:   # the options change the answer at these sizes
        assert not torch.allclose(ref, reference_attention(b)[: b.num_actual_tokens], atol=1e-3)


def test_step_attention_keys_layers_by_window_and_soft_cap():
    """Two layers that differ only in window / soft-cap never share a bound launch."""
    from attention.kernels import unified_attention as ua
    b = make_batch([1, 1], [40, 20], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16, seed=2)
    step = ua.StepAttention(b.query_start_loc, b.seq_lens, b.block_table, None)
    for window, cap in [(None, None), (4, None), (None, 1.0), (4, 1.0), (None, None)]:
        out = torch.full_like(b.query, float("nan"))
        step(b.query, b.kv_cache, out, b.scale, window, cap)
        torch.testing.assert_close(out.cpu().double(), reference_attention(b, window, cap), atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _split_every_tile(monkeypatch, kernel_switches):
    """These tests' contexts are a few KV tiles long: let a split take a single tile (the default
    min_split_tiles would leave them one active split, and the merges untested)."""
    from attention.kernels import unified_attention as ua
    kernel_switches(min_split_tiles=1)


@pytest.mark.parametrize("fused_merge", [True, False])
@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_decode_matches_single_pass(num_splits, fused_merge, monkeypatch, kernel_switches):
    """More splits than some requests have KV tiles: empty splits must merge as no-ops."""
    from attention.kernels import unified_attention as ua
    kernel_switches(fused_merge=fused_merge)
    b = make_batch([1, 1], [100, 3], num_q_heads=8, num_kv_heads=1, head_dim=16, block_size=32,
                   pad_tokens=1, pad_reqs=1, seed=4)
    split, single = run_attention(b, num_splits=num_splits), run_attention(b, num_splits=1)
    check(b, split, 1e-5)
    torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 16])
def test_in_kernel_split_merge_matches_the_merge_kernel_and_resets_its_tickets(num_splits, kernel_switches):
    """The last active split of each (q block, KV head) merges the partials (no merge launch):
    same result as the separate merge kernel, padded rows zeroed, every arrival ticket back at
    zero for the next launch or graph replay."""
    from attention.kernels import unified_attention as ua
    b = make_batch([1, 4, 1], [70, 33, 5], num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=16,
                   pad_tokens=2, pad_reqs=1, seed=8)
    kernel_switches(fused_merge=True)
    fused = run_attention(b, num_splits=num_splits)
    assert all(int(t.abs().sum()) == 0 for t in ua._tickets.values())
    kernel_switches(fused_merge=False)
    separate = run_attention(b, num_splits=num_splits)
    torch.testing.assert_close(fused, separate, atol=1e-6, rtol=1e-6)
    check(b, fused, 1e-5)


@pytest.mark.parametrize("fused_merge", [True, False])
def test_short_contexts_keep_fewer_active_splits(fused_merge, monkeypatch, kernel_switches):
    """With min_split_tiles = 4, a 4-tile context runs as one split (written directly) and a
    10-tile one as 3 splits of 4 tiles, whatever num_splits the launch (or graph) was given."""
    from attention.kernels import unified_attention as ua
    kernel_switches(min_split_tiles=4, fused_merge=fused_merge)
    tile = ua.launch_config(torch.device(DEVICE))["BLOCK_N"]
    b = make_batch([1, 1, 1], [4 * tile - 1, 10 * tile - 1, 2], num_q_heads=4, num_kv_heads=2, head_dim=16,
                   block_size=16, pad_tokens=1, seed=9)
    split, single = run_attention(b, num_splits=16), run_attention(b, num_splits=1)
    torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-5)
    check(b, split, 1e-5)
    assert all(int(t.abs().sum()) == 0 for t in ua._tickets.values())


def test_head_dim_not_power_of_two():
    b = make_batch([3, 1], [10, 20], num_q_heads=2, num_kv_heads=1, head_dim=24, block_size=16, seed=5)
    check(b, run_attention(b, num_splits=1), 1e-5)


def test_bfloat16_cache():
    b = make_batch([5, 1], [30, 44], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                   dtype=torch.bfloat16, pad_tokens=2, seed=6)
    out = run_attention(b, num_splits=2)
    assert out.dtype == torch.bfloat16
    check(b, out.float(), 3e-2)


def test_write_then_attend_sees_this_steps_tokens():
    """The backend order: write K/V for the new tokens, then attend over the cache incl. them."""
    b = make_batch([4, 1], [12, 30], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16,
                   pad_tokens=1, seed=7)
    gen = torch.Generator().manual_seed(8)
    key = torch.randn(b.query.shape[0], 1, 16, generator=gen).to(DEVICE)
    value = torch.randn(b.query.shape[0], 1, 16, generator=gen).to(DEVICE)
    write_kv(key, value, b.kv_cache, b.slot_mapping)
    k_view = b.kv_cache[0].view(-1, 1, 16)
    assert torch.equal(k_view[b.slot_mapping[: b.num_actual_tokens]], key[: b.num_actual_tokens])
    check(b, run_attention(b), 1e-5)


def _assert_causal_within_requests(query, key, value, out, bounds, scale):
    """The profile run's contract: each token attends to its own request's new tokens up to itself."""
    group = query.shape[1] // key.shape[1]
    for start, end in zip(bounds[:-1], bounds[1:]):
        for i in range(start, end):
            for h in range(query.shape[1]):
                s = key[start:i + 1, h // group] @ query[i, h] * scale
                torch.testing.assert_close(out[i, h], torch.softmax(s, 0) @ value[start:i + 1, h // group])


def test_no_cache_profile_path_is_causal_within_requests():
    """Without a KV cache the backend hands the step to the torch reference (never captured)."""
    from types import SimpleNamespace

    from attention.backends import get_attention_backend
    from attention.metadata import CommonAttentionMetadata
    gen = torch.Generator().manual_seed(9)
    qsl = torch.tensor([0, 5, 5, 8], dtype=torch.int32)
    query, key, value = (torch.randn(10, h, 16, generator=gen) for h in (4, 2, 2))
    out = torch.full_like(query, float("nan"))
    lens = qsl.diff()
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, seq_lens_cpu=lens,
        num_computed_tokens_cpu=torch.zeros(3, dtype=torch.int32), block_table=torch.zeros(3, 1, dtype=torch.int32),
        slot_mapping=torch.full((10,), -1), token_request_index=torch.tensor([0] * 5 + [2] * 3 + [-1] * 2),
        num_reqs=3, num_actual_tokens=8, max_query_len=5, max_seq_len=5, uniform_decode=False)
    layer = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    backend = get_attention_backend("triton")
    backend.forward(layer, query, key, value, out, None, backend.build_metadata(common))
    assert (out[8:] == 0).all()
    _assert_causal_within_requests(query, key, value, out, qsl.tolist(), 0.25)


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_random_mixed_batches(seed):
    """Random query/context lengths, GQA ratio, block size, split count and padding."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    num_reqs = pick([1, 2, 3])
    query_lens = [pick([1, 1, 2, 7, 17]) for _ in range(num_reqs)]
    context_lens = [pick([0, 1, 15, 16, 33, 60]) for _ in range(num_reqs)]
    num_kv_heads, group = pick([1, 2]), pick([1, 3, 8])
    b = make_batch(query_lens, context_lens, num_q_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                   head_dim=16, block_size=pick([16, 32]), pad_tokens=pick([0, 2]), pad_reqs=pick([0, 1]),
                   seed=seed)
    check(b, run_attention(b, num_splits=pick([1, 2, 5])), 1e-5)


def test_backend_forward_writes_then_attends_and_profiles_without_cache():
    from types import SimpleNamespace

    from attention.backends import get_attention_backend
    from attention.backends.base import AttentionCGSupport
    from attention.metadata import CommonAttentionMetadata

    backend = get_attention_backend("triton")
    assert backend.name == "triton" and backend.cudagraph_support is AttentionCGSupport.ALWAYS
    b = make_batch([3, 1], [5, 20], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                   pad_tokens=1, pad_reqs=1, seed=13)
    qsl_cpu, seq_lens_cpu = b.query_start_loc.cpu(), b.seq_lens.cpu()
    common = CommonAttentionMetadata(
        query_start_loc=b.query_start_loc, query_start_loc_cpu=qsl_cpu, seq_lens=b.seq_lens,
        seq_lens_cpu=seq_lens_cpu, num_computed_tokens_cpu=seq_lens_cpu - qsl_cpu.diff(),
        block_table=b.block_table, slot_mapping=b.slot_mapping,
        token_request_index=torch.tensor([0, 0, 0, 1, -1], dtype=torch.int32, device=DEVICE),
        num_reqs=3, num_actual_tokens=4, max_query_len=3, max_seq_len=21, uniform_decode=False)
    metadata = backend.build_metadata(common)
    layer = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16, scale=b.scale)
    gen = torch.Generator().manual_seed(14)
    key, value = (torch.randn(5, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    out = torch.full_like(b.query, float("nan"))
    backend.forward(layer, b.query, key, value, out, b.kv_cache, metadata)
    assert torch.equal(b.kv_cache[1].view(-1, 2, 16)[b.slot_mapping[:4]], value[:4])
    check(b, out, 1e-5)

    out.fill_(float("nan"))
    backend.forward(layer, b.query, key, value, out, None, metadata)
    assert torch.isfinite(out).all()
    _assert_causal_within_requests(b.query.cpu(), key.cpu(), value.cpu(), out.cpu(), qsl_cpu.tolist(), b.scale)


def test_backend_skips_the_kv_write_the_layer_did_and_fits_splits_only_outside_full_graphs(monkeypatch):
    """key/value None (written by the fused RoPE+KV kernel) -> no write_kv; the step's max_seq_len
    reaches the split choice for eager calls only: a FULL graph must not freeze one step's value."""
    from types import SimpleNamespace

    from attention.backends import triton_paged
    from attention.forward_context import ForwardContext, set_forward_context
    from configs import CUDAGraphMode

    calls = []

    class FakeStepAttention:
        def __init__(self, qsl, seq_lens, block_table, max_seq_len, max_query_len=None):
            self.max_seq_len = max_seq_len
            calls.append("new step")

        def __call__(self, query, kv_cache, out, scale, sliding_window=None, soft_cap=None):
            calls.append(("attention", self.max_seq_len))

    monkeypatch.setattr(triton_paged, "write_kv", lambda *a: calls.append("write_kv"))
    monkeypatch.setattr(triton_paged, "unified_attention",
                        lambda *a, max_seq_len=None, sliding_window=None, soft_cap=None:
                        calls.append(("attention", max_seq_len)))
    monkeypatch.setattr(triton_paged, "StepAttention", FakeStepAttention)
    backend = triton_paged.TritonPagedBackend()
    assert backend.kv_written_by_layer
    layer = SimpleNamespace(scale=1.0)
    q = torch.zeros(1, 1, 4)
    for mode, expected in [(CUDAGraphMode.NONE, 77), (CUDAGraphMode.PIECEWISE, 77), (CUDAGraphMode.FULL, None)]:
        calls.clear()
        metadata = SimpleNamespace(slot_mapping=None, query_start_loc=None, seq_lens=None, block_table=None,
                                   max_seq_len=77, max_query_len=1)   # a new object per step, as the runner's
        with set_forward_context(ForwardContext(metadata, [q], backend, mode)):
            backend.forward(layer, q, None, None, q, q, metadata)
            backend.forward(layer, q, None, None, q, q, metadata)   # the step's next layer
        eager = mode != CUDAGraphMode.FULL
        assert calls == ["new step"] * eager + [("attention", expected)] * 2, mode
    calls.clear()
    backend.forward(layer, q, q, q, q, q, metadata)  # outside a forward: eager, writes the cache itself
    assert calls == ["write_kv", "new step", ("attention", 77)]


def test_attention_layer_uses_the_fused_rope_and_cache_write_when_the_backend_allows(monkeypatch):
    """The layer hands the backend key/value None exactly when the rotary's fused kernel wrote them."""
    from types import SimpleNamespace

    from attention import layer as layer_module
    from attention.forward_context import ForwardContext, set_forward_context

    seen = []

    class Backend:
        kv_written_by_layer = True

        def forward(self, layer, query, key, value, out, kv_cache, metadata):
            seen.append((query.clone(), key, value, kv_cache))
            out.copy_(query)

    class Rotary(torch.nn.Module):
        def __init__(self, fused_available):
            super().__init__()
            self.fused_available = fused_available

        def rotate_and_cache(self, positions, q, k, v, kv_cache, slot_mapping):
            return q + 1 if self.fused_available else None

        def forward(self, positions, q, k):
            return q + 2, k + 2

    q, k, v = torch.zeros(2, 2, 4), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)
    cache, metadata = torch.zeros(1), SimpleNamespace(slot_mapping=None)
    for fused_available, kv_cached, backend_allows, q_shift, kv_passed in [
            (True, True, True, 1, False), (False, True, True, 2, True),
            (True, False, True, 2, True), (True, True, False, 2, True)]:
        seen.clear()
        Backend.kv_written_by_layer = backend_allows
        attn = layer_module.Attention(2, 1, 4, cache_index=0, rotary=Rotary(fused_available))
        context = ForwardContext(metadata, [cache] if kv_cached else None, Backend())
        with set_forward_context(context):
            out = attn(torch.zeros(2, dtype=torch.long), q, k, v)
        query, key, value, _ = seen[0]
        assert torch.equal(out, torch.full((2, 8), float(q_shift)))
        assert (key is not None and value is not None) == kv_passed


def test_split_count_from_padded_shapes_and_fitted_to_the_context_when_eager(monkeypatch):
    """Graph launches (no max_seq_len) split for parallelism alone; an eager launch also needs
    EAGER_TILES_PER_SPLIT KV tiles per split, so short contexts skip the merge launch."""
    from attention.kernels import unified_attention as ua
    monkeypatch.setattr(ua, "num_sms", lambda device: 132)  # an H100
    cuda = torch.device("cuda")
    assert [ua.default_num_splits(b, b, 8, cuda) for b in (1, 8, 32, 128)] == [64, 8, 2, 1]
    block_n = ua.launch_config(cuda)["BLOCK_N"]
    per_split = ua.EAGER_TILES_PER_SPLIT * block_n
    assert ua.default_num_splits(1, 1, 8, cuda, max_seq_len=140) == 1
    assert ua.default_num_splits(1, 1, 8, cuda, max_seq_len=4 * per_split) == 4
    assert ua.default_num_splits(1, 1, 8, cuda, max_seq_len=5 * per_split) == 4  # a power of two
    assert ua.default_num_splits(1, 1, 8, cuda, max_seq_len=4096) == 4096 // block_n // ua.EAGER_TILES_PER_SPLIT
    assert ua.default_num_splits(1, 1, 8, torch.device("cpu"), max_seq_len=4096) == 1


@pytest.mark.parametrize("direct", [False, True], ids=["relaunch", "direct-launch"])
def test_step_attention_relaunches_the_first_layers_launch_with_each_layers_tensors(monkeypatch, direct):
    """Layers of one step: the first binds the launch, the others relaunch it with their own q, KV
    cache and out; the arguments are exactly those `unified_attention` would pass. A layer whose
    tensors differ (here: another dtype) takes the full path. A fake launcher stands in for
    FastLaunch, which only binds compiled kernels (a GPU test runs the real one); it offers a
    direct launch or not (FastLaunch.direct_launch), and either takes the same arguments."""
    from attention.kernels import unified_attention as ua

    calls = []

    class FakeLaunch:
        def __call__(self, grid, *args, device_index=0, num_warps=4, num_stages=3, launch_pdl=False):
            calls.append(("launch", grid, args))
            return "compiled kernel"

        def stream_of(self, device_index):
            return 1234

        def relaunch(self, kernel, grid, args, device_index=0, stream=None):
            assert kernel == "compiled kernel" and stream == 1234   # the stream read when the launch was bound
            calls.append(("relaunch", grid, args))

        def direct_launch(self, kernel, grid, stream):
            assert kernel == "compiled kernel" and stream == 1234
            if not direct:
                return None
            return lambda *args: calls.append(("relaunch", grid, args))

    monkeypatch.setattr(ua, "_attention_launch", FakeLaunch())
    b = make_batch([1, 1, 1], [5, 17, 30], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, pad_reqs=1)
    caches = [b.kv_cache.clone() for _ in range(3)] + [b.kv_cache.double()]
    queries = [b.query] * 3 + [b.query.double()]
    outs = [torch.empty_like(q) for q in queries]
    step = ua.StepAttention(b.query_start_loc, b.seq_lens, b.block_table, max_seq_len=31)
    for query, cache, out in zip(queries, caches, outs):
        step(query, cache, out, b.scale)
    assert [kind for kind, _, _ in calls] == ["launch", "relaunch", "relaunch", "launch"]
    assert step.relaunches == 2
    for (kind, grid, args), query, cache, out in zip(calls, queries, caches, outs):
        want = ua._plan(query, cache, out, b.query_start_loc, b.seq_lens, b.block_table, b.scale, None, 31)
        assert grid == want.grid and len(args) == len(want.args)
        for index, (got, expected) in enumerate(zip(args, want.args)):
            if isinstance(expected, torch.Tensor) and (index < 3 or kind == "launch"):
                assert got is expected
            else:   # a relaunch passes the bound tensors after query, kv_cache, out as addresses
                assert got == (expected.data_ptr() if isinstance(expected, torch.Tensor) else expected)


def test_piecewise_break_replay_uses_the_key_computed_at_capture(monkeypatch):
    """TritonPagedBackend.prepare_replay: the recorded tensors' layer key is computed once; a replay
    hands it to the step's StepAttention (one per step's metadata); another KV cache than the one
    captured, or a FULL context, takes `forward`; a layer that leaves the KV write to the backend
    (key given) gets no special replay."""
    from types import SimpleNamespace

    from attention.backends import triton_paged
    from attention.forward_context import ForwardContext, set_forward_context
    from attention.kernels import unified_attention as ua
    from configs import CUDAGraphMode

    calls = []

    class FakeStepAttention:
        def __init__(self, qsl, seq_lens, block_table, max_seq_len, max_query_len=None):
            calls.append("new step")

        def call_addressed(self, key, addresses, query, kv_cache, out, scale):
            calls.append(("keyed", key, addresses, kv_cache is cache))

    monkeypatch.setattr(triton_paged, "StepAttention", FakeStepAttention)
    backend = triton_paged.TritonPagedBackend()
    monkeypatch.setattr(backend, "forward", lambda *a: calls.append("forward"))
    layer = SimpleNamespace(scale=0.5, cache_index=0)
    q, out, cache = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 3, 4, 2, 8)
    assert backend.prepare_replay(layer, q, q, q, out, cache) is None
    prepared = backend.prepare_replay(layer, q, None, None, out, cache)
    replay = prepared.replay
    assert prepared.step_graph.group is backend

    def metadata():
        return SimpleNamespace(query_start_loc=None, seq_lens=None, block_table=None, max_seq_len=9, max_query_len=1)

    step = metadata()
    with set_forward_context(ForwardContext(step, [cache], backend, CUDAGraphMode.PIECEWISE)):
        replay()
        replay()
    addresses = (q.data_ptr(), cache.data_ptr(), out.data_ptr())
    assert calls == ["new step"] + [("keyed", ua.layer_key(q, cache, out, 0.5), addresses, True)] * 2
    calls.clear()
    with set_forward_context(ForwardContext(metadata(), [cache.clone()], backend, CUDAGraphMode.PIECEWISE)):
        replay()
    with set_forward_context(ForwardContext(metadata(), [cache], backend, CUDAGraphMode.FULL)):
        replay()
    assert calls == ["forward", "forward"]
