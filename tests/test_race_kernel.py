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
