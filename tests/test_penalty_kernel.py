"""runner/sampling/penalty_kernel.py: the one-pass Triton penalties equal the torch path of
LogitsProcessors (HF's repetition penalty, vLLM's frequency and presence), for rows with and
without each penalty, rows in any order and slots out of order; in Triton's interpreter here,
on the GPU with the cuda marker."""

import os

import pytest
import torch

pytest.importorskip("triton")

from configs import SamplingParams  # noqa: E402
from runner.sampling import LogitsProcessors, SamplingStates  # noqa: E402
from runner.scheduler import ScheduledRequest  # noqa: E402

VOCAB = 3000   # two blocks, the second partial


def _case(device: str):
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(),
              SamplingParams(frequency_penalty=-0.5),
              SamplingParams(repetition_penalty=0.8),
              SamplingParams(presence_penalty=1.0, repetition_penalty=1.1)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (40,), generator=gen).tolist() for _ in params]
    reqs = [ScheduledRequest(f"r{i}", [0], 0, [], True, p, 0, -1, frozenset(), prompts[i], None,
                             p.needs_logits_processors) for i, p in enumerate(params)]
    states = SamplingStates(VOCAB, torch.device(device))
    processors = LogitsProcessors.build(reqs[::-1], states, VOCAB, lambda t: t.to(device))   # slots out of order
    processors = LogitsProcessors.build(reqs, states, VOCAB, lambda t: t.to(device))
    for _ in range(30):
        processors.record(torch.randint(0, VOCAB, (len(reqs),), generator=gen).to(device))
    logits = (torch.randn(len(reqs), VOCAB, generator=gen) * 4).to(device)
    return processors, logits


def _check(device: str):
    from runner.sampling.penalty_kernel import apply_penalties
    processors, logits = _case(device)
    p = processors.penalties
    assert p is not None and p.rows.tolist() == [0, 2, 3, 4]
    got = logits.clone()
    apply_penalties(got, p.rows, p.slots, processors.states.output_counts, processors.states.prompt_mask,
                    p.repetition, p.frequency, p.presence)
    want = logits.clone()
    processors._apply_penalties_torch(want, p)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[0], logits[0])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_penalty_kernel_equals_the_torch_path_in_the_interpreter():
    _check("cpu")


@pytest.mark.cuda
def test_penalty_kernel_equals_the_torch_path_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check("cuda")
