"""The small-row fused linear kernels (models/small_batch_kernels.py) against the unfused torch path,
and a model run through them against the same model without them.

Runs in Triton's interpreter on a CPU (scripts/test.sh sets TRITON_INTERPRET=1) and compiled on a GPU.
On a CPU the model never takes the small-batch path by itself; the model tests force it."""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.nn.functional as F

from configs.kernel_config import using_kernel_config
from models import layers, llama

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from models import small_batch_kernels as sbk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS = 1e-5

SMALL_SHAPES = [(64, 96), (100, 200)]   # (K, N): a power of two; odd K and N (masked tiles)
ROWS = [1, 3, 16, sbk.MAX_ROWS]
# SmolLM2's qkv shape (K 576, N 960) costs ~1 s a call in the interpreter: a few combinations only.
SMOLLM2_CASES = [(1, True, False), (3, False, True), (16, True, True), (sbk.MAX_ROWS, True, False)]


def _close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (a.float() - b.float()).abs().max()


def _inputs(rows, k, n, dtype, residual, bias, seed, strided=False, gated=False):
    """x is a view: rows of a wider tensor (row stride k + 3), or with `strided` a transposed one
    (column stride != 1)."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        x = torch.randn(k, rows, generator=g).to(DEVICE, dtype).t()
    else:
        x = torch.randn(rows, k + 3, generator=g).to(DEVICE, dtype)[:, 2:k + 2]
    res = torch.randn(rows, k, generator=g).to(DEVICE, dtype) if residual else None
    norm = layers.RMSNorm(k, EPS)
    norm.weight.data = torch.rand(k, generator=g) + 0.5
    out_rows = 2 * n if gated else n
    weight = (torch.randn(out_rows, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = (torch.randn(out_rows, generator=g) * 0.5).to(DEVICE, dtype) if bias else None
    return x, res, norm.to(DEVICE, dtype), weight, b


def _check_norm_linear(rows, k, n, dtype, residual, bias, strided=False):
    x, res, norm, weight, b = _inputs(rows, k, n, dtype, residual, bias, seed=rows * 1000 + k + n, strided=strided)
    out, res_out = sbk.norm_linear(x, res, norm.weight, EPS, weight, b)
    if res is None:
        ref_res, h = x, norm.reference(x)
        assert res_out is x
    else:
        h, ref_res = norm.reference(x, res)
        assert torch.equal(res_out, ref_res)   # the add in the model dtype: exact
    _close(out, F.linear(h, weight, b), dtype)


def _check_gate_up(rows, k, n, dtype, residual, bias, strided=False):
    x, res, norm, weight, b = _inputs(rows, k, n, dtype, residual, bias, seed=rows * 1000 + k + n + 1,
                                      strided=strided, gated=True)
    act, res_out = sbk.norm_gate_up_silu(x, res, norm.weight, EPS, weight, b)
    if res is None:
        ref_res, h = x, norm.reference(x)
    else:
        h, ref_res = norm.reference(x, res)
    gate, up = F.linear(h, weight, b).chunk(2, dim=-1)
    assert torch.equal(res_out, ref_res)
    _close(act, F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("k, n", SMALL_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("check", [_check_norm_linear, _check_gate_up], ids=["norm_linear", "norm_gate_up_silu"])
def test_norm_fused_projections(check, rows, k, n, residual, bias, dtype):
    check(rows, k, n, dtype, residual, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k, n", SMALL_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear(rows, k, n, bias, dtype):
    x, _, _, weight, b = _inputs(rows, k, n, dtype, False, bias, seed=rows + k + n)
    _close(sbk.linear(x, weight, b), F.linear(x, weight, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, residual, bias", SMOLLM2_CASES)
def test_smollm2_shapes(rows, residual, bias, dtype):
    """K 576 (not a power of two, several K tiles), N 960 (qkv) / 2 x 1536 (gate_up), 1536 -> 576 (down)."""
    _check_norm_linear(rows, 576, 960, dtype, residual, bias)
    if rows in (1, 16):
        _check_gate_up(rows, 576, 1536, dtype, residual, bias)
        x, _, _, weight, b = _inputs(rows, 1536, 576, dtype, False, bias, seed=rows)
        _close(sbk.linear(x, weight, b), F.linear(x, weight, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_strided_x_in_both_dims(rows, dtype):
    """x a transposed view (column stride != 1), as well as the row-strided views the other tests use."""
    _check_norm_linear(rows, 100, 96, dtype, residual=True, bias=True, strided=True)
    _check_gate_up(rows, 64, 96, dtype, residual=False, bias=False, strided=True)
    x, _, _, weight, _ = _inputs(rows, 100, 200, dtype, False, False, seed=7, strided=True)
    _close(sbk.linear(x, weight), F.linear(x, weight), dtype)


def test_refuses_what_it_cannot_do():
    x = torch.randn(sbk.MAX_ROWS + 1, 64, device=DEVICE)
    w = torch.randn(96, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        sbk.linear(x, w)
    with pytest.raises(ValueError, match="weight"):
        sbk.linear(x[:2], w.t().contiguous().t())   # not contiguous
    with pytest.raises(ValueError, match="weight"):
        sbk.linear(x[:2, :32], w)


def test_block_sizes_fill_the_gpu_and_fit_the_paths(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(sbk, "num_sms", lambda index: 132)   # an H100's
    for rows in (2, 16, 32):
        for n, k in ((960, 576), (1536, 576), (4096, 14336), (6144, 4096)):
            block_m, block_n, block_k, _ = sbk.block_sizes(rows, n, k, torch.bfloat16, cuda)
            assert block_m == max(16, rows)
            assert block_n >= 16 and block_k >= 16   # tl.dot's minimum
            assert block_n <= 16 or -(-n // block_n) >= 2 * 132
    # One row on a GPU: the measured tiles (ONE_ROW_TILES), gate/up pairs at half the columns,
    # BLOCK_K down to K's power of two (SmolLM2's K 576: one K tile, no separate rms pass).
    assert sbk.block_sizes(1, 4096, 14336, torch.bfloat16, cuda) == (1, 2, 1024, 4)
    assert sbk.block_sizes(1, 960, 576, torch.bfloat16, cuda) == (1, 2, 1024, 4)
    assert sbk.block_sizes(1, 1536, 576, torch.bfloat16, cuda, gated=True) == (1, 1, 1024, 4)
    assert sbk.block_sizes(1, 64, 64, torch.bfloat16, cuda) == (1, 2, 64, 4)
    assert sbk.qkv_rope_block_sizes(480, 960, 576, torch.bfloat16, cuda) == (1, 1024)
    with using_kernel_config(one_row_block_n=4):   # the switch for measuring other tiles in the step
        assert sbk.block_sizes(1, 4096, 14336, torch.bfloat16, cuda) == (1, 4, 1024, 4)
        assert sbk.block_sizes(1, 1536, 576, torch.bfloat16, cuda, gated=True) == (1, 2, 1024, 4)
    with using_kernel_config(one_row_block_k=4096):
        assert sbk.block_sizes(1, 4096, 14336, torch.bfloat16, cuda) == (1, 2, 4096, 4)
        assert sbk.block_sizes(1, 960, 576, torch.bfloat16, cuda) == (1, 2, 1024, 4)   # K's power of two
        assert sbk.qkv_rope_block_sizes(2048, 6144, 4096, torch.bfloat16, cuda) == (1, 4096)
    # The interpreter keeps few, wide programs (its cost is per program).
    assert sbk.block_sizes(1, 960, 576, torch.float32, torch.device("cpu"))[1] >= 8


# --- norm_qkv_rope_cache: one row, norm + qkv + RoPE + KV-cache write -----------------------------

QKV_ROPE_SHAPES = [(9, 3, 64, 576), (4, 2, 16, 64), (4, 4, 32, 100)]   # (Hq, Hkv, D, K): SmolLM2; small; odd K
QKV_ROPE_CASES = [(True, True, 5, 7), (False, False, 13, 30), (True, False, -1, 3), (False, True, -1, 0)]
"""(residual, bias, slot, position); SmolLM2's shape (~1.5 s a case in the interpreter) takes the first two
and the third."""


def _qkv_rope_inputs(hq, hkv, dim, k, dtype, residual, bias, seed):
    from models.rotary import RotaryEmbedding
    from transformers import LlamaConfig

    x, res, norm, weight, b = _inputs(1, k, (hq + 2 * hkv) * dim, dtype, residual, bias, seed)
    config = LlamaConfig(hidden_size=hq * dim, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=dim,
                         max_position_embeddings=64, rope_theta=10000.0)
    cos_sin = RotaryEmbedding(config, 64).cos_sin_cache.to(DEVICE)
    g = torch.Generator().manual_seed(seed + 1)
    cache = torch.randn(2, 5, 4, hkv, dim, generator=g).to(DEVICE, dtype)   # 5 blocks of 4 slots
    return x, res, norm, weight, b, cos_sin, cache


def _check_qkv_rope(hq, hkv, dim, k, dtype, residual, bias, slot, position):
    x, res, norm, weight, b, cos_sin, cache = _qkv_rope_inputs(hq, hkv, dim, k, dtype, residual, bias,
                                                               seed=hq * 100 + dim + k + slot)
    positions = torch.tensor([position], device=DEVICE)
    slots = torch.tensor([slot], device=DEVICE)
    before = cache.clone()
    ref_cache = cache.clone()
    qkv, ref_res = sbk.norm_linear(x, res, norm.weight, EPS, weight, b)
    q, kk, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    from models import fused_kernels
    ref_q = fused_kernels.rope_and_cache(positions, q.view(1, hq, dim), kk.view(1, hkv, dim), v.view(1, hkv, dim),
                                         cos_sin, ref_cache, slots)
    got_q, got_res = sbk.norm_qkv_rope_cache(x, res, norm.weight, EPS, weight, b, positions, cos_sin, cache, slots,
                                             hq, hkv, dim)
    assert got_q.shape == (1, hq, dim) and got_q.is_contiguous()
    if res is None:
        assert got_res is x
    else:
        assert torch.equal(got_res, ref_res)
    changed = (cache != before).any(dim=0).flatten(2).any(-1).flatten()   # per slot
    if slot < 0:
        assert torch.equal(cache, before)
    else:
        assert changed.nonzero().flatten().tolist() in ([slot], [])   # only the slot (random data differs)
        assert changed[slot]
    if dtype == torch.float32 and DEVICE == "cpu":
        assert torch.equal(got_q, ref_q) and torch.equal(cache, ref_cache)   # the interpreter: bit for bit
    elif dtype == torch.float32:
        _close(got_q, ref_q, dtype)
        _close(cache, ref_cache, dtype)
    else:
        _close(got_q, ref_q, dtype)
        _close(cache, ref_cache, dtype)
    # and against torch from scratch (RMSNorm, F.linear, neox rotation)
    if res is None:
        h = norm.reference(x)
    else:
        h, _ = norm.reference(x, res)
    full = F.linear(h, weight, b).view(hq + 2 * hkv, dim).float()
    cos, sin = cos_sin[position].float().chunk(2)
    a, bb = full[:, :dim // 2], full[:, dim // 2:]
    rot = torch.cat([a * cos - bb * sin, bb * cos + a * sin], dim=-1)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(got_q[0].float(), rot[:hq], atol=tol, rtol=tol)
    if slot >= 0:
        cached = cache[:, slot // 4, slot % 4].float()
        assert torch.allclose(cached[0], rot[hq:hq + hkv], atol=tol, rtol=tol)
        assert torch.allclose(cached[1], full[hq + hkv:], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual, bias, slot, position", QKV_ROPE_CASES)
@pytest.mark.parametrize("hq, hkv, dim, k", QKV_ROPE_SHAPES)
def test_norm_qkv_rope_cache_matches_norm_linear_then_rope_and_cache(hq, hkv, dim, k, residual, bias, slot,
                                                                      position, dtype):
    if k == 576 and DEVICE == "cpu" and (residual, bias, slot, position) == QKV_ROPE_CASES[3]:
        pytest.skip("SmolLM2's shape: three cases suffice in the interpreter")
    _check_qkv_rope(hq, hkv, dim, k, dtype, residual, bias, slot, position)


def test_norm_qkv_rope_cache_grid_and_refusals(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(sbk, "num_sms", lambda index: 132)
    units = (9 + 2 * 3) * 32   # SmolLM2: 480 column pairs
    block_n, block_k = sbk.qkv_rope_block_sizes(units, 960, 576, torch.bfloat16, cuda)
    assert block_k == sbk.block_sizes(1, 960, 576, torch.bfloat16, cuda)[2] == 1024   # one K tile
    assert -(-units // block_n) >= 100
    x = torch.randn(2, 64, device=DEVICE)
    args = (torch.ones(64, device=DEVICE), EPS, torch.randn(128, 64, device=DEVICE), None,
            torch.zeros(1, dtype=torch.long, device=DEVICE), torch.zeros(8, 16, device=DEVICE),
            torch.zeros(2, 2, 4, 2, 16, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE), 4, 2, 16)
    with pytest.raises(ValueError, match="one row"):
        sbk.norm_qkv_rope_cache(x, None, *args)
    with pytest.raises(ValueError, match="qkv weight"):
        sbk.norm_qkv_rope_cache(x[:1], None, *args[:8], 4, 3, 16)


# --- The model: the small-batch path on vs off -------------------------------------------------

def _spy():
    """The kernels module behind a namespace that counts calls."""
    calls = {"norm_linear": 0, "norm_gate_up_silu": 0, "linear": 0, "norm_qkv_rope_cache": 0}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return getattr(sbk, name)(*args, **kwargs)
        return call
    return types.SimpleNamespace(**{name: counted(name) for name in calls}), calls


FAMILIES = [("llama_gqa", {}), ("qwen2", {}), ("qwen3", {})]   # plain, qkv bias, qk_norm + head_dim


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; the GPU runs "
                    "test_engine_greedy_tokens_same_with_small_batch_path_on_and_off")
@pytest.mark.parametrize("family, kwargs", FAMILIES)
def test_model_logits_same_with_small_batch_path_forced(tmp_path, monkeypatch, family, kwargs):
    """On a CPU through the interpreter: the model's own layers, with `small_batch` forced to answer
    the kernels (for any row count the kernels take), give the reference path's logits (fp32; a
    13-token prefill and a 1-token one), every projection through its kernel."""
    from checkpoints import make_tiny_checkpoint
    from model_helpers import load_ours, prefill_logits

    path, _ = make_tiny_checkpoint(tmp_path / family, family, with_tokenizer=False, **kwargs)
    model = load_ours(path)
    batches = [[[5, 6, 7, 8, 9], [3], [10, 11, 12, 13, 14, 15, 16]], [[42]]]
    expected = [prefill_logits(model, prompts) for prompts in batches]

    spy, calls = _spy()
    monkeypatch.setattr(llama, "small_batch", lambda x: spy)
    monkeypatch.setattr(layers, "small_batch", lambda x: spy)   # Linear's dispatch: the LM head
    got = [prefill_logits(model, prompts) for prompts in batches]
    layers_run = 2 * model.num_local_layers
    assert calls["norm_linear"] == layers_run
    assert calls["norm_gate_up_silu"] == layers_run
    assert calls["linear"] == 2 * layers_run + len(batches)   # o, down per layer; the LM head per forward
    for got_batch, expected_batch in zip(got, expected):
        for a, b in zip(got_batch, expected_batch):
            assert (a - b).abs().max().item() < 1e-4


class _CacheBackend:
    """A torch attention backend over the paged cache (one decode row): writes k/v at the slot when
    given them, then attends over `metadata.context_slots` (or, without a cache, over the row itself)."""

    def __init__(self, kv_written_by_layer: bool) -> None:
        self.kv_written_by_layer = kv_written_by_layer
        self.calls = []

    def forward(self, layer, query, key, value, out, kv_cache, metadata):
        self.calls.append(key is None)
        if kv_cache is None:
            keys, values = key, value
        else:
            flat = kv_cache.flatten(1, 2)   # [2, slots, Hkv, D]
            if key is not None:
                flat[0, metadata.slot_mapping] = key
                flat[1, metadata.slot_mapping] = value
            keys, values = flat[0, metadata.context_slots], flat[1, metadata.context_slots]
        rep = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = torch.einsum("hd,thd->ht", query[0], keys) * layer.scale
        out[0] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)


_LAYER_MODELS = {}


def _tiny_model(tmp_path_factory, family):
    if family not in _LAYER_MODELS:
        from checkpoints import make_tiny_checkpoint
        from model_helpers import load_ours

        path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family, with_tokenizer=False)
        _LAYER_MODELS[family] = load_ours(path)
    return _LAYER_MODELS[family]


ROPE_CACHE_CASES = ["fused", "backend_writes_kv", "profile_run", "two_rows", "partial_rotary"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; the GPU runs "
                    "test_engine_greedy_tokens_same_with_fused_rope_cache_on_and_off")
@pytest.mark.parametrize("case", ROPE_CACHE_CASES)
@pytest.mark.parametrize("family", ["llama_gqa", "qwen2", "qwen3"])
def test_decoder_layer_fuses_rope_and_cache_into_qkv_only_where_it_applies(tmp_path_factory, monkeypatch,
                                                                           family, case):
    """DecoderLayer.forward_small_batch inside a forward context with a KV cache: one row, a backend
    that lets the layer write the cache, full rotary and no qk_norm take `norm_qkv_rope_cache` and then
    the attention alone (key/value None); everything else takes norm_linear + Attention.forward. Either
    way the layer's outputs and the cache equal the reference layer's (fp32, the interpreter)."""
    from attention.forward_context import ForwardContext, set_forward_context

    model = _tiny_model(tmp_path_factory, family)
    rows = 2 if case == "two_rows" else 1
    position = 6
    g = torch.Generator().manual_seed(3)
    for index, layer in model.model.layers.items():   # layer 0: residual None; layer 1: a residual
        attn = layer.self_attn
        hidden = torch.randn(rows, model.spec.hidden_size, generator=g)
        residual = None if index == "0" else torch.randn(rows, model.spec.hidden_size, generator=g)
        positions = torch.arange(position, position + rows)
        cache = torch.randn(2, 4, 4, attn.num_kv_heads, attn.head_dim, generator=g)   # 16 slots, 6 in context
        metadata = types.SimpleNamespace(slot_mapping=torch.arange(position, position + rows) + 3,
                                         context_slots=torch.cat([torch.arange(position), torch.tensor([9])]))

        def run(layer_fn, backend_flag, kv_cache):
            backend = _CacheBackend(backend_flag)
            caches = None if kv_cache is None else [kv_cache] * model.num_local_layers
            with set_forward_context(ForwardContext(metadata, caches, backend)), torch.no_grad():
                return layer_fn(), backend.calls

        if rows > 1:   # the fake backend attends one row only: check the dispatch alone
            monkeypatch.setattr(attn.attn, "attend_rotated", lambda q, k=None, v=None: pytest.fail("fused path with 2 rows"))
            monkeypatch.setattr(attn.attn, "forward", lambda positions, q, k, v: q.flatten(1))
        if case == "partial_rotary":   # the cos/sin table stays whole: check the decision alone
            monkeypatch.setattr(model.model.rotary_emb, "rotary_dim", attn.head_dim // 2)
            assert run(lambda: attn.cache_written_here(hidden), True, cache)[0] is None
            monkeypatch.undo()
            if family != "qwen3":
                assert run(lambda: attn.cache_written_here(hidden), True, cache)[0] is not None
            continue
        kv_cache = None if case == "profile_run" else cache
        flag = case != "backend_writes_kv"

        ref_cache = None if kv_cache is None else kv_cache.clone()
        expected, _ = run(lambda: layer.forward(positions, hidden, residual), flag, ref_cache)   # CPU: reference
        spy, calls = _spy()
        got_cache = None if kv_cache is None else kv_cache.clone()
        got, attn_calls = run(lambda: layer.forward_small_batch(spy, positions, hidden, residual), flag, got_cache)

        fused = case == "fused" and family != "qwen3"
        assert calls["norm_qkv_rope_cache"] == int(fused)
        assert calls["norm_linear"] == int(not fused)
        if rows == 1:
            assert attn_calls == [fused]   # the attention op got key None exactly when the layer cached k/v
        for a, b in zip(got, expected):
            assert (a - b).abs().max().item() < 1e-5
        if kv_cache is not None:
            assert (got_cache - ref_cache).abs().max().item() < 1e-5   # F.linear vs the GEMV: sum order
            assert torch.equal(got_cache.flatten(1, 2)[:, :9], kv_cache.flatten(1, 2)[:, :9])   # other slots


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; the GPU runs "
                    "tests/test_engine_families_cuda.py's qwen3 against HF")
@pytest.mark.parametrize("case", ["fused", "backend_writes_kv", "profile_run"])
def test_qk_norms_run_inside_rope_and_cache_only_where_the_layer_writes_the_cache(tmp_path_factory, monkeypatch,
                                                                                 case):
    """SelfAttention.attend of a Qwen3 layer with the fused kernels on (the interpreter standing in for
    CUDA): where the layer writes the KV cache, `rope_and_cache` normalises q and k itself and the norm
    modules never run; without a cache (the profile run) or with a backend that writes k/v, the norms
    run first. Either way the output and the cache equal the reference path's (fp32)."""
    from attention.forward_context import ForwardContext, set_forward_context
    from models import fused_kernels, rotary as rotary_module

    model = _tiny_model(tmp_path_factory, "qwen3")
    attn = model.model.layers["1"].self_attn
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(1, (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim, generator=g) * 3
    positions = torch.tensor([6])
    cache = torch.randn(2, 4, 4, attn.num_kv_heads, attn.head_dim, generator=g)
    metadata = types.SimpleNamespace(slot_mapping=torch.tensor([9]),
                                     context_slots=torch.cat([torch.arange(6), torch.tensor([9])]))

    def run(kv_cache, backend_flag):
        backend = _CacheBackend(backend_flag)
        caches = None if kv_cache is None else [kv_cache] * model.num_local_layers
        with set_forward_context(ForwardContext(metadata, caches, backend)), torch.no_grad():
            return attn.attend(positions, qkv), backend.calls

    flag, kv_cache = case != "backend_writes_kv", None if case == "profile_run" else cache
    ref_cache = None if kv_cache is None else kv_cache.clone()
    expected, _ = run(ref_cache, flag)   # a CPU tensor: no fused kernels, the reference path

    monkeypatch.setattr(rotary_module, "fused", lambda x: fused_kernels)
    norm_calls = []
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name)
        monkeypatch.setattr(norm, "forward", lambda x, _f=norm.forward, _n=name: norm_calls.append(_n) or _f(x))
    got_cache = None if kv_cache is None else kv_cache.clone()
    got, attn_calls = run(got_cache, flag)

    fused = case == "fused"
    assert norm_calls == ([] if fused else ["q_norm", "k_norm"])
    assert attn_calls == [fused]   # the attention op got key None exactly when the layer cached k/v
    assert (got - expected).abs().max().item() < 1e-5
    if kv_cache is not None:
        assert (got_cache - ref_cache).abs().max().item() < 1e-5


