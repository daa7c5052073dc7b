"""Sampler tests (CPU, fast). Statistical checks draw many identical rows in one call."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from configs.sampling_params import SamplingParams
from runner.sampling import Sampler, SamplingMetadata, make_generator

CPU = torch.device("cpu")
sampler = Sampler()


@pytest.fixture(autouse=True)
def _seed_default_generator():
    torch.manual_seed(0)


def meta(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, generators or {}, CPU)


def frequencies(logits_row: torch.Tensor, params: SamplingParams, n: int = 20000) -> torch.Tensor:
    """Empirical token frequencies from n identical rows sampled in one call."""
    out = sampler(logits_row.expand(n, -1).contiguous(), meta([params] * n))
    return torch.bincount(out.sampled_token_ids, minlength=logits_row.numel()).double() / n


def support(logits_row: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens left unmasked by the filters (exact, no sampling)."""
    x = sampler.masked_logits(logits_row.unsqueeze(0), meta([params]))[0]
    return set(torch.nonzero(torch.isfinite(x)).flatten().tolist())


# ---------------------------------------------------------------- metadata

def test_from_params_flags_and_tensors():
    params = [SamplingParams(temperature=0.0, seed=1), SamplingParams(top_k=-1, logprobs=3),
              SamplingParams(top_k=5, top_p=0.9, min_p=0.1, logprobs=1)]
    gens = {0: make_generator(1, CPU), 2: make_generator(2, CPU)}
    m = SamplingMetadata.from_params(params, gens, CPU)
    assert m.temperature.dtype == torch.float32 and m.top_k.dtype == torch.int64
    assert m.top_k.tolist() == [0, 0, 5]
    assert not m.all_greedy and not m.all_random
    assert not m.no_top_k and not m.no_top_p and not m.no_min_p
    assert set(m.generators) == {2}  # greedy rows draw nothing
    assert m.max_num_logprobs == 3
    m2 = meta([SamplingParams(), SamplingParams(top_k=0)])
    assert m2.all_random and m2.no_top_k and m2.no_top_p and m2.no_min_p
    assert m2.max_num_logprobs is None


@pytest.mark.parametrize("rows", [1, 3, 14, 16, 17])
def test_every_metadata_field_starts_16_byte_aligned(rows):
    """Triton compiles a variant per pointer alignment: the fields of any batch size start 16-byte
    aligned (views into padded uploads), so the kernels compiled ahead serve every batch."""
    params = [SamplingParams(temperature=0.5 + i % 3, top_k=i % 4, top_p=0.9, min_p=0.05) for i in range(rows)]
    m = meta(params)
    for name in ("temperature", "top_k", "top_p", "min_p", "greedy", "scale", "min_p_offset", "top_p_column",
                 "top_p_on", "top_k_on", "top_k_index"):
        field = getattr(m, name)
        assert field.data_ptr() % 16 == 0 and field.shape[0] == rows, name
    assert m.scale[:, 0].tolist() == pytest.approx([p.temperature for p in params])
    assert m.top_k.tolist() == [p.top_k for p in params]


# ---------------------------------------------------------------- greedy

def test_greedy_is_argmax_and_input_untouched():
    logits = torch.randn(16, 50)
    before = logits.clone()
    out = sampler(logits, meta([SamplingParams(temperature=0.0)] * 16))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_mixed_greedy_and_random_rows():
    n, vocab = 64, 1000
    logits = torch.randn(n, vocab)
    logits[1::2] = 0.0  # random rows are flat: they hit the argmax (token 0) with prob 1/V
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(n)]
    before = logits.clone()
    ids = sampler(logits, meta(params)).sampled_token_ids
    assert torch.equal(ids[0::2], logits[0::2].argmax(-1))
    assert (ids[1::2] != 0).sum() >= 28  # random rows really are random
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- seeds

