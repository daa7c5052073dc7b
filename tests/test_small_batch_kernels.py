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
def test_norm_linear(rows, k, n, residual, bias, dtype):
    _check_norm_linear(rows, k, n, dtype, residual, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("k, n", SMALL_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_norm_gate_up_silu(rows, k, n, residual, bias, dtype):
    _check_gate_up(rows, k, n, dtype, residual, bias)


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
    monkeypatch.setattr(sbk, "_num_sms", lambda index: 132)   # an H100's
    for rows in (1, 2, 16, 32):
        for n, k in ((960, 576), (1536, 576), (4096, 14336), (6144, 4096)):
            block_m, block_n, block_k, _ = sbk.block_sizes(rows, n, k, torch.bfloat16, cuda)
            assert block_m == (1 if rows == 1 else max(16, rows))
            assert block_n >= (4 if rows == 1 else 16) and block_k >= 16   # tl.dot's minimum
            assert block_n <= (8 if rows == 1 else 16) or -(-n // block_n) >= 2 * 132
    assert sbk.block_sizes(1, 4096, 14336, torch.bfloat16, cuda)[1:3] == (8, 1024)   # 512 programs
    assert sbk.block_sizes(1, 960, 576, torch.bfloat16, cuda)[1:3] == (8, 1024)      # SmolLM2 qkv: one K tile
    assert sbk.block_sizes(1, 1536, 576, torch.bfloat16, cuda, gated=True)[1:3] == (4, 1024)


# --- The model: the small-batch path on vs off -------------------------------------------------

def _spy():
    """The kernels module behind a namespace that counts calls."""
    calls = {"norm_linear": 0, "norm_gate_up_silu": 0, "linear": 0}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return getattr(sbk, name)(*args, **kwargs)
        return call
    return types.SimpleNamespace(**{name: counted(name) for name in calls}), calls


FAMILIES = [("llama_gqa", {}), ("qwen2", {}), ("qwen3", {})]   # plain, qkv bias, qk_norm + head_dim


PLANS = {"all": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, "attention": {"qkv_proj", "o_proj"},
         "mlp": {"gate_up_proj", "down_proj"}, "gemv_only": {"o_proj", "down_proj"}}
"""Which projections `fits_small_batch` admits: every mix the weight-size rule can produce."""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; the GPU runs "
                    "test_engine_greedy_tokens_same_with_small_batch_path_on_and_off")
@pytest.mark.parametrize("family, kwargs", FAMILIES)
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_model_logits_same_with_small_batch_path_forced(tmp_path, monkeypatch, family, kwargs, plan):
    """On a CPU through the interpreter: the model's own layers, with `small_batch` forced to answer
    the kernels (for any row count the kernels take) and `fits_small_batch` admitting the plan's
    projections, give the reference path's logits (fp32; a 13-token prefill and a 1-token one)."""
    from checkpoints import make_tiny_checkpoint
    from model_helpers import load_ours, prefill_logits

    path, _ = make_tiny_checkpoint(tmp_path / family, family, with_tokenizer=False, **kwargs)
    model = load_ours(path)
    batches = [[[5, 6, 7, 8, 9], [3], [10, 11, 12, 13, 14, 15, 16]], [[42]]]
    expected = [prefill_logits(model, prompts) for prompts in batches]

    spy, calls = _spy()
    names = {id(module): name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    monkeypatch.setattr(llama, "small_batch", lambda x: spy)
    monkeypatch.setattr(llama, "fits_small_batch", lambda layer: names[id(layer)] in PLANS[plan])
    got = [prefill_logits(model, prompts) for prompts in batches]
    layers_run = 2 * model.num_local_layers
    admitted = PLANS[plan]
    assert calls["norm_linear"] == (layers_run if "qkv_proj" in admitted else 0)
    assert calls["norm_gate_up_silu"] == (layers_run if "gate_up_proj" in admitted else 0)
    assert calls["linear"] == layers_run * len(admitted & {"o_proj", "down_proj"})
    for got_batch, expected_batch in zip(got, expected):
        for a, b in zip(got_batch, expected_batch):
            assert (a - b).abs().max().item() < 1e-4


def test_fits_small_batch_follows_weight_bytes(monkeypatch):
    small, large = torch.nn.Linear(64, 32), torch.nn.Linear(64, 4096)   # 8 KiB, 1 MiB of fp32
    monkeypatch.setattr(layers, "SMALL_BATCH_MAX_WEIGHT_BYTES", 64 << 10)
    assert layers.fits_small_batch(small) and not layers.fits_small_batch(large)


def test_cpu_never_takes_the_small_batch_path():
    assert layers.small_batch(torch.zeros(1, 8)) is None


# --- GPU only -------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_gate_follows_rows_and_switch(monkeypatch):
    x = torch.zeros(layers.SMALL_BATCH_MAX_ROWS, 8, device="cuda")
    assert layers.small_batch(x) is sbk
    assert layers.small_batch(torch.zeros(layers.SMALL_BATCH_MAX_ROWS + 1, 8, device="cuda")) is None
    monkeypatch.setenv("GRAPHRUNNER_SMALL_BATCH_KERNELS", "0")
    layers._small_batch_kernels.cache_clear()
    try:
        assert layers.small_batch(x) is None
    finally:
        monkeypatch.delenv("GRAPHRUNNER_SMALL_BATCH_KERNELS")
        layers._small_batch_kernels.cache_clear()


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
        tokens[on] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert (calls["norm_linear"] > 0) == on
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False] == expected