def test_cpu_never_takes_the_small_batch_path():
    assert layers.small_batch(torch.zeros(1, 8)) is None


# --- GPU only -------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_gate_follows_rows_and_switch(kernel_switches):
    x = torch.zeros(layers.SMALL_BATCH_MAX_ROWS, 8, device="cuda")
    assert layers.small_batch(x) is sbk
    assert layers.small_batch(torch.zeros(layers.SMALL_BATCH_MAX_ROWS + 1, 8, device="cuda")) is None
    kernel_switches(small_batch_kernels=False)
    assert layers.small_batch(x) is None
    kernel_switches(small_batch_kernels=True, fused_ops=False)
    assert layers.small_batch(x) is None and layers.fused(x) is None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_replay_in_a_cuda_graph(dtype):
    """Captured once, replayed with new inputs in the same buffers: no host syncs, no stale values."""
    rows, k, n = 4, 576, 960
    x, res, norm, weight, b = _inputs(rows, k, n, dtype, True, True, seed=0)
    w_gu = torch.randn(2 * 1536, k, device="cuda").to(dtype) / k ** 0.5
    w_down = torch.randn(k, 1536, device="cuda").to(dtype) / 1536 ** 0.5

    def step():
        out, r = sbk.norm_linear(x, res, norm.weight, EPS, weight, b)
        act, r2 = sbk.norm_gate_up_silu(out[:, :k], r, norm.weight, EPS, w_gu)
        return out, r2, sbk.linear(act, w_down)

    def reference():
        h, r = norm.reference(x, res)
        out = F.linear(h, weight, b)
        h2, r2 = norm.reference(out[:, :k], r)
        gate, up = F.linear(h2, w_gu).chunk(2, dim=-1)
        return out, r2, F.linear(F.silu(gate) * up, w_down)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=g).to(dtype))
        res.copy_(torch.randn(res.shape, generator=g).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, reference()):
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["NONE", "FULL"])
def test_engine_greedy_tokens_same_with_small_batch_path_on_and_off(tmp_path, monkeypatch, mode):
    """fp32 decode through the engine (CUDA graphs in FULL): the fused path gives the tokens of the
    unfused one and of HF."""
    import gc

    from checkpoints import hf_greedy_generate, make_tiny_checkpoint
    from configs import SamplingParams
    from runner import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    path, hf = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (6,), generator=g)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = hf_greedy_generate(hf, prompts, greedy.max_tokens, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        spy, calls = _spy()
        monkeypatch.setattr(layers, "SMALL_BATCH_MAX_ROWS", 8)   # every captured size takes the path
        monkeypatch.setattr(llama, "small_batch", (lambda x: spy if layers.small_batch(x) is not None else None)
                            if on else (lambda x: None))
        llm = LLM(model=str(path), device="cuda", dtype="float32", cudagraph_mode=mode,
                  cudagraph_capture_sizes=[1, 2, 4, 8], max_num_seqs=8, max_num_batched_tokens=256,
                  num_kv_blocks=256)
        tokens[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert (calls["norm_linear"] > 0) == on   # rows 2..8; one-row steps may take norm_qkv_rope_cache
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False] == expected


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_qkv_rope_cache_replays_in_a_cuda_graph(dtype):
    """Captured once, replayed with new x, position and slot (one of them -1) in the same buffers."""
    hq, hkv, dim, k = 9, 3, 64, 576
    x, res, norm, weight, b, cos_sin, cache = _qkv_rope_inputs(hq, hkv, dim, k, dtype, True, True, seed=0)
    positions = torch.zeros(1, dtype=torch.long, device="cuda")
    slots = torch.zeros(1, dtype=torch.long, device="cuda")
    step = lambda c: sbk.norm_qkv_rope_cache(x, res, norm.weight, EPS, weight, b, positions, cos_sin, c, slots,
                                             hq, hkv, dim)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step(cache.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, r = step(cache)
    for seed, (pos, slot) in enumerate([(3, 7), (11, -1), (0, 19)]):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=g).to(dtype))
        positions.fill_(pos)
        slots.fill_(slot)
        ref_cache = cache.clone()
        qkv, ref_r = sbk.norm_linear(x, res, norm.weight, EPS, weight, b)
        qq, kk, vv = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
        from models import fused_kernels
        ref_q = fused_kernels.rope_and_cache(positions, qq.view(1, hq, dim), kk.view(1, hkv, dim),
                                             vv.view(1, hkv, dim), cos_sin, ref_cache, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(r, ref_r)
        _close(q, ref_q, dtype)
        _close(cache, ref_cache, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["NONE", "FULL"])
def test_engine_greedy_tokens_same_with_fused_rope_cache_on_and_off(tmp_path, monkeypatch, mode):
    """One prompt at a time (decode steps of one row, SMALL_BATCH_MAX_ROWS as shipped): the layers take
    norm_qkv_rope_cache, and fp32 greedy tokens equal those of the path without it and of HF."""
    import gc

    from checkpoints import hf_greedy_generate, make_tiny_checkpoint
    from configs import SamplingParams
    from runner import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    path, hf = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa")
    prompts = [[5, 17, 99, 3, 42, 8, 250, 11, 64]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = hf_greedy_generate(hf, prompts, greedy.max_tokens, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        spy, calls = _spy()
        if not on:
            spy.norm_qkv_rope_cache = lambda *args, **kwargs: pytest.fail("fused RoPE path while off")
            monkeypatch.setattr(llama.SelfAttention, "cache_written_here", lambda self, hidden: None)
        monkeypatch.setattr(llama, "small_batch", lambda x: spy if layers.small_batch(x) is not None else None)
        llm = LLM(model=str(path), device="cuda", dtype="float32", cudagraph_mode=mode,
                  cudagraph_capture_sizes=[1, 2, 4], max_num_seqs=4, max_num_batched_tokens=256,
                  num_kv_blocks=64)
        tokens[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert (calls["norm_qkv_rope_cache"] > 0) == on
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        monkeypatch.undo()
    assert tokens[True] == tokens[False] == expected
