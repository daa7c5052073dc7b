"""runner/sampling/race_kernel.py: the one-pass GPU draw follows softmax(x / T) over the tokens the
threshold keeps, never picks a filtered token, and a row's token depends only on its seed and
logits (seeded rows: their own generator). In Triton's interpreter here; on a GPU (cuda marker)
the same checks, and the sampler's GPU path against the torch path's distribution."""

import os

import pytest
import torch

pytest.importorskip("triton")

from configs import SamplingParams  # noqa: E402
from runner.sampling import Sampler, SamplingMetadata, make_generator  # noqa: E402

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])


def _check_distribution(device: str, n: int):
    from runner.sampling.race_kernel import race, row_seeds
    torch.manual_seed(0)
    x = LOGITS.to(device).expand(n, -1).contiguous()
    temp = torch.full((n, 1), 0.7, device=device)
    threshold = torch.full((n, 1), -0.5, device=device)   # keeps tokens 0-4
    tokens = race(x, temp, threshold, row_seeds(n, {}, torch.device(device)))
    freq = torch.bincount(tokens.cpu(), minlength=8).double() / n
    expected = torch.zeros(8, dtype=torch.float64)
    expected[:5] = torch.softmax(LOGITS[:5].double() / 0.7, -1)
    assert freq[5:].sum() == 0
    assert (freq - expected).abs().max() < (0.1 if n < 1000 else 0.01)


def _check_seeds(device: str):
    from runner.sampling.race_kernel import race, row_seeds
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3000, generator=gen).to(device)
    temp = torch.ones(6, 1, device=device)

    def draw(generators):
        return race(x, temp, None, row_seeds(6, generators, dev)).tolist()

    a = draw({2: make_generator(9, dev)})
    b = draw({2: make_generator(9, dev)})
    assert a[2] == b[2]
    c = draw({2: make_generator(10, dev)})
    d = draw({2: make_generator(10, dev)})
    assert c[2] == d[2]
    alone = race(x[2:3], temp[:1], None, row_seeds(1, {0: make_generator(9, dev)}, dev)).tolist()
    assert alone == [a[2]]   # the row's own seed and logits only
    # The step's one seed s draws what the per-row seeds s + row draw (one variant serves both).
    assert race(x, temp, None, 12345).tolist() == race(x, temp, None, torch.arange(6, device=dev) + 12345).tolist()


def test_seeded_and_unseeded_draws_launch_one_variant(monkeypatch):
    """Per-row seeds (a step with seeded requests) are a runtime branch of the race kernel, not a
    constexpr: a seeded request does not compile a variant of its own at its first step."""
    from launch_keys import RecordingLaunch
    from runner.sampling import race_kernel
    keys = {}
    monkeypatch.setattr(race_kernel, "_launch", RecordingLaunch(race_kernel._race_kernel, "race", keys))
    x, temp = torch.zeros(3, 4096), torch.ones(3, 1)
    race_kernel.race(x, temp, None, 7)
    race_kernel.race(x, temp, None, torch.tensor([1, 2, 3]))
    assert len(keys["race"]) == 1


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_race_kernel_distribution_in_the_interpreter():
    _check_distribution("cpu", 400)   # the interpreter runs ~10 programs a second


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_race_kernel_seeds_in_the_interpreter():
    _check_seeds("cpu")


@pytest.mark.cuda
def test_race_kernel_on_the_gpu(kernel_switches):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kernel_switches(triton_sampling=True)   # the default; the sampler's GPU path takes the kernel only then
    _check_distribution("cuda", 200000)
    _check_seeds("cuda")
    # The sampler's GPU path (thresholds + kernel) against the softmax of the kept tokens.
    n = 100000
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    metadata = SamplingMetadata.from_params([params] * n, {}, "cuda")
    tokens = Sampler()(LOGITS.cuda().expand(n, -1).contiguous(), metadata).sampled_token_ids
    freq = torch.bincount(tokens.cpu(), minlength=8).double() / n
    probs = torch.softmax(LOGITS.double() / 0.8, -1)[:4]
    probs = probs / probs.sum()
    keep = (torch.cumsum(probs, 0) - probs) < 0.9
    expected = torch.zeros(8, dtype=torch.float64)
    expected[:4] = torch.where(keep, probs, 0.0) / probs[keep].sum()
    assert (freq - expected).abs().max() < 0.01


def _check_splits_draw_the_same_tokens(device: str, monkeypatch, rows: int, vocab: int):
    """A row split over several programs (each racing its share of the blocks, the last to finish
    taking the best) draws the token one program walking the whole row draws, with and without a
    threshold, candidates lists and the penalty record; the tickets are back at zero after each."""
    from runner.sampling import race_kernel
    gen = torch.Generator().manual_seed(rows + vocab)
    x = (torch.randn(rows, vocab, generator=gen) * 2).to(device)
    if rows > 1:
        x[1, :] = float("-inf")   # a row that keeps nothing draws token 0
    temp = torch.full((rows, 1), 0.9, device=device)
    threshold = torch.full((rows, 1), 1.5, device=device)
    counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
    seen = torch.zeros(rows, vocab, dtype=torch.uint8, device=device)
    slots = torch.arange(rows, device=device)

    def draw(programs, thr, seeds):
        monkeypatch.setattr(race_kernel, "_target_programs", lambda device: programs)
        counts.zero_()
        seen.zero_()
        tokens = race_kernel.race(x, temp, thr, seeds, record=(slots, counts, seen))
        return tokens.tolist(), counts.clone(), seen.clone()

    for thr in (None, threshold):
        for seeds in (12345, torch.arange(rows, device=device) * 7 + 3):
            one = draw(1, thr, seeds)
            many = draw(rows * 64, thr, seeds)
            assert race_kernel._splits(rows, vocab, torch.device(device))[0] > 1
            assert one[0] == many[0]
            assert torch.equal(one[1], many[1]) and torch.equal(one[2], many[2])
            for held in race_kernel._scratch.values():
                assert int(held[2].abs().sum()) == 0   # every ticket reset by its row's last split
    if rows > 1:
        assert one[0][1] == 0


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_race_kernel_split_rows_draw_the_same_tokens_in_the_interpreter(monkeypatch):
    _check_splits_draw_the_same_tokens("cpu", monkeypatch, rows=3, vocab=3 * 1024 + 17)


@pytest.mark.cuda
def test_race_kernel_split_rows_draw_the_same_tokens_on_the_gpu(monkeypatch, kernel_switches):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kernel_switches(triton_sampling=True)
    _check_splits_draw_the_same_tokens("cuda", monkeypatch, rows=37, vocab=151936)