def run_seeded(seed: int, row: int, batch: int, steps: int, vocab: int = 1000) -> list[int]:
    """Samples `steps` tokens for a seeded request sitting at `row` of a noisy batch."""
    gen = make_generator(seed, CPU)
    params = [SamplingParams(temperature=0.7) for _ in range(batch)]
    params[row] = SamplingParams(temperature=1.0, seed=seed)
    logits = torch.zeros(batch, vocab)
    tokens = []
    for step in range(steps):
        other = torch.randn(batch, vocab)  # the rest of the batch changes every step
        other[row] = logits[row]
        # other seeded rows with their own generators must not disturb this one
        gens = {row: gen, **{r: make_generator(100 + r + step, CPU) for r in range(batch) if r != row}}
        tokens.append(sampler(other, meta(params, gens)).sampled_token_ids[row].item())
    return tokens


def test_seed_reproducible_across_batch_composition_and_row():
    alone = run_seeded(seed=42, row=0, batch=1, steps=12)
    assert len(set(alone)) > 1  # the generator advances between steps
    assert run_seeded(seed=42, row=3, batch=6, steps=12) == alone
    assert run_seeded(seed=42, row=0, batch=9, steps=12) == alone
    assert run_seeded(seed=43, row=0, batch=1, steps=12) != alone


def test_seeded_row_ignores_default_generator():
    logits = torch.zeros(2, 1000)
    params = [SamplingParams(seed=7), SamplingParams()]
    torch.manual_seed(1)
    a = sampler(logits, meta(params, {0: make_generator(7, CPU)})).sampled_token_ids
    torch.manual_seed(2)
    b = sampler(logits, meta(params, {0: make_generator(7, CPU)})).sampled_token_ids
    assert a[0] == b[0]


# ---------------------------------------------------------------- temperature

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])


def test_temperature_one_matches_softmax():
    freq = frequencies(LOGITS, SamplingParams(temperature=1.0))
    assert (freq - torch.softmax(LOGITS.double(), -1)).abs().max() < 0.015


def test_temperature_scales_distribution():
    freq = frequencies(LOGITS, SamplingParams(temperature=0.5))
    assert (freq - torch.softmax(LOGITS.double() / 0.5, -1)).abs().max() < 0.015


def test_low_temperature_concentrates_on_argmax():
    assert frequencies(LOGITS, SamplingParams(temperature=0.05))[0] > 0.99


def test_high_temperature_flattens():
    freq = frequencies(LOGITS, SamplingParams(temperature=100.0))
    assert (freq - 1.0 / LOGITS.numel()).abs().max() < 0.015


# ---------------------------------------------------------------- filters

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
# Shuffled so that "largest" is not "first": token ids 3, 0, 5, 1, 4, 2 hold PROBS in order.
PERM = torch.tensor([3, 0, 5, 1, 4, 2])
SHUF = torch.empty(6).scatter_(0, PERM, PROBS.log())


def by_rank(*ranks: int) -> set[int]:
    return {PERM[r].item() for r in ranks}


def check_sampled_set(params: SamplingParams, ranks: tuple[int, ...]):
    """The filters keep exactly `ranks`, and sampling follows the renormalized probs."""
    assert support(SHUF, params) == by_rank(*ranks)
    freq = frequencies(SHUF, params)
    expected = torch.zeros(6, dtype=torch.float64)
    kept = PROBS[list(ranks)].double()
    expected[PERM[list(ranks)]] = kept / kept.sum()
    assert (freq - expected).abs().max() < 0.015


@pytest.mark.parametrize("k, ranks", [(1, (0,)), (3, (0, 1, 2)), (6, tuple(range(6))),
                                      (100, tuple(range(6))), (0, tuple(range(6))),
                                      (-1, tuple(range(6)))])
def test_top_k(k, ranks):
    check_sampled_set(SamplingParams(top_k=k), ranks)


# Inclusive rule: keep the smallest most-likely-first prefix whose mass is >= top_p.
@pytest.mark.parametrize("p, ranks", [(0.1, (0,)), (0.39, (0,)), (0.5, (0, 1)),
                                      (0.7, (0, 1, 2)), (0.95, (0, 1, 2, 3, 4)),
                                      (1.0, tuple(range(6)))])
def test_top_p(p, ranks):
    check_sampled_set(SamplingParams(top_p=p), ranks)


# min-p drops tokens with prob < min_p * max_prob (0.4 here).
@pytest.mark.parametrize("mp, ranks", [(0.0, tuple(range(6))), (0.2, (0, 1, 2, 3)),
                                       (0.5, (0, 1)), (1.0, (0,))])
