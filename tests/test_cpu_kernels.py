"""The CPU C kernels against their torch twins: models/cpu_kernels.py (RMSNorm with HF's rounding, RoPE,
SiLU*mul, the LM-head screen) and attention/backends/cpu_decode_attention.py (the decode attention).

Every kernel test runs once per instruction set this CPU runs (`isa`: avx512, avx2, generic on an
AVX-512 machine; KernelConfig.cpu_isa caps the build), so a CPU with AVX-512 also checks the paths
CPUs without it take; none skips for lack of an instruction set (`generic` runs everywhere)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention.backends import cpu_decode_attention as c_attention
from configs import using_kernel_config
from launch import native_build
from models import cpu_kernels
from models.layers import RMSNorm

needs_kernels = pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler here")


@pytest.fixture(params=native_build.host_isas())
def isa(request):
    """The kernels built for each instruction set this CPU runs (KernelConfig.cpu_isa), in force for the test."""
    with using_kernel_config(cpu_isa=request.param):
        lib = cpu_kernels.library()
        if native_build.compiler() is not None:
            assert lib is not None and lib.isa == request.param and c_attention.library().isa == request.param
            assert bool(lib.gr_has_avx512()) == (request.param == "avx512")
        yield request.param


def _norm(size: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = torch.randn(size, generator=torch.Generator().manual_seed(1))
    return norm


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(1, 576), (7, 576), (32, 576), (64, 2048), (3, 100)])
def test_c_rms_norm_matches_the_reference(rows, cols, isa):
    """The residual sum is exact; the norm agrees with the torch reference to the last bits (only the
    sum of squares adds in another order)."""
    norm = _norm(cols)
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, cols, generator=gen) * 4, torch.randn(rows, cols, generator=gen)
    with torch.inference_mode():
        out, summed = cpu_kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
        ref_out, ref_summed = norm.reference(x, residual)
        assert torch.equal(summed, ref_summed)
        torch.testing.assert_close(out, ref_out, rtol=4e-7, atol=1e-6)
        alone = cpu_kernels.add_rms_norm(x, None, norm.weight, norm.eps)
        torch.testing.assert_close(alone, norm.reference(x), rtol=4e-7, atol=1e-6)
        got, got_residual = norm(x, residual)   # the module's CPU forward takes the C kernel
        assert torch.equal(got, out) and torch.equal(got_residual, summed)


@needs_kernels
def test_c_rms_norm_declines_where_it_does_not_apply(isa):
    norm = _norm(64)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        assert cpu_kernels.add_rms_norm(torch.randn(cpu_kernels.MAX_ROWS + 1, 64), None, norm.weight, 1e-5) is None
        assert cpu_kernels.add_rms_norm(x.double(), None, norm.weight.double(), 1e-5) is None
        assert cpu_kernels.add_rms_norm(torch.randn(64, 4).t(), None, norm.weight, 1e-5) is None  # not contiguous
        assert cpu_kernels.add_rms_norm(x, torch.randn(5, 64), norm.weight, 1e-5) is None       # shapes differ
        assert cpu_kernels.add_rms_norm(torch.randn(4, 32), None, norm.weight, 1e-5) is None     # weight size
    # With autograd recording, the reference path runs (gradients flow).
    y = torch.randn(4, 64, requires_grad=True)
    assert cpu_kernels.add_rms_norm(y, None, norm.weight, 1e-5) is None
    norm(y).sum().backward()
    assert y.grad is not None


def test_kernels_switch_off(kernel_switches):
    """KernelConfig.cpu_kernels=False: neither library is loaded, every op takes the torch path."""
    kernel_switches(cpu_kernels=False)
    assert cpu_kernels.library() is None and c_attention.library() is None
    assert not c_attention.native_attention()
    with torch.inference_mode():
        assert cpu_kernels.add_rms_norm(torch.randn(2, 8), None, torch.ones(8), 1e-5) is None


def test_no_compiler_keeps_the_torch_path(monkeypatch):
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    native_build.forget_loaded_libraries()
    try:
        assert cpu_kernels.library() is None and c_attention.library() is None
        assert not c_attention.native_attention()
    finally:
        native_build.forget_loaded_libraries()


# --- RoPE, SiLU*mul, the LM-head screen: the C pass against the torch ops it replaces ---------------

@needs_kernels
def test_c_rope_is_bit_identical_to_the_torch_rotation(isa):
    from transformers import LlamaConfig

    from models.rotary import RotaryEmbedding, _adjacent_heads, _rotate, _rotate_signed
    rotary = RotaryEmbedding(LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2), 512)
    gen = torch.Generator().manual_seed(3)
    tokens, hq, hk, dim = 24, 4, 2, 64
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, generator=gen) * 3
    q, k, _ = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    q, k = q.reshape(tokens, hq, dim), k.reshape(tokens, hk, dim)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    with torch.inference_mode():
        qk = _adjacent_heads(q, k)
        got = cpu_kernels.rope(qk, positions, rotary.cos_sin_cache)
        cos, sin, signed = rotary._tables(positions)
        assert torch.equal(got, _rotate_signed(qk, *signed))
        assert torch.equal(got, _rotate(qk, cos, sin, dim))   # HF's rounding
        rq, rk = rotary(positions, q, k)             # the module's CPU path takes the kernel
        assert torch.equal(rq, got[:, :hq]) and torch.equal(rk, got[:, hq:])
        with pytest.raises(IndexError, match="position 512 is outside the rotary table of 512"):
            cpu_kernels.rope(qk, torch.full((tokens,), 512), rotary.cos_sin_cache)
        assert cpu_kernels.rope(qk.double(), positions, rotary.cos_sin_cache) is None
        assert cpu_kernels.rope(qk, positions.int(), rotary.cos_sin_cache) is None


@needs_kernels
@pytest.mark.parametrize("rows,cols,scale", [(32, 1536, 4.0), (7, 1536, 30.0), (64, 2048, 1.0), (5, 100, 3.0),
                                             (3, 1031, 10.0)])
def test_c_silu_mul_is_bit_identical_to_torch(rows, cols, scale, isa):
    """An exp that rounds as torch's vector exp, on the chunks torch's loop takes: equal to the last bit,
    specials included, wherever the build has fused multiply-add (avx512, avx2, neon); a generic x86
    build (no FMA) within a few ulps."""
    gate_up = torch.randn(rows, 2 * cols, generator=torch.Generator().manual_seed(cols)) * scale
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 88.7, -88.7, -104.0, 200.0, float("inf"), float("-inf")])
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.inference_mode():
        got = cpu_kernels.silu_mul(gate_up)
        expected = torch.nn.functional.silu(gate) * up
        assert torch.equal(got.isnan(), expected.isnan())
        if cpu_kernels.library().gr_exp_is_sleefs():
            assert torch.equal(got.nan_to_num(), expected.nan_to_num())
        else:
            assert isa == "generic"
            torch.testing.assert_close(got.nan_to_num(), expected.nan_to_num(), rtol=4e-7, atol=1e-6)
        assert cpu_kernels.silu_mul(gate_up[:, :-1]) is None          # odd width: no gate/up halves


@pytest.mark.parametrize("vocab", [3000, 4103])   # column tasks of 2048, a tail that is not 16 lanes
def test_c_screen_finds_the_torch_screens_candidates(vocab, isa):
    from models.layers import _screen_candidates
    gen = torch.Generator().manual_seed(5)
    rows = 20
    approx = (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16)
    approx[:, 17] = approx[:, vocab - 3] = approx.float().amax(dim=1).to(torch.bfloat16)  # ties at the top
    slack = torch.rand(rows, generator=gen) * 0.05
    norms = torch.rand(vocab, generator=gen) + 0.5
    found = cpu_kernels.screen_candidates(approx, slack, norms, float(norms.max()))
    if cpu_kernels.library() is None:
        assert found is None
        return
    ids, candidates, floor = found
    expected_ids, expected_candidates, expected_floor = _screen_candidates(approx.float(), slack, norms,
                                                                           float(norms.max()))
    assert 17 in ids.tolist() and vocab - 3 in ids.tolist()
    assert torch.equal(ids, expected_ids) and torch.equal(candidates, expected_candidates)
    assert torch.equal(floor, expected_floor)
    assert cpu_kernels.screen_candidates(approx.float(), slack, norms, 1.0) is None   # fp32 logits: torch's passes


# --- decode attention over the paged cache ---------------------------------------------------------

def _decode_batch(context_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, seed):
    """A decode step (one new token a request) in a shuffled paged cache, with its new keys/values."""
    from tests.paged_batch import make_batch
    b = make_batch([1] * len(context_lens), context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, block_size=block_size, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    key, value = (torch.randn(len(context_lens), num_kv_heads, head_dim, generator=gen) for _ in range(2))
    return b, key, value


def _written(b, key, value):
    """The cache after this step's writes, in torch; slot -1 skipped."""
    cache = b.kv_cache.clone()
    flat = cache.view(2, -1, *cache.shape[3:])
    valid = b.slot_mapping >= 0
    flat[0, b.slot_mapping[valid]] = key[valid]
    flat[1, b.slot_mapping[valid]] = value[valid]
    return cache


