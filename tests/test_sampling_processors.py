"""Logit processors (runner/sampling/processors.py) against HF transformers' logits processors and
vLLM's formulas, on the same logits, in mixed batches (rows with and without each feature), plus
min_tokens, seeds and the sampling path's fast-path choice. CPU, no model."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers.generation.logits_process import (NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from configs import SamplingParams
from runner.sampling import LogitsProcessors, SamplingStage, SamplingStates
from runner.scheduler import ScheduledRequest

V = 64
CPU = torch.device("cpu")


def _req(rid: str, params: SamplingParams, outputs: int = 0, stop_ids=frozenset(), prompt=None,
         bad_words=None) -> ScheduledRequest:
    return ScheduledRequest(rid, [0], 0, [], True, params, outputs, -1, frozenset(stop_ids), prompt, bad_words,
                            params.needs_logits_processors or bad_words is not None)


def _processors(reqs, states=None):
    states = states or SamplingStates(V, CPU)
    return LogitsProcessors.build(reqs, states, V, lambda t: t), states


def _record_history(states, reqs, history):
    """Feed each request's output tokens into the state, one step at a time (as the stage does)."""
    for step in range(max(len(h) for h in history)):
        rows = [i for i, h in enumerate(history) if step < len(h)]
        sub = [reqs[i] for i in rows]
        for req in sub:
            states.slot(req)
            req.output_token_count += 1
        slots = torch.tensor([states.slots[r.request_id] for r in sub])
        states.record(slots, torch.tensor([history[i][step] for i in rows]))


def test_no_feature_builds_nothing():
    assert _processors([_req("a", SamplingParams()), _req("b", SamplingParams(temperature=0))])[0] is None


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_penalty_factor_columns_start_16_byte_aligned(rows):
    """The penalty pass (a Triton kernel, compiled per pointer alignment) reads one column per
    factor: each starts 16-byte aligned whatever the batch size, and holds its rows' factors."""
    reqs = [_req(f"r{i}", SamplingParams(repetition_penalty=1.1 + i, frequency_penalty=0.5, presence_penalty=0.25 * i),
                 prompt=[1, 2]) for i in range(rows)]
    procs, _ = _processors(reqs)
    rep, freq, pres = procs.penalties.row_factors
    for column in (rep, freq, pres):
        assert column.data_ptr() % 16 == 0 and column.shape == (rows,)
    assert rep.tolist() == pytest.approx([1.1 + i for i in range(rows)])
    assert pres.tolist() == pytest.approx([0.25 * i for i in range(rows)]) and freq.tolist() == [0.5] * rows


def test_min_tokens_masks_stop_ids_only_inside_the_window():
    logits = torch.randn(4, V)
    reqs = [_req("in", SamplingParams(min_tokens=3), outputs=2, stop_ids={2, 7}),
            _req("out", SamplingParams(min_tokens=3), outputs=3, stop_ids={2, 7}),
            _req("plain", SamplingParams(), stop_ids={2}),
            _req("oov", SamplingParams(min_tokens=1), stop_ids={5, V + 10})]   # out-of-vocab stop id ignored
    procs, _ = _processors(reqs)
    out = procs.apply(logits)
    want = logits.clone()
    want[0, [2, 7]] = float("-inf")
    want[3, 5] = float("-inf")
    assert torch.equal(out, want)
    assert torch.equal(logits, logits.clone())  # input untouched


def test_repetition_penalty_equals_hf_over_prompt_and_output():
    g = torch.Generator().manual_seed(0)
    prompts = [[1, 5, 9], [3, 3, 4], [10]]
    outputs = [[9, 12, 12], [60], []]
    penalties = [1.3, 0.7, 2.0]
    reqs = [_req(f"r{i}", SamplingParams(repetition_penalty=p), prompt=prompts[i]) for i, p in enumerate(penalties)]
    reqs.append(_req("plain", SamplingParams()))
    states = SamplingStates(V, CPU)
    _record_history(states, reqs[:2], outputs[:2])
    logits = torch.randn(4, V, generator=g) * 3
    out = _processors(reqs, states)[0].apply(logits)
    for i, p in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(p)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(out[i:i + 1], want, rtol=0, atol=0)
    assert torch.equal(out[3], logits[3])


def test_presence_and_frequency_follow_vllms_formula_over_output_tokens():
    g = torch.Generator().manual_seed(1)
    outputs = [[4, 4, 4, 8], [1, 2], [7]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=-1.0), SamplingParams(frequency_penalty=2.0)]
    reqs = [_req(f"r{i}", p, prompt=[4]) for i, p in enumerate(params)] + [_req("plain", SamplingParams())]
    states = SamplingStates(V, CPU)
    _record_history(states, reqs[:3], outputs)
    logits = torch.randn(4, V, generator=g)
    out = _processors(reqs, states)[0].apply(logits)
    for i, p in enumerate(params):
        counts = torch.bincount(torch.tensor(outputs[i]), minlength=V).float()
        want = logits[i] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(out[i], want)
    assert torch.equal(out[3], logits[3])


