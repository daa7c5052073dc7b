"""runner/sampling/threshold_kernel.py: the one-launch min-p / top-k / top-p thresholds equal the
torch path of the sampler (`Sampler.threshold` on a CPU, the reference) on random batches: ties
(also with the k-th value past the candidates), top_k past the vocabulary, each filter alone and
mixed, greedy rows beside random ones, -inf logits and rows of -inf only, float32 and bf16 logits,
the top-k candidates (from torch.topk and from runner/sampling/logits_pass.py's lists) and the
full sort. In Triton's interpreter here; on a GPU (cuda marker) the
kernel against the same CPU reference, and the sampler's GPU path with the kernel against it."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")

from configs import SamplingParams  # noqa: E402
from runner.sampling import Sampler, SamplingMetadata  # noqa: E402

sampler = Sampler()


def _params(rng: random.Random, vocab: int, kind: str) -> SamplingParams:
    """One row's settings: `kind` picks which filters it may use."""
    top_k = rng.choice([-1, 0, 1, 2, 3, 7, 50, vocab, vocab + 5]) if kind in ("mixed", "top_k") else 0
    top_p = rng.choice([1.0, 0.3, 0.5, 0.77, 0.9, 0.99]) if kind in ("mixed", "top_p") else 1.0
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3, 1.0]) if kind in ("mixed", "min_p") else 0.0
    temperature = rng.choice([0.0, 0.3, 0.8, 1.0, 1.7])
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def _logits(gen: torch.Generator, rows: int, vocab: int, case: int) -> torch.Tensor:
    """Few distinct values (many ties) or Gaussian ones, some -inf, every 5th batch a row of -inf."""
    if case % 2:
        x = torch.randint(-6, 7, (rows, vocab), generator=gen).float() / 2
    else:
        x = torch.randn(rows, vocab, generator=gen) * 3
    x[torch.rand(rows, vocab, generator=gen) < 0.1] = float("-inf")
    if case % 5 == 0:
        x[-1] = float("-inf")
    return x.bfloat16() if case % 3 == 0 else x