@needs_kernels
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 64, 16), (8, 2, 128, 32), (6, 3, 32, 8), (4, 1, 48, 5), (2, 1, 24, 4)])
def test_c_decode_attention_matches_the_float64_reference(num_q_heads, num_kv_heads, head_dim, block_size, isa):
    from tests.paged_batch import reference_attention
    gen = torch.Generator().manual_seed(head_dim)
    context_lens = torch.randint(0, 90, (11,), generator=gen).tolist() + [0, 15, 16, 31, 32, 33]
    b, key, value = _decode_batch(context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, block_size=block_size, seed=head_dim + block_size)
    b.slot_mapping[3] = -1                     # a row that does not write: its slot keeps the old K/V
    expected_cache = _written(b, key, value)
    out = torch.full_like(b.query, float("nan"))
    with torch.inference_mode():
        assert c_attention.decode_attention(b.query, key, value, b.kv_cache, b.block_table, b.seq_lens,
                                            b.slot_mapping, b.scale, out)
    assert torch.equal(b.kv_cache, expected_cache)
    reference = reference_attention(dataclasses.replace(b, kv_cache=expected_cache))
    torch.testing.assert_close(out.double(), reference, atol=2e-6, rtol=2e-6)


@needs_kernels
def test_c_decode_attention_reads_strided_rows_and_is_the_same_on_one_thread(isa):
    """q, k, v as views of one qkv projection row (the model's layout); one thread or two, the same
    bits (each request is one thread's)."""
    b, _, _ = _decode_batch([40, 7, 100, 1], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=9)
    qkv = torch.randn(4, 15 * 64, generator=torch.Generator().manual_seed(10))
    q, key, value = (t.unflatten(1, (-1, 64)) for t in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1))
    cache = b.kv_cache.clone()
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (threads, 1):
            torch.set_num_threads(n)
            b.kv_cache.copy_(cache)
            outs.append(torch.empty(4, 9, 64))
            assert c_attention.decode_attention(q, key, value, b.kv_cache, b.block_table, b.seq_lens,
                                                b.slot_mapping, b.scale, outs[-1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    contiguous = torch.empty(4, 9, 64)
    b.kv_cache.copy_(cache)
    c_attention.decode_attention(q.contiguous(), key.contiguous(), value.contiguous(), b.kv_cache, b.block_table,
                                 b.seq_lens, b.slot_mapping, b.scale, contiguous)
    assert torch.equal(outs[0], contiguous)


@needs_kernels
def test_c_decode_attention_refuses_out_of_range_indices_and_writes_nothing(isa):
    b, key, value = _decode_batch([5, 20], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=3)
    cache = b.kv_cache.clone()
    out = torch.empty_like(b.query)
    num_blocks = b.kv_cache.shape[1]
    for field, bad, message in [("slot_mapping", num_blocks * 4, "a slot"), ("seq_lens", 10 ** 6, "a sequence length"),
                                ("block_table", num_blocks, "a block id")]:
        tensor = getattr(b, field)
        saved = tensor.clone()
        tensor.view(-1)[0] = bad
        with pytest.raises(IndexError, match=message):
            c_attention.decode_attention(b.query, key, value, b.kv_cache, b.block_table, b.seq_lens, b.slot_mapping,
                                         b.scale, out)
        assert torch.equal(b.kv_cache, cache)
        tensor.copy_(saved)


def test_c_decode_attention_declines_what_it_does_not_cover():
    b, key, value = _decode_batch([5, 20], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=4)
    out = torch.empty_like(b.query)
    args = (b.kv_cache, b.block_table, b.seq_lens, b.slot_mapping, b.scale)
    assert not c_attention.decode_attention(b.query.double(), key, value, *args, out.double())
    assert not c_attention.decode_attention(b.query.transpose(0, 1).contiguous().transpose(0, 1), key, value,
                                            *args, out)                        # heads not contiguous in a row
    assert not c_attention.decode_attention(b.query, key, value, b.kv_cache, b.block_table.long(), *args[2:], out)
    narrow = _decode_batch([5], num_q_heads=2, num_kv_heads=1, head_dim=20, block_size=4, seed=5)[0]
    assert not c_attention.decode_attention(narrow.query, narrow.query[:, :1], narrow.query[:, :1], narrow.kv_cache,
                                            narrow.block_table, narrow.seq_lens, narrow.slot_mapping, 1.0,
                                            torch.empty_like(narrow.query))       # head_dim 20: not 8 lanes


def _backend_decode(b, key, value, native: bool, monkeypatch, layer_key=None):
    """TorchSDPABackend.forward on the decode batch `b`, with the C path allowed or not; (out, cache)."""
    from types import SimpleNamespace

    from attention.backends.torch_sdpa import TorchSDPABackend
    from attention.metadata import CommonAttentionMetadata
    monkeypatch.setattr(c_attention, "native_attention", lambda: native)
    reqs = b.seq_lens.shape[0]
    common = CommonAttentionMetadata(
        query_start_loc=b.query_start_loc, query_start_loc_cpu=b.query_start_loc, seq_lens=b.seq_lens,
        seq_lens_cpu=b.seq_lens, num_computed_tokens_cpu=b.seq_lens - 1, block_table=b.block_table,
        slot_mapping=b.slot_mapping, token_request_index=torch.arange(reqs, dtype=torch.int32), num_reqs=reqs,
        num_actual_tokens=reqs, max_query_len=1, max_seq_len=int(b.seq_lens.max()), uniform_decode=True)
    backend = TorchSDPABackend()
    metadata = backend.build_metadata(common)
    layer = SimpleNamespace(num_heads=b.query.shape[1], num_kv_heads=key.shape[1], head_dim=key.shape[2],
                            scale=b.scale)
    cache, out = b.kv_cache.clone(), torch.full_like(b.query, float("nan"))
    with torch.inference_mode():
        backend.forward(layer, b.query, key if layer_key is None else layer_key, value, out, cache, metadata)
    return out, cache, metadata


@needs_kernels
def test_backend_decode_step_takes_the_c_kernel_and_agrees_with_the_torch_path(monkeypatch, isa):
    b, key, value = _decode_batch([40, 7, 100, 1, 63], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                                  seed=21)
    native_out, native_cache, metadata = _backend_decode(b, key, value, True, monkeypatch)
    assert next(iter(metadata.layouts.values())).native_decode
    torch_out, torch_cache, metadata = _backend_decode(b, key, value, False, monkeypatch)
    assert not next(iter(metadata.layouts.values())).native_decode
    assert torch.equal(native_cache, torch_cache)
    torch.testing.assert_close(native_out, torch_out, atol=2e-6, rtol=2e-6)
    # A layer whose tensors the kernel declines (heads not contiguous within a key row) falls back to torch's.
    odd_key = key.transpose(0, 1).contiguous().transpose(0, 1)
    out, cache, metadata = _backend_decode(b, key, value, True, monkeypatch, layer_key=odd_key)
    assert not next(iter(metadata.layouts.values())).native_decode
    assert torch.equal(cache, torch_cache) and torch.equal(out, torch_out)


@needs_kernels
def test_a_compiler_without_openmp_builds_the_same_kernels_for_one_core(monkeypatch, tmp_path):
    """No libgomp to link (-fopenmp fails): the build is retried without it, and the kernels still
    answer the same (the parallel loop just runs on one thread)."""
    import subprocess

    real, tried = native_build.compile_shared, []

    def no_openmp(name, source, cc, flags, *args, **kwargs):
        tried.append("-fopenmp" in flags)
        if "-fopenmp" in flags:
            raise subprocess.CalledProcessError(1, cc, stderr="cannot find -lgomp")
        return real(name, source, cc, flags, *args, **{**kwargs, "out_dir": tmp_path})

    b, key, value = _decode_batch([40, 7, 100], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, seed=31)
    cache = b.kv_cache.clone()
    expected = torch.empty_like(b.query)
    with torch.inference_mode():
        native = c_attention.decode_attention(b.query, key, value, b.kv_cache, b.block_table, b.seq_lens,
                                              b.slot_mapping, b.scale, expected)
        monkeypatch.setattr(native_build, "compile_shared", no_openmp)
        native_build.forget_loaded_libraries()
        try:
            assert c_attention.library() is not None and tried == [True, False]
            got = torch.empty_like(b.query)
            b.kv_cache.copy_(cache)
            assert c_attention.decode_attention(b.query, key, value, b.kv_cache, b.block_table, b.seq_lens,
                                                b.slot_mapping, b.scale, got) == native
        finally:
            native_build.forget_loaded_libraries()
    assert native and torch.equal(got, expected)


@needs_kernels
def test_every_instruction_set_gives_the_same_norm_rope_and_screen(tmp_path):
    """The builds without AVX-512 (portable C, vectorised by the compiler for AVX2 or the baseline) answer
    bit for bit what the AVX-512 one does for the kernels that are exact, each from its own cached file."""
    from models.layers import _screen_candidates
    from models.rotary import _rotate
    gen = torch.Generator().manual_seed(41)
    x, residual, weight = torch.randn(9, 200, generator=gen), torch.randn(9, 200, generator=gen), torch.randn(200)
    qk = torch.randn(9, 5, 64, generator=gen)
    positions = torch.randint(0, 100, (9,), generator=gen)
    table = torch.randn(100, 64, generator=gen)
    approx = (torch.randn(20, 3001, generator=gen) * 3).to(torch.bfloat16)
    slack, norms = torch.rand(20, generator=gen) * 0.05, torch.rand(3001, generator=gen) + 0.5
    results = {}
    for isa in native_build.host_isas():
        with using_kernel_config(cpu_isa=isa), torch.inference_mode():
            assert cpu_kernels.library().isa == isa
            results[isa] = (*cpu_kernels.add_rms_norm(x, residual, weight, 1e-5), cpu_kernels.rope(qk, positions, table),
                            *cpu_kernels.screen_candidates(approx, slack, norms, float(norms.max())))
    first = results[native_build.host_isas()[0]]
    assert all(all(torch.equal(a, b) for a, b in zip(first, got)) for got in results.values())
    cos, sin = table[positions].chunk(2, dim=-1)
    assert torch.equal(first[2], _rotate(qk, cos[:, None], sin[:, None], 64))
    assert all(torch.equal(a, b) for a, b in zip(first[3:], _screen_candidates(approx.float(), slack, norms,
                                                                               float(norms.max()))))
    built = {native_build.build_cpu_library("cpu_kernels", cpu_kernels._SOURCE, native_build.compiler(),
                                            cpu_kernels.SIGNATURES, isa, out_dir=tmp_path).isa
             for isa in native_build.host_isas()}
    assert built == set(native_build.host_isas())
    assert len(list(tmp_path.glob("cpu_kernels_*.so"))) == len(built)     # one cached file per instruction set


def test_the_isa_cap_takes_the_best_the_cpu_runs_at_or_below_it(monkeypatch, caplog):
    """KernelConfig.cpu_isa caps the instruction set: the best one the CPU runs at or below the cap; a
    cap of another architecture, or a CPU with none of the vector sets, leaves generic. Logged once."""
    import logging
    monkeypatch.setattr(native_build, "machine", lambda: "x86_64")
    avx2_host = ("avx2", "generic")
    native_build._chosen_isa.cache_clear()
    with caplog.at_level(logging.INFO, logger="launch.native_build"):
        assert [native_build._chosen_isa(cap, avx2_host) for cap in ("auto", "avx512", "avx2", "generic", "neon")] \
            == ["avx2", "avx2", "avx2", "generic", "generic"]
        assert native_build._chosen_isa("auto", avx2_host) == "avx2"
    assert sum("instruction set avx2" in r.getMessage() and "cpu_isa=auto" in r.getMessage()
               for r in caplog.records) == 1
    assert native_build._chosen_isa("auto", ("generic",)) == "generic"
    monkeypatch.setattr(native_build, "machine", lambda: "aarch64")
    assert native_build._chosen_isa("auto", ("neon", "generic")) == "neon"
    assert native_build._chosen_isa("avx2", ("neon", "generic")) == "generic"
    assert native_build.isa_flags("generic") == ["-march=armv8-a+nosimd"]
    with pytest.raises(ValueError, match="cpu_isa"):
        from configs import KernelConfig
        KernelConfig(cpu_isa="sse4")


EXP_CHECK = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <immintrin.h>
int main(int argc, char** argv) {
    __m256 (*sleef)(__m256) = (__m256 (*)(__m256))dlsym(dlopen(argv[1], RTLD_NOW), "Sleef_expf8_u10");
    uint64_t stride = strtoull(argv[2], 0, 10), checked = 0, differ = 0;
    float in[8], mine[8], theirs[8];
    for (uint64_t bits = 0; bits < (1ull << 32); bits += 8 * stride) {
        for (int j = 0; j < 8; j++) {
            uint32_t b = (uint32_t)(bits + j * stride);
            memcpy(in + j, &b, 4);
            mine[j] = gr_exp(in[j]);
        }
        _mm256_storeu_ps(theirs, sleef(_mm256_loadu_ps(in)));
        for (int j = 0; j < 8; j++, checked++)
            differ += memcmp(mine + j, theirs + j, 4) != 0 && !(mine[j] != mine[j] && theirs[j] != theirs[j]);
    }
    printf("%llu %llu\n", (unsigned long long)checked, (unsigned long long)differ);
    return 0;
}
"""


@needs_kernels
@pytest.mark.skipif("avx2" not in native_build.host_isas(), reason="calls torch's AVX2 Sleef exp")
def test_the_portable_exp_is_torchs_vector_exp_bit_for_bit(tmp_path):
    """native_build's gr_exp built with fused multiply-add against libtorch's own Sleef_expf8_u10 (the
    AVX2 twin of the AVX-512 exp torch's kernels call) on every 61st float bit pattern, specials
    included (stride = 1 checks all 2^32: equal, ~1 minute on one core)."""
    import os
    import subprocess
    stride = 61
    source = tmp_path / "exp_check.c"
    source.write_text(native_build.CPU_PREAMBLE + EXP_CHECK)
    binary = tmp_path / "exp_check"
    subprocess.run([native_build.compiler(), "-O2", *native_build.ISA_FLAGS["avx2"], "-ffp-contract=off",
                    "-fno-math-errno", "-fno-trapping-math", str(source), "-o", str(binary), "-ldl"], check=True)
    torch_cpu = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    checked, differ = map(int, subprocess.run([str(binary), torch_cpu, str(stride)], check=True, capture_output=True,
                                              text=True).stdout.split())
    assert checked > (1 << 32) // stride - 8 and differ == 0
