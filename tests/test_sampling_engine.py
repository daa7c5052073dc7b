"""Sampling end to end on a tiny random checkpoint (fp32, CPU): min_tokens on every sampling path,
seeds over their whole range, seeded requests reproducible whatever the batch, the KV cache,
chunking, prefix caching and async scheduling do, penalties and logit controls against a greedy
reference on HF's logits, and batched logprobs against HF's log-softmax of each request's own row."""

from __future__ import annotations

import pytest
import torch

from checkpoints import hf_prefill_logits, make_tiny_checkpoint
from configs import SamplingParams
from runner import LLM
from runner.engine import InvalidRequestError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 256, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 50, (26,), generator=g)]
    prompts += [shared + [i] for i in range(6)]   # 32 prompts; 6 share full blocks for the prefix cache
    return path, hf, prompts


def _llm(path, **options):
    return LLM(model=str(path), dtype="float32", device="cpu", **options)


def _eos(llm) -> int:
    return min(llm.engine.scheduler.eos_token_ids)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_min_tokens_holds_back_eos_and_stop_ids(tiny, async_scheduling):
    """A bias of +100 makes EOS (or a stop id) the argmax of every step: with min_tokens=K the
    first K tokens are something else and token K+1 ends the request."""
    path, _, prompts = tiny
    llm = _llm(path, async_scheduling=async_scheduling)
    eos, stop = _eos(llm), 77
    cases = [(SamplingParams(temperature=0.0, min_tokens=5, max_tokens=20, logit_bias={eos: 100.0}), eos, None),
             (SamplingParams(temperature=0.8, seed=3, min_tokens=4, max_tokens=20, stop_token_ids=[stop],
                             logit_bias={stop: 100.0}), stop, stop),
             (SamplingParams(temperature=0.0, min_tokens=0, max_tokens=20, logit_bias={eos: 100.0}), eos, None)]
    outs = llm.generate([prompts[0], prompts[1], prompts[2]], [c[0] for c in cases], use_tqdm=False)
    for out, (params, token, stop_reason) in zip(outs, cases):
        completion = out.outputs[0]
        k = params.min_tokens
        assert token not in completion.token_ids[:k]
        assert completion.token_ids[k:] == [token]
        assert completion.finish_reason == "stop" and completion.stop_reason == stop_reason


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_min_tokens_alone_takes_greedy_steps_off_the_fast_path(tiny, async_scheduling):
    """Plain greedy requests whose stop id is the token they would pick first: min_tokens is the
    only processor, and a batch of 20 (the CPU's screened LM head serves 16 rows or more) keeps it."""
    path, _, prompts = tiny
    llm = _llm(path, async_scheduling=async_scheduling)
    plain = llm.generate(prompts[:20], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                         use_tqdm=False)
    firsts = [o.outputs[0].token_ids[0] for o in plain]
    params = [SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=[t], ignore_eos=True)
              for t in firsts]
    for out, first in zip(llm.generate(prompts[:20], params, use_tqdm=False), firsts):
        assert first not in out.outputs[0].token_ids[:3]
        assert len(out.outputs[0].token_ids) >= 3


def test_every_accepted_seed_runs(tiny):
    path, _, prompts = tiny
    llm = _llm(path)
    for seed in (0, 2**63, 2**64 - 1):
        out = llm.generate([prompts[0]], SamplingParams(seed=seed, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def _seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + i, max_tokens=10, ignore_eos=True,
                           frequency_penalty=0.3 if i % 4 == 0 else 0.0) for i in range(n)]


