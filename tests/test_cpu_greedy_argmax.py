"""The CPU greedy path takes `max(dim=-1).indices` instead of `argmax` (half the time on the CI
CPU): it must pick the same index, including ties (first maximum), NaN, +-inf and one-column rows."""

from __future__ import annotations

import torch

from runner.sampling import argmax_rows


def test_cpu_argmax_rows_matches_argmax():
    torch.manual_seed(0)
    logits = torch.randn(12, 49152)
    logits[0, [7, 100, 4000]] = 50.0                  # tie: the first of three maxima
    logits[1] = 0.0                                   # all equal: index 0
    logits[2, [10, 20]] = float("nan")                # NaN wins, first NaN
    logits[3, [30, 40]] = float("inf")                # +inf tie
    logits[4] = float("-inf")                         # all -inf: index 0
    logits[5, -1] = 60.0                              # the last column
    logits[6] = logits[6].round(decimals=1)           # many near ties
    got = argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(argmax_rows(logits[:, :1]), logits[:, :1].argmax(dim=-1))
    assert argmax_rows(logits[:0]).shape == (0,)


def _head(vocab: int, hidden: int, seed: int) -> "Linear":
    from models.layers import Linear
    head = Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)) * 0.13)
    return head


@torch.no_grad()   # not inference_mode: the weight is edited in place below, and its version must count
def test_screened_argmax_is_the_full_argmax(monkeypatch):
    """The bf16-screened LM head picks exactly the fp32 head's first maximum, near ties included (screened
    whether or not torch's bf16 product is the faster one on this CPU)."""
    from models import layers
    from models.layers import screened_argmax
    monkeypatch.setattr(layers, "_bf16_product_pays", lambda *args: True)
    head = _head(49152, 576, 0)
    g = torch.Generator().manual_seed(1)
    for rows in (16, 32, 64):
        for scale in (0.1, 1.0, 10.0):
            hidden = torch.randn(rows, 576, generator=g) * scale
            assert torch.equal(screened_argmax(hidden, head), head(hidden).max(dim=-1).indices)
    w = head.weight
    hidden = w[5000].repeat(32, 1) * 3 + torch.randn(32, 576, generator=g) * 0.01
    w[7] = w[5000]                                        # an exact tie: the first index wins
    w[100] = w[5000] * (1 + 2.0 ** -20)                  # closer than bf16 can tell apart
    w[40000] = w[5000] * (1 - 2.0 ** -20)
    logits = head(hidden)
    assert torch.equal(screened_argmax(hidden, head), logits.max(dim=-1).indices)
    top2 = logits.topk(2, dim=-1).values
    assert bool((top2[:, 0] - top2[:, 1] < 1e-3).all())  # the case tested: ties bf16 cannot resolve


@torch.no_grad()
def test_screened_argmax_declines_where_it_does_not_apply():
    from models.layers import screened_argmax
    head = _head(1000, 64, 2)
    assert screened_argmax(torch.randn(15, 64), head) is None           # too few rows
    assert screened_argmax(torch.randn(32, 64).double(), head) is None  # not fp32
    bad = torch.randn(32, 64)
    bad[3, 5] = float("nan")
    assert screened_argmax(bad, head) is None                           # non-finite rows: the full head
    biased = torch.nn.Linear(64, 1000)
    assert screened_argmax(torch.randn(32, 64), biased) is None
    hidden = torch.randn(32, 64)
    assert torch.equal(screened_argmax(hidden, head), head(hidden).max(dim=-1).indices)  # small vocab: padded ids


def test_a_head_screens_only_where_the_bf16_product_pays(monkeypatch):
    """A large head whose bf16 product is not faster than its fp32 one here (torch without a fast bf16
    GEMM for this CPU) is not screened: the full fp32 head runs."""
    from models import layers
    monkeypatch.setattr(layers, "_bf16_product_pays", lambda *args: False)
    head = _head(8192, 576, 3)
    assert head.weight.numel() >= layers.SCREEN_TIMED_SIZE
    with torch.no_grad():
        assert layers.screened_argmax(torch.randn(32, 576), head) is None
    small = _head(1000, 64, 2)   # too small to time: screened
    with torch.no_grad():
        assert layers.screened_argmax(torch.randn(32, 64), small) is not None


def test_screen_error_bound_holds():
    """|bf16 logit - fp32 logit| <= SCREEN_ERROR * ||h|| * ||w_j|| (the bound the screen relies on)."""
    import torch.nn.functional as F
    from models.layers import SCREEN_ERROR
    w = torch.randn(8192, 576, generator=torch.Generator().manual_seed(3))
    w[:100] *= 100                                   # rows of very different scales
    h = torch.randn(64, 576, generator=torch.Generator().manual_seed(4)) * 30
    error = (F.linear(h.bfloat16(), w.bfloat16()).float() - F.linear(h, w)).abs()
    assert bool((error <= SCREEN_ERROR * h.norm(dim=1, keepdim=True) * w.norm(dim=1)).all())
