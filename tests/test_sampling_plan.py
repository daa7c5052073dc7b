"""SamplingStage keeps a step's processors and metadata for the next step with the same rows
(`_plan`): decode steps skip the per-row host loop and the uploads. Proof that reuse changes
nothing: a plan is reused only for the same requests in the same order with the same rows inside
min_tokens; min_tokens ending, a new row, a reordering and a released id (which may come back
as a new request with other settings) rebuild it; and the tokens equal those of a stage that
rebuilds every step."""

from __future__ import annotations

import torch

from configs import SamplingParams
from runner.sampling import SamplingStage
from runner.scheduler import ScheduledRequest

VOCAB, EOS = 64, 2


def req(request_id: str, params: SamplingParams, count: int = 0) -> ScheduledRequest:
    return ScheduledRequest(request_id, [0], 0, [], True, params, count, -1, frozenset({EOS}), [5, 6, 7], None,
                            params.needs_logits_processors)


def sample(stage: SamplingStage, reqs, logits) -> dict[str, int]:
    def no_fast_greedy():
        return logits.argmax(dim=-1)
    return stage.launch(reqs, lambda: logits.clone(), no_fast_greedy).resolve().sampled


def test_plan_is_kept_only_while_the_rows_are_the_same():
    stage = SamplingStage(VOCAB, torch.device("cpu"))
    a = SamplingParams(temperature=0.0, min_tokens=2, repetition_penalty=1.5)
    b = SamplingParams(temperature=0.7, seed=3)
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 5.0    # EOS wins unless min_tokens bans it
    assert sample(stage, [req("a", a, 0), req("b", b)], logits)["a"] != EOS
    first = stage._last_plan
    sample(stage, [req("a", a, 1), req("b", b)], logits)
    assert stage._last_plan is first                     # same rows, still inside min_tokens
    assert sample(stage, [req("a", a, 2), req("b", b)], logits)["a"] == EOS
    assert stage._last_plan is not first                 # min_tokens over: EOS no longer banned
    second = stage._last_plan
    sample(stage, [req("b", b), req("a", a, 3)], logits[:2])
    assert stage._last_plan is not second                # reordered
    stage.release(["a"])
    assert stage._last_plan is None
    again = SamplingParams(temperature=0.0, min_tokens=5)
    assert sample(stage, [req("a", again, 0)], logits[:1])["a"] != EOS   # the new request's settings


def test_reused_plans_give_the_tokens_of_rebuilt_ones():
    params = [SamplingParams(temperature=0.9, seed=i, presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.2, top_k=8, top_p=0.9, logprobs=2 if i % 2 else None)
              for i in range(4)] + [SamplingParams(temperature=0.0, logit_bias={3: 4.0})]
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(len(params), VOCAB, generator=gen) for _ in range(6)]
    cached, fresh = SamplingStage(VOCAB, torch.device("cpu")), SamplingStage(VOCAB, torch.device("cpu"))
    for step, logits in enumerate(steps):
        reqs = [req(f"r{i}", p, step) for i, p in enumerate(params)]
        got = sample(cached, reqs, logits)
        fresh._last_plan = None
        assert got == sample(fresh, reqs, logits)