def _cases(count: int):
    """(logits, params, full_sort) of `count` random batches (CPU logits); `full_sort`: the
    candidates are the whole vocabulary, as when another row asks for top-p without top-k."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    kinds = ["mixed", "mixed", "top_k", "top_p", "min_p"]
    for case in range(count):
        vocab = rng.choice([9, 40, 300, 3000])
        rows = rng.randint(1, 6)
        kind = kinds[case % len(kinds)]
        yield _logits(gen, rows, vocab, case), [_params(rng, vocab, kind) for _ in range(rows)], case % 7 == 0


def _metadata(params: list[SamplingParams], full_sort: bool, device: str) -> SamplingMetadata:
    metadata = SamplingMetadata.from_params(params, {}, device)
    if full_sort and not metadata.no_top_k:
        metadata.candidates = 0
    return metadata


def _kernel_thresholds(logits: torch.Tensor, metadata: SamplingMetadata, via_pass: bool = False) -> torch.Tensor:
    """The kernel's thresholds from torch.topk's candidates, or `via_pass` those the sort of
    runner/sampling/logits_pass.py computes from its lists (where they apply: top-k candidates past
    1 and up to its most)."""
    from runner.sampling.logits_pass import logits_pass
    from runner.sampling.threshold_kernel import thresholds
    if via_pass:
        k = Sampler._top_count(metadata, logits.shape[-1])
        settings = (metadata.scale, metadata.min_p_offset, metadata.top_k, metadata.top_p)
        return logits_pass(logits, None, None, k + 1, settings=settings).threshold
    values, k = Sampler._candidates(logits, metadata, extra=1)
    return thresholds(values, k, logits, metadata.scale, metadata.min_p_offset, metadata.top_k, metadata.top_p)


def _pass_applies(logits: torch.Tensor, metadata: SamplingMetadata) -> bool:
    from runner.sampling.logits_pass import MAX_CANDIDATES
    k = Sampler._top_count(metadata, logits.shape[-1])
    return 0 < k < logits.shape[-1] and k + 1 <= MAX_CANDIDATES


def _close_call(x: torch.Tensor, params: SamplingParams) -> bool:
    """Whether the row's top-p or min-p cut lands within rounding of a boundary (in float64), where
    sums taken in another order may keep one tie group more or less."""
    x = x.double()
    x = x[torch.isfinite(x)]
    if x.numel() == 0:
        return False
    scale = params.temperature if params.temperature >= 1e-5 else 1.0
    top = x.max()
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.min_p > 0:
        cut = top + scale * torch.tensor(params.min_p, dtype=torch.float32).double().log()
        if ((x - cut).abs() < 1e-5).any():
            return True
        keep = x >= cut
    if 0 < params.top_k < int(keep.sum()):
        keep &= x >= x[keep].sort(descending=True).values[params.top_k - 1]
    weights = torch.where(keep, torch.exp((x - top) / scale), 0.0)
    total = weights.sum()
    above = torch.stack([weights[x > v].sum() for v in x[keep].unique()])
    return bool(((above - params.top_p * total).abs() <= 1e-5 * total).any())


def _check(device: str, count: int, pass_every: int = 1):
    """`count` random batches through the kernel with torch.topk's candidates, and every
    `pass_every`-th one (where it applies) with the pass's lists too."""
    checked = exact = via_pass = 0
    for case, (logits, params, full_sort) in enumerate(_cases(count)):
        want = sampler.threshold(logits, _metadata(params, full_sort, "cpu"))   # the torch path on the CPU
        if want is None:
            continue
        metadata = _metadata(params, full_sort, device)
        ways = [False] + ([True] if case % pass_every == 0 and _pass_applies(logits, metadata) else [])
        for way in ways:
            got = _kernel_thresholds(logits.to(device), metadata, way).cpu()
            assert got.shape == want.shape and got.dtype == torch.float32
            for row, p in enumerate(params):
                if not torch.equal(got[row], want[row]):
                    assert _close_call(logits[row], p), (logits[row], p, got[row], want[row], way)
                else:
                    exact += 1
            checked += len(params)
            via_pass += way
    assert checked > count and exact > 0.99 * checked and via_pass >= count // (20 * pass_every)


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # rows of -inf: -inf - -inf
def test_threshold_kernel_equals_the_torch_path_in_the_interpreter():
    _check("cpu", 300, pass_every=10)


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_ties_past_the_candidates_count_in_the_renormalisation():
    """Top-k 2 of [3, 2, 2, 2, 2, ...]: the second value ties with tokens past the candidates, so
    top-p renormalises over all of them (keeping the tie group whole)."""
    x = torch.tensor([[3.0, 2.0, 2.0, 2.0, 2.0, 0.0, -1.0, 2.0]])
    for top_p in (0.3, 0.4, 0.9):
        metadata = SamplingMetadata.from_params([SamplingParams(top_k=2, top_p=top_p)], {}, "cpu")
        assert torch.equal(_kernel_thresholds(x, metadata), sampler.threshold(x, metadata))


@pytest.mark.cuda
def test_threshold_kernel_on_the_gpu(kernel_switches):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check("cuda", 1000)
    # The sampler's GPU path takes the kernel when switched on; its thresholds equal the torch path's.
    kernel_switches(triton_sampling=True)
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, 128256, generator=gen) * 3).bfloat16()
    params = [SamplingParams(temperature=0.0 if i % 9 == 0 else 0.8, top_k=[50, 0, 1, 20][i % 4],
                             top_p=[0.9, 1.0, 0.5][i % 3], min_p=[0.0, 0.1][i % 2]) for i in range(64)]
    want = sampler.threshold(logits, SamplingMetadata.from_params(params, {}, "cpu"))
    got = sampler.threshold(logits.cuda(), SamplingMetadata.from_params(params, {}, "cuda")).cpu()
    for row, p in enumerate(params):
        assert torch.equal(got[row], want[row]) or _close_call(logits[row], p)
