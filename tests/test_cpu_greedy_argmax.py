"""The CPU greedy path takes `max(dim=-1).indices` instead of `argmax` (half the time on the CI
CPU): it must pick the same index, including ties (first maximum), NaN, +-inf and one-column rows."""

from __future__ import annotations

import torch

from runner.sampler import argmax_rows


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
