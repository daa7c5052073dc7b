"""Request features the engine owns, on a tiny checkpoint with the byte tokenizer: `n` (prompt
prefilled once, its blocks shared through ref counts), min_tokens against stop strings,
include_stop_str_in_output, truncate_prompt_tokens, and the final output of an abort in every
output kind."""

from __future__ import annotations

import pytest
import torch

from checkpoints import hf_greedy_generate, make_tiny_checkpoint
from configs import RequestOutputKind, SamplingParams
from configs.sampling_params import SEED_MAX
from runner import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 9, 70)]
    return path, prompts, hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True), hf


def make_llm(path, **options):
    return LLM(model=str(path), dtype="float32", device="cpu", **options)


def seeded(n, **kw):
    return SamplingParams(**{"n": n, "temperature": 1.0, "seed": 7, "max_tokens": 8, "ignore_eos": True, **kw})


# ---- n ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_n_seeded_completions_differ_and_reproduce(tiny, async_scheduling):
    path, prompts = tiny[0], tiny[1]
    llm = make_llm(path, async_scheduling=async_scheduling)
    out = llm.generate([prompts[0]], seeded(4), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    tokens = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in tokens}) == 4 and all(len(t) == 8 for t in tokens)
    assert [c.token_ids for c in llm.generate([prompts[0]], seeded(4), use_tqdm=False)[0].outputs] == tokens
    # vLLM's seeds: completion i samples as a single request with seed + i would.
    alone = [llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids for i in range(4)]
    assert alone == tokens


def test_n_seeds_wrap_at_the_largest_seed(tiny):
    """The largest seed with n=2: the second completion's seed wraps to 0 (torch takes no larger
    seed), where seed + 1 failed the step of both completions."""
    path, prompts = tiny[0], tiny[1]
    llm = make_llm(path)
    out = llm.generate([prompts[0]], seeded(2, seed=SEED_MAX), use_tqdm=False)[0]
    assert out.error is None and [len(c.token_ids) for c in out.outputs] == [8, 8]
    zero = llm.generate([prompts[0]], seeded(1, seed=0), use_tqdm=False)[0].outputs[0].token_ids
    assert out.outputs[1].token_ids == zero


