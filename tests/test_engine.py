"""Issue 3: the engine end to end on CPU, token-exact with HF transformers (fp32, greedy)."""

from __future__ import annotations

import pytest
import torch

from checkpoints import hf_greedy_generate, make_tiny_checkpoint
from configs import RequestOutputKind, SamplingParams
from runner import LLM
from runner.engine import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 40, 17, 1, 70, 9, 33, 5)]
    # A shared 48-token prefix (3 full blocks) so the prefix cache has something to hit.
    shared = torch.randint(3, 256, (48,), generator=g).tolist()
    prompts += [shared + [7, 8], shared + [9], shared + [10, 11, 12]]
    expected = hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)
    return path, prompts, expected


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("options", [
    {},
    {"enable_chunked_prefill": False},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 32, "max_num_seqs": 4},          # chunked prefill across steps
    {"num_kv_blocks": 12, "max_model_len": 128},                 # tiny cache: preemption
    {"block_size": 32},
], ids=["default", "no-chunked", "no-prefix-cache", "small-budget", "preemption", "block32"])
def test_greedy_tokens_match_hf(tiny, options):
    path, prompts, expected = tiny
    llm = LLM(model=str(path), dtype="float32", device="cpu", **options)
    assert _tokens(llm, prompts) == expected
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.stats()["num_preemptions"] > 0
    # Again: the shared-prefix prompts now find their full blocks cached (same tokens either way).
    assert _tokens(llm, prompts[-3:]) == expected[-3:]
    hit_rate = llm.engine.scheduler.stats()["prefix_cache_hit_rate"]
    if options.get("enable_prefix_caching", True):
        assert hit_rate > 0
    else:
        assert hit_rate == 0


@pytest.mark.parametrize("native", [True, False], ids=["c-attention", "torch-dense-copy"])
@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 32, "max_num_seqs": 4},          # decode and prefill chunks mixed
    {"num_kv_blocks": 12, "max_model_len": 128},                 # preemption: blocks reused
], ids=["default", "small-budget", "preemption"])
def test_both_cpu_decode_attention_paths_give_hfs_tokens(tiny, options, native, monkeypatch):
    """Decode steps take the C attention over the paged cache (attention/backends/cpu_decode_attention.py)
    where it is built, or SDPA over the dense K/V copy; mixed and prefill steps always the latter. Either way,
    across chunked prefill and preemption, the tokens are HF's."""
    from attention.backends import cpu_decode_attention as c_attention
    if native and not c_attention.native_attention():
        pytest.skip("the C decode attention is not built here (no C compiler)")
    path, prompts, expected = tiny
    real, calls = c_attention.decode_attention, []
    monkeypatch.setattr(c_attention, "native_attention", lambda: native)
    monkeypatch.setattr(c_attention, "decode_attention", lambda *args: calls.append(1) or real(*args))
    llm = LLM(model=str(path), dtype="float32", device="cpu", **options)
    assert _tokens(llm, prompts) == expected
    assert bool(calls) == native


def test_bad_requests_fail_alone(tiny):
    path, prompts, expected = tiny
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_model_len=64)
    batch = [prompts[0], [], list(range(100)), [3, 4, 999], prompts[2]]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected[0] and outs[4].outputs[0].token_ids == expected[2]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort", "abort", "abort", "length"]
    assert "empty" in outs[1].error
    assert "max_model_len=64" in outs[2].error
    assert "999" in outs[3].error and "vocabulary" in outs[3].error
    outs = llm.generate([3.5, {"text": "x"}, {"prompt_token_ids": [3, 4, 999]}, prompts[0]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "abort", "abort", "length"]
    assert "got float" in outs[0].error and "prompt_token_ids" in outs[1].error and "999" in outs[2].error
    assert outs[2].prompt_token_ids == [3, 4, 999] and outs[3].outputs[0].token_ids == expected[0]
    with pytest.raises(TypeError, match="got NoneType"):
        llm.generate(None, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.engine.add_request([-1], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert _tokens(llm, [prompts[0]]) == [expected[0]]  # the engine still serves


def test_engine_step_api_streams_and_aborts(tiny):
    path, prompts, expected = tiny
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    engine = llm.engine
    engine.add_request(prompts[1], GREEDY, request_id="a")
    engine.add_request(prompts[2], GREEDY, request_id="b")
    seen = {"a": [], "b": []}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(len(out.outputs[0].token_ids))
        steps += 1
        if steps == 3:
            aborted = engine.abort_request("b")
            assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert seen["a"] == list(range(1, GREEDY.max_tokens + 1))  # one token per step, cumulative
    assert len(seen["b"]) < GREEDY.max_tokens


def test_stop_ids_eos_max_tokens_min_tokens(tiny):
    path, prompts, expected = tiny
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    target = expected[0][5]
    first = expected[0].index(target)
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target]),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[0][:first + 1] and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == target
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target],
                                                    min_tokens=first + 2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > first + 1
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[0][:5] and out.outputs[0].finish_reason == "length"