def test_logit_bias_equals_hf_sequence_bias_and_allowed_ids_mask_the_rest():
    logits = torch.randn(3, V)
    bias = {3: 5.0, 17: -2.5}
    reqs = [_req("bias", SamplingParams(logit_bias=bias)), _req("allowed", SamplingParams(allowed_token_ids=[1, 9])),
            _req("plain", SamplingParams())]
    out = _processors(reqs)[0].apply(logits)
    hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    torch.testing.assert_close(out[0:1], hf(torch.tensor([[0]]), logits[0:1].clone()))
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [1, 9]
    assert torch.equal(out[1, [1, 9]], logits[1, [1, 9]])
    assert torch.equal(out[2], logits[2])


@pytest.mark.parametrize("history", [[5, 6], [1, 5], [9, 9, 9], []])
def test_bad_words_equal_hf_no_bad_words_on_the_output(history):
    words = [[3], [5, 6, 7], [9, 11], [6, 8]]
    reqs = [_req("bad", SamplingParams(), bad_words=words), _req("plain", SamplingParams())]
    states = SamplingStates(V, CPU)
    if history:
        _record_history(states, reqs[:1], [history])
    logits = torch.randn(2, V)
    out = _processors(reqs, states)[0].apply(logits)
    # HF reads the whole sequence; vLLM (and this engine) the output only: give HF the output,
    # behind a token no bad word contains so that an empty output matches nothing.
    ids = torch.tensor([[63] + history])
    want = NoBadWordsLogitsProcessor(words, eos_token_id=None)(ids, logits[0:1].clone())
    assert torch.equal(out[0:1], want)
    assert torch.equal(out[1], logits[1])


def test_seed_range_is_checked_when_params_are_built():
    for seed in (0, 2**63, 2**64 - 1):
        gen = torch.Generator()
        gen.manual_seed(SamplingParams(seed=seed).seed)
    for seed in (2**64, -1):
        with pytest.raises(ValidationError, match=r"seed.*2\*\*64 - 1"):
            SamplingParams(seed=seed)


@pytest.mark.parametrize("field, value", [("presence_penalty", 3.0), ("frequency_penalty", -2.5),
                                          ("repetition_penalty", 0.0), ("allowed_token_ids", []),
                                          ("logit_bias", {-1: 1.0}), ("bad_words", [" "]),
                                          ("prompt_logprobs", -1)])
def test_invalid_controls_name_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


def _launch(stage, reqs, logits, fast=None):
    calls = []

    def fast_greedy():
        calls.append(1)
        return fast if fast is not None else logits.argmax(dim=-1)
    return stage.launch(reqs, lambda: logits, fast_greedy).resolve(), bool(calls)


def test_fast_greedy_path_only_for_plain_greedy_steps():
    stage = SamplingStage(V, CPU)
    logits = torch.randn(2, V)
    greedy = SamplingParams(temperature=0.0)
    wrong = torch.tensor([1, 1])   # a stand-in fast path: its tokens show when it was used
    out, used = _launch(stage, [_req("a", greedy), _req("b", greedy)], logits, wrong)
    assert used and list(out.sampled.values()) == [1, 1]
    stop = int(logits[0].argmax())
    reqs = [_req("c", SamplingParams(temperature=0.0, min_tokens=2), stop_ids={stop}), _req("d", greedy)]
    out, used = _launch(stage, reqs, logits, wrong)
    assert not used
    assert out.sampled["c"] != stop and out.sampled["c"] == int(logits[0].clone().index_fill_(0, torch.tensor(
        [stop]), float("-inf")).argmax())
    assert out.sampled["d"] == int(logits[1].argmax())


def test_stage_counts_each_sampled_token_once_and_keeps_state_until_release():
    stage = SamplingStage(V, CPU)
    req = _req("a", SamplingParams(temperature=0.0, frequency_penalty=0.1))
    logits = torch.zeros(1, V)
    logits[0, 5] = 1.0
    for step in range(3):
        req.output_token_count = step
        out, _ = _launch(stage, [req], logits)
        assert out.sampled == {"a": 5}
    slot = stage.states.slots["a"]
    assert int(stage.states.output_counts[slot, 5]) == 3 and int(stage.states.output_counts[slot].sum()) == 3
    stage.release(["a"])
    assert "a" not in stage.states.slots


def test_seeded_generator_advances_once_per_sampled_token():
    """The same seeded request alone and beside other rows, over steps: same tokens."""
    g = torch.Generator().manual_seed(2)
    steps = [torch.randn(1, V, generator=g) for _ in range(5)]
    params = SamplingParams(temperature=1.0, seed=1234)
    alone, batched = SamplingStage(V, CPU), SamplingStage(V, CPU)
    a_tokens, b_tokens = [], []
    for i, row in enumerate(steps):
        a_tokens.append(_launch(alone, [_req("x", params, outputs=i)], row)[0].sampled["x"])
        others = [_req(f"o{j}", SamplingParams(temperature=1.0, seed=j if j % 2 else None), outputs=i)
                  for j in range(4)]
        logits = torch.cat([torch.randn(2, V), row, torch.randn(2, V)])
        reqs = others[:2] + [_req("x", params, outputs=i)] + others[2:]
        b_tokens.append(_launch(batched, reqs, logits)[0].sampled["x"])
    assert a_tokens == b_tokens