def test_n_greedy_completions_equal_n1(tiny):
    path, prompts, expected = tiny[:3]
    llm = make_llm(path)
    out = llm.generate(prompts[:2], SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    for o, exp in zip(out, expected):
        assert [c.token_ids for c in o.outputs] == [exp, exp] and [c.index for c in o.outputs] == [0, 1]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_n_prefills_the_prompt_once(tiny, prefix_caching):
    """40-token prompt, blocks of 16: the first completion computes 40 tokens in 3 blocks; the
    other three share its 2 full blocks (ref count 4), recompute the 8 tokens of the partial
    block, and allocate one block each: 6 blocks and 64 prefill tokens in all, not 12 and 160."""
    path, prompts = tiny[0], tiny[1]
    llm = make_llm(path, block_size=16, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    pool = engine.scheduler.kv.pool
    real, scheduled, shared_refs = engine.executor.execute, [], []

    def counting(sched):
        scheduled.append(sched.num_scheduled_tokens)
        tables = [r.block_ids for r in sched.scheduled]
        if len(tables) == 4:
            shared_refs.append([pool.ref_counts[b] for b in tables[0][:2]])
        return real(sched)

    engine.executor.execute = counting
    before = pool.num_allocated
    out = llm.generate([prompts[0]], seeded(4), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert pool.num_allocated - before == 3 + 3 * 1
    assert sum(scheduled) == 40 + 3 * 8 + 4 * 7  # prompt once, 3 partial blocks, 7 decode steps each
    assert shared_refs and shared_refs[0] == [4, 4]
    assert engine.scheduler.kv.usage == 0.0 and engine.scheduler.stats()["num_allocated_blocks"] == pool.num_allocated


@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda k: k.name)
def test_n_streams_per_completion(tiny, kind):
    """DELTA and CUMULATIVE outputs of a parent carry the completions that changed (vLLM); the
    deltas of each index concatenate to its final completion; the parent finishes with the last."""
    path, prompts = tiny[0], tiny[1]
    llm = make_llm(path)
    final = llm.generate([prompts[1]], seeded(3, logprobs=1), use_tqdm=False)[0].outputs
    engine = llm.engine
    engine.add_request(prompts[1], seeded(3, logprobs=1, output_kind=kind), request_id="p")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert all(o.request_id == "p" for o in outs) and [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(outs) == 1 and outs[0].outputs == final
        return
    for index in range(3):
        mine = [c for o in outs for c in o.outputs if c.index == index]
        if kind is RequestOutputKind.DELTA:
            assert sum((c.token_ids for c in mine), []) == final[index].token_ids
            assert "".join(c.text for c in mine) == final[index].text
            assert sum((c.logprobs for c in mine), []) == final[index].logprobs
        assert mine[-1].finish_reason == "length"
        assert mine[-1].cumulative_logprob == pytest.approx(final[index].cumulative_logprob)
        assert mine[-1].cumulative_logprob == pytest.approx(
            sum(entry[t].logprob for entry, t in zip(final[index].logprobs, final[index].token_ids)))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_of_a_parent_aborts_every_completion(tiny, async_scheduling):
    path, prompts = tiny[0], tiny[1]
    engine = make_llm(path, async_scheduling=async_scheduling).engine
    engine.add_request(prompts[0], seeded(4, max_tokens=30), request_id="p")
    for _ in range(4):
        engine.step()
    out = engine.abort_request("p")
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.finish_reason == "abort" for c in out.outputs)
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert engine.scheduler.kv.usage == 0.0 and not engine._tracked and not engine._parents
    assert engine.abort_request("p") is None


# ---- stop strings, min_tokens, truncation --------------------------------------------------------
def test_min_tokens_keeps_a_stop_string_from_ending_the_request_early(tiny):
    path, prompts, expected = tiny[:3]
    llm = make_llm(path)
    tokenizer = llm.tokenizer
    tokens = expected[0]
    text = tokenizer.decode(tokens)
    # The first character the text shows (random weights: many bytes are not UTF-8) is the stop string.
    stop = next(c for i in range(1, 4) for c in tokenizer.decode(tokens[:i]) if c != "\ufffd")
    first_end = text.index(stop) + len(stop)
    early = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3 and early.text == text[:text.index(stop)]
    assert stop not in early.text
    k = 6
    late = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                     min_tokens=k), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > k and late.token_ids == tokens[:len(late.token_ids)]
    # Its text still holds the early occurrence; a stop, if any, ended after the k-th token's text.
    assert late.text.startswith(text[:first_end])
    if late.finish_reason == "stop":
        end = len(late.text) + len(stop)
        assert end > len(tokenizer.decode(tokens[:k]).rstrip("\ufffd"))


def test_include_stop_str_in_output(tiny):
    path, prompts, expected = tiny[:3]
    llm = make_llm(path)
    text = llm.tokenizer.decode(expected[0])
    stop = llm.tokenizer.decode(expected[0][4:6])
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        for kind in RequestOutputKind:
            engine = llm.engine
            engine.add_request(prompts[0], params.model_copy(update={"output_kind": kind}), request_id="r")
            outs = []
            while engine.has_unfinished_requests():
                outs += engine.step()
            got = "".join(o.outputs[0].text for o in outs) if kind is RequestOutputKind.DELTA else outs[-1].outputs[0].text
            cut = text.index(stop)
            assert got == (text[:cut + len(stop)] if include else text[:cut])
            assert outs[-1].outputs[0].stop_reason == stop


def test_truncate_prompt_tokens(tiny):
    path, prompts, _, hf = tiny
    llm = make_llm(path, max_model_len=64)
    out = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompts[2][-10:] and out.error is None
    assert out.outputs[0].token_ids == hf_greedy_generate(hf, [prompts[2][-10:]], 6, ignore_eos=True)[0]
    out = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompts[2][-63:] and len(out.outputs[0].token_ids) == 1  # max_model_len 64
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


# ---- abort --------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_returns_the_final_output_of_every_kind(tiny, async_scheduling):
    path, prompts = tiny[0], tiny[1]
    engine = make_llm(path, async_scheduling=async_scheduling).engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    for kind in RequestOutputKind:
        engine.add_request(prompts[0], params.model_copy(update={"output_kind": kind}), request_id=kind.name)
    seen = {kind.name: [] for kind in RequestOutputKind}
    for _ in range(5):
        for out in engine.step():
            seen[out.request_id].append(out)
    aborted = {kind.name: engine.abort_request(kind.name) for kind in RequestOutputKind}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted.values())
    full = aborted["CUMULATIVE"].outputs[0]
    assert len(full.token_ids) >= 3 and len(full.logprobs) == len(full.token_ids)
    assert aborted["FINAL_ONLY"].outputs[0] == full and not seen["FINAL_ONLY"]
    deltas = [o.outputs[0] for o in seen["DELTA"] + [aborted["DELTA"]]]
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert "".join(d.text for d in deltas) == full.text
    assert sum((d.logprobs for d in deltas), []) == full.logprobs
    assert deltas[-1].cumulative_logprob == pytest.approx(full.cumulative_logprob)
    assert full.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(full.logprobs, full.token_ids)))
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert engine.scheduler.kv.usage == 0.0 and engine.abort_request("DELTA") is None


def test_shutdown_releases_the_kv_cache_and_later_steps_fail_clearly(tiny):
    """The end of a `with LLM(...)` block gives back the step memory (KV cache, graphs), so a later
    engine or process can have it; generating after it names the cause instead of failing inside a step."""
    path, prompts = tiny[0], tiny[1]
    with make_llm(path) as llm:
        llm.generate([prompts[1]], GREEDY, use_tqdm=False)
        runner = llm.engine.model_runner
        assert runner.kv_caches is not None
    assert runner.kv_caches is None
    with pytest.raises(RuntimeError, match="has been shut down"):
        llm.generate([prompts[1]], GREEDY, use_tqdm=False)
    llm.shutdown()   # a second shutdown does nothing