def test_min_p(mp, ranks):
    check_sampled_set(SamplingParams(min_p=mp), ranks)


def test_combined_filters():
    # min-p 0.2 keeps ranks 0-3 (mass 0.9); top-k 3 keeps 0-2 (renormalized 0.5, 0.3125,
    # 0.1875); top-p 0.7 over that keeps 0-1 (0.8125 >= 0.7).
    check_sampled_set(SamplingParams(min_p=0.2, top_k=3, top_p=0.7), (0, 1))
    check_sampled_set(SamplingParams(min_p=0.2, top_k=3, top_p=0.85), (0, 1, 2))
    # 0.5 >= 0.48 only after renormalizing over the top-k (0.4 / 0.9 < 0.48 before it).
    check_sampled_set(SamplingParams(min_p=0.2, top_k=3, top_p=0.48), (0,))


def test_filters_are_per_row():
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.5), SamplingParams(min_p=0.5),
              SamplingParams(), SamplingParams(temperature=0.0, top_k=2)]
    x = sampler.masked_logits(SHUF.expand(5, -1), meta(params))
    kept = [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in x]
    assert kept[:4] == [by_rank(0), by_rank(0, 1), by_rank(0, 1), by_rank(*range(6))]


def reference_support(logits: list[float], temp: float, top_k: int, top_p: float,
                      min_p: float) -> tuple[set[int], bool]:
    """Pure-Python filters in float64; also says whether a threshold is too close to call."""
    x = [v / temp for v in logits]
    m = max(x)
    z = sum(math.exp(v - m) for v in x)
    probs = [math.exp(v - m) / z for v in x]
    keep = {i for i, p in enumerate(probs) if p >= min_p * max(probs)}
    close = any(abs(p - min_p * max(probs)) < 1e-4 for p in probs)
    order = sorted(keep, key=lambda i: -probs[i])
    if top_k > 0:
        order = order[:top_k]
    if top_p >= 1.0:
        return set(order), close
    mass = sum(probs[i] for i in order)
    kept, acc = [], 0.0
    for i in order:
        if acc >= top_p:
            break
        kept.append(i)
        acc += probs[i] / mass
        close |= abs(acc - top_p) < 1e-4
    return set(kept), close


@settings(max_examples=150, deadline=None)
@given(ints=st.lists(st.integers(-50, 50), min_size=2, max_size=20, unique=True),
       temp=st.floats(0.2, 3.0), top_k=st.integers(-1, 12), top_p=st.integers(5, 100).map(lambda v: v / 100),
       min_p=st.sampled_from([0.0, 0.05, 0.2, 0.6]))
def test_filters_match_reference(ints, temp, top_k, top_p, min_p):
    logits = [i / 10 for i in ints]  # distinct logits: no top-k ties
    expected, too_close = reference_support(logits, temp, top_k, top_p, min_p)
    assume(not too_close)
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    assert support(torch.tensor(logits), params) == expected


# ---------------------------------------------------------------- logprobs

def test_logprobs_are_raw_and_consistent():
    n, vocab, k = 12, 40, 5
    logits = torch.randn(n, vocab) * 3
    params = [SamplingParams(temperature=0.0 if i < 4 else 0.6, top_k=7 if i % 3 else 0,
                             logprobs=k if i % 2 else None) for i in range(n)]
    out = sampler(logits, meta(params))
    lp, ids = out.logprobs, out.sampled_token_ids
    raw = torch.log_softmax(logits, -1)  # raw: before temperature and filters
    assert lp.sampled_logprobs.shape == (n,) and lp.sampled_ranks.shape == (n,)
    assert lp.topk_token_ids.shape == (n, k) and lp.topk_logprobs.shape == (n, k)
    assert lp.topk_token_ids.dtype == torch.int64 and lp.sampled_ranks.dtype == torch.int64
    torch.testing.assert_close(lp.sampled_logprobs, raw.gather(1, ids[:, None]).squeeze(1))
    torch.testing.assert_close(lp.topk_logprobs, raw.gather(1, lp.topk_token_ids))
    assert (lp.topk_logprobs[:, :-1] >= lp.topk_logprobs[:, 1:]).all()
    assert torch.equal(lp.topk_token_ids[:, 0], logits.argmax(-1))
    for i in range(n):
        rank = 1 + int((raw[i] > raw[i, ids[i]]).sum())
        assert lp.sampled_ranks[i] == rank
        if ids[i] in lp.topk_token_ids[i]:
            assert lp.topk_token_ids[i, rank - 1] == ids[i]
    assert (lp.sampled_ranks[:4] == 1).all()  # greedy rows sample the top token