@pytest.fixture(scope="module")
def seeded_alone(tiny):
    """Each of the 32 seeded requests run on its own."""
    path, _, prompts = tiny
    llm = _llm(path)
    params = _seeded(len(prompts))
    return [llm.generate([p], [s], use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(prompts, params)]


@pytest.mark.parametrize("options", [
    {},
    {"num_kv_blocks": 12, "max_model_len": 128},
    {"enable_chunked_prefill": False},
    {"max_num_batched_tokens": 32, "max_num_seqs": 8},
    {"enable_prefix_caching": False},
    {"async_scheduling": True},
    {"async_scheduling": True, "num_kv_blocks": 12, "max_model_len": 128},
    {"async_scheduling": True, "max_num_batched_tokens": 32, "enable_prefix_caching": False},
], ids=["batch32", "preemption", "no-chunked", "chunked-small-budget", "no-prefix-cache", "async",
        "async-preemption", "async-chunked-no-prefix-cache"])
def test_seeded_requests_reproduce_alone_and_in_any_batch(tiny, seeded_alone, options):
    path, _, prompts = tiny
    llm = _llm(path, **options)
    outs = llm.generate(prompts, _seeded(len(prompts)), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.stats()["num_preemptions"] > 0
    mismatched = [i for i, (a, b) in enumerate(zip(got, seeded_alone)) if a != b]
    assert not mismatched, f"requests {mismatched} changed"


def _reference_greedy(hf, prompt: list[int], n: int, process) -> list[int]:
    """Greedy decode on HF's float32 logits, each step's logits changed by process(logits, outputs)."""
    outputs: list[int] = []
    for _ in range(n):
        logits = hf_prefill_logits(hf, prompt + outputs)[-1]
        outputs.append(int(process(logits.clone(), prompt, outputs).argmax()))
    return outputs


def _penalized(params: SamplingParams, bad_words: list[list[int]]):
    def process(x, prompt, outputs):
        if params.allowed_token_ids is not None:
            keep = torch.zeros_like(x, dtype=torch.bool)
            keep[params.allowed_token_ids] = True
            x = x.masked_fill(~keep, float("-inf"))
        for word in bad_words:
            if len(word) == 1 or outputs[-(len(word) - 1):] == word[:-1]:
                x[word[-1]] = float("-inf")
        for token, bias in (params.logit_bias or {}).items():
            x[token] += bias
        seen = set(prompt) | set(outputs)
        for token in seen:
            p = params.repetition_penalty
            x[token] = x[token] / p if x[token] > 0 else x[token] * p
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=x.numel()).float()
        return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return process


def test_penalties_and_controls_match_a_reference_in_a_mixed_batch(tiny):
    path, hf, prompts = tiny
    n = 12
    cases = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, repetition_penalty=1.8),
             SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=0.7),
             SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logit_bias={65: 3.0, 66: -50.0},
                            repetition_penalty=0.8),
             SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, allowed_token_ids=list(range(97, 123)),
                            frequency_penalty=-0.5),
             SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, bad_words=["ab", "q"])]
    llm = _llm(path)
    tok = llm.engine.tokenizer
    from runner.sampling.bad_words import bad_words_token_ids
    outs = llm.generate(prompts[:len(cases)], cases, use_tqdm=False)
    for i, (out, params) in enumerate(zip(outs, cases)):
        words = bad_words_token_ids(params.bad_words, tok) if params.bad_words else []
        want = _reference_greedy(hf, prompts[i], n, _penalized(params, words))
        assert out.outputs[0].token_ids == want, f"request {i}"
    allowed = outs[4].outputs[0].token_ids
    assert all(97 <= t < 123 for t in allowed)


def test_out_of_vocabulary_ids_are_rejected_naming_the_field(tiny):
    path, _, prompts = tiny
    llm = _llm(path)
    for field, value in (("logit_bias", {10**6: 1.0}), ("allowed_token_ids", [3, 10**6])):
        with pytest.raises(InvalidRequestError, match=field):
            llm.engine.add_request(prompts[0], SamplingParams(**{field: value}))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_batched_logprobs_are_each_requests_own_log_softmax(tiny, async_scheduling):
    """Requests with different prompts, some sampled, decode together; every step's logprobs equal
    HF's log_softmax of that request's own logits (raw logits or another row's would fail)."""
    path, hf, prompts = tiny
    llm = _llm(path, async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, logprobs=3, max_tokens=5, ignore_eos=True,
                             presence_penalty=0.5 if i == 3 else 0.0) for i in range(6)]
    outs = llm.generate(prompts[:6], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        tokens = completion.token_ids
        want = torch.log_softmax(hf_prefill_logits(hf, prompt + tokens)[len(prompt) - 1:-1], dim=-1)
        assert len(completion.logprobs) == len(tokens)
        total = 0.0
        for step, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
            assert next(iter(entry)) == token
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(float(want[step, tid]), abs=1e-4)
                assert lp.rank == int((want[step] > want[step, tid]).sum()) + 1
            top = want[step].topk(3).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= 4
            total += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-5)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4},
                                     {"async_scheduling": True, "max_num_batched_tokens": 16},
                                     {"num_kv_blocks": 12, "max_model_len": 128}],
                         ids=["default", "chunked", "async-chunked", "preemption"])
def test_prompt_logprobs_equal_hf_log_softmax(tiny, options):
    """vLLM's shape (None, then {prompt token, top-k}); chunked prefill appends per chunk; the
    shared-prefix prompts run twice, so the second run would hit the prefix cache without the skip."""
    path, hf, prompts = tiny
    llm = _llm(path, **options)
    chosen = prompts[-6:] + prompts[:4]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                             prompt_logprobs=2 if i % 3 else None) for i in range(len(chosen))]
    for _ in range(2):
        outs = llm.generate(chosen, params, use_tqdm=False)
        for prompt, p, out in zip(chosen, params, outs):
            if p.prompt_logprobs is None:
                assert out.prompt_logprobs is None
                continue
            got = out.prompt_logprobs
            assert len(got) == len(prompt) and got[0] is None
            want = torch.log_softmax(hf_prefill_logits(hf, prompt), dim=-1)
            for j in range(1, len(prompt)):
                entry, row = got[j], want[j - 1]
                assert next(iter(entry)) == prompt[j]
                assert set(row.topk(2).indices.tolist()) <= set(entry) and len(entry) <= 3
                for token, lp in entry.items():
                    assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
                    assert lp.rank == int((row > row[token]).sum()) + 1