def test_seeded_sampling_reproducible(tiny):
    path, prompts, _ = tiny
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = _tokens(llm, [prompts[0]], params)[0]
    crowd = _tokens(llm, [prompts[3], prompts[0], prompts[5]],
                    [SamplingParams(temperature=1.0, max_tokens=16), params, SamplingParams(temperature=0.7)])[1]
    assert alone == crowd
    other = _tokens(llm, [prompts[0]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99,
                                                      ignore_eos=True))[0]
    assert other != alone


def test_logprobs_returned(tiny):
    path, prompts, expected = tiny
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs) == 4
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert token in entry and len(entry) >= 3
        assert entry[token].logprob == max(lp.logprob for lp in entry.values())  # greedy: the most likely
        assert entry[token].rank == 1 and sorted(lp.rank for lp in entry.values()) == [1, 2, 3]


def test_checkpoint_without_tokenizer_takes_token_ids(tmp_path):
    path, hf = make_tiny_checkpoint(tmp_path / "c", "qwen3", with_tokenizer=False)
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    assert llm.tokenizer is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy_generate(hf, [[5, 6, 7]], 6, ignore_eos=True)[0]
    assert out.outputs[0].text == ""
    bad = llm.generate(["text needs a tokenizer"], use_tqdm=False)[0]
    assert bad.outputs[0].finish_reason == "abort" and "tokenizer" in bad.error


def test_greedy_decode_of_many_rows_matches_hf(tiny, monkeypatch):
    """20 requests decode together: the CPU's bf16-screened LM head (`screened_argmax`, from 16
    rows) serves those steps, and the tokens are still HF's."""
    from transformers import AutoModelForCausalLM

    import models.layers
    import runner.model_runner
    path = tiny[0]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (20,), generator=g)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    served = []

    def counting(hidden, head):
        tokens = models.layers.screened_argmax(hidden, head)
        served.append(tokens is not None)
        return tokens

    monkeypatch.setattr(runner.model_runner, "screened_argmax", counting)
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    assert _tokens(llm, prompts) == hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)
    assert sum(served) >= GREEDY.max_tokens - 1   # every decode step of the 20 rows was screened


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_output_kinds_delta_and_final_only(tiny, async_scheduling):
    """DELTA outputs concatenate to the CUMULATIVE result (tokens, text, logprobs); FINAL_ONLY
    yields exactly one output per request, the finished one."""
    path, prompts, expected = tiny
    llm = LLM(model=str(path), dtype="float32", device="cpu", async_scheduling=async_scheduling)
    engine = llm.engine
    kinds = {"cum": RequestOutputKind.CUMULATIVE, "delta": RequestOutputKind.DELTA,
             "final": RequestOutputKind.FINAL_ONLY}
    for name, kind in kinds.items():
        engine.add_request(prompts[1], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=1,
                                                      output_kind=kind), request_id=name)
    seen = {name: [] for name in kinds}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    final = seen["cum"][-1].outputs[0]
    assert final.token_ids == expected[1][:9] and len(seen["cum"]) == 9
    deltas = [o.outputs[0] for o in seen["delta"]]
    assert len(deltas) == 9 and all(len(d.token_ids) == 1 for d in deltas)
    assert sum((d.token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.text for d in deltas) == final.text
    assert sum((d.logprobs for d in deltas), []) == final.logprobs
    assert [o.finished for o in seen["delta"]] == [False] * 8 + [True]
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert seen["final"][0].outputs[0] == final