def test_logprobs_zero_means_sampled_token_only():
    out = sampler(torch.randn(3, 10), meta([SamplingParams(logprobs=0)] * 3))
    assert out.logprobs.topk_token_ids.shape == (3, 0)
    assert out.logprobs.sampled_logprobs.shape == (3,)


def test_rank_of_tied_top_token_is_one():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    out = sampler(logits, meta([SamplingParams(temperature=0.0, logprobs=2)]))
    assert out.sampled_token_ids.item() == 1 and out.logprobs.sampled_ranks.item() == 1


# ---------------------------------------------------------------- thresholds from the largest values

def reference_tied_support(x: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Filters over scaled logits with ties, in float64: min-p, top-k keeping every token tied with
    the k-th value, top-p keeping a token when the renormalized mass strictly above its value is
    < top_p (so a group of equal values is kept or dropped whole)."""
    m = max(x)
    probs = [math.exp(v - m) for v in x]
    keep = [i for i, p in enumerate(probs) if p >= min_p * max(probs)]
    if top_k > 0 and len(keep) > top_k:
        kth = sorted((x[i] for i in keep), reverse=True)[top_k - 1]
        keep = [i for i in keep if x[i] >= kth]
    if top_p >= 1.0:
        return set(keep)
    z = sum(probs[i] for i in keep)
    return {i for i in keep if sum(probs[j] for j in keep if x[j] > x[i]) < top_p * z}


@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.integers(0, 6), min_size=8, max_size=60), top_k=st.integers(0, 6),
       top_p=st.sampled_from([0.3, 0.5, 0.77, 0.9, 1.0]), min_p=st.sampled_from([0.0, 0.05, 0.3]),
       other_k=st.integers(0, 8))
def test_tied_filters_from_the_largest_values(values, top_k, top_p, min_p, other_k):
    """Few distinct values, so many ties, also past the candidates that topk returns (the largest
    top_k of the batch, which a second row raises): the kept set equals the reference's, and the
    same as with a full sort of the vocabulary."""
    x = [v / 2 for v in values]
    expected = reference_tied_support(x, top_k, top_p, min_p)
    params = [SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p), SamplingParams(top_k=other_k or 1)]
    if top_k == 0 and top_p < 1.0:
        params[1] = SamplingParams(top_k=other_k)
    logits = torch.tensor(x).expand(2, -1).contiguous()
    m = meta(params)
    got = sampler.masked_logits(logits, m)[0]
    assert set(torch.nonzero(torch.isfinite(got)).flatten().tolist()) == expected
    m.candidates = 0   # the full-sort path
    full = sampler.masked_logits(logits, m)[0]
    assert torch.equal(torch.isfinite(full), torch.isfinite(got))


def test_candidates_are_the_largest_top_k_unless_top_p_needs_the_vocabulary():
    assert meta([SamplingParams(top_k=5), SamplingParams(top_k=50, top_p=0.9)]).candidates == 50
    assert meta([SamplingParams(top_k=5), SamplingParams(top_p=0.9)]).candidates == 0
    assert meta([SamplingParams(top_k=5), SamplingParams()]).candidates == 5


def test_top_k_top_p_sampling_follows_the_renormalized_distribution():
    """Over a large vocabulary (topk, not a sort): top-k 20 then top-p 0.8; the sampled
    frequencies equal the reference's renormalized probabilities."""
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1000, generator=gen) * 2
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    x = (row.double() / 0.7).tolist()
    kept = sorted(reference_tied_support(x, 20, 0.8, 0.0))
    probs = torch.softmax(torch.tensor([x[i] for i in kept], dtype=torch.float64), -1)
    freq = frequencies(row, params)
    expected = torch.zeros(1000, dtype=torch.float64)
    expected[kept] = probs
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(kept)
    assert (freq - expected).abs().max() < 0.015
