"""models/cpu_kernels.py: the C RMSNorm of CPU decode steps against the torch reference (HF's rounding)."""

from __future__ import annotations

import pytest
import torch

from models import cpu_kernels
from models.layers import RMSNorm

needs_kernels = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler here")


def _norm(size: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = torch.randn(size, generator=torch.Generator().manual_seed(1))
    return norm


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(1, 576), (7, 576), (32, 576), (64, 2048), (3, 100)])
def test_c_rms_norm_matches_the_reference(rows, cols):
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
def test_c_rms_norm_declines_where_it_does_not_apply():
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


def test_kernels_switch_off(monkeypatch):
    monkeypatch.setenv("GRAPHRUNNER_CPU_KERNELS", "0")
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        with torch.inference_mode():
            assert cpu_kernels.add_rms_norm(torch.randn(2, 8), None, torch.ones(8), 1e-5) is None
    finally:
        monkeypatch.delenv("GRAPHRUNNER_CPU_KERNELS")
        cpu_kernels.library.cache_clear()


def test_no_compiler_keeps_the_torch_path(monkeypatch):
    from models import native_build
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
    finally:
        cpu_kernels.library.cache_clear()
