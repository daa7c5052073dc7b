"""Sampling on a GPU in the graph modes that sample from the graph's own logits and greedy tokens
(FULL, FULL_AND_PIECEWISE): min_tokens holds on every path (the in-graph argmax is bypassed when
a row needs a logit processor), every accepted seed works on a CUDA generator, and seeded
requests reproduce alone, in a batch of 32 and under preemption, sync and async."""

from __future__ import annotations

import gc

import pytest
import torch

from checkpoints import make_tiny_checkpoint
from configs import CUDAGraphMode, SamplingParams

pytestmark = pytest.mark.cuda

SIZES = [1, 2, 4, 8, 16, 24, 32]
MODES = [CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 50, (32,), generator=g)]
    return path, prompts


def _llm(path, mode, **kwargs):
    from runner import LLM
    options = dict(max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=1024)
    options.update(kwargs)
    return LLM(model=str(path), device="cuda", dtype="float32", cudagraph_mode=mode, cudagraph_capture_sizes=SIZES,
               **options)


def _release(llm):
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_min_tokens_on_the_gpu(tiny, mode, async_scheduling):
    path, prompts = tiny
    llm = _llm(path, mode, async_scheduling=async_scheduling)
    try:
        eos = min(llm.engine.scheduler.eos_token_ids)
        biased = [SamplingParams(temperature=0.0, min_tokens=5, max_tokens=20, logit_bias={eos: 100.0}),
                  SamplingParams(temperature=0.7, seed=1, min_tokens=3, max_tokens=20, stop_token_ids=[77],
                                 logit_bias={77: 100.0})]
        outs = llm.generate(prompts[:2], biased, use_tqdm=False)
        assert outs[0].outputs[0].token_ids[5:] == [eos] and eos not in outs[0].outputs[0].token_ids[:5]
        assert outs[1].outputs[0].token_ids[3:] == [77] and outs[1].outputs[0].stop_reason == 77
        # Plain greedy rows whose stop id is their first greedy token: min_tokens is the only
        # processor; decode steps of 20 rows replay a FULL graph that computes the argmax itself.
        firsts = [o.outputs[0].token_ids[0] for o in llm.generate(
            prompts[:20], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)]
        params = [SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, stop_token_ids=[t], ignore_eos=True)
                  for t in firsts]
        for out, first in zip(llm.generate(prompts[:20], params, use_tqdm=False), firsts):
            assert first not in out.outputs[0].token_ids[:4] and len(out.outputs[0].token_ids) >= 4
        assert llm.engine.model_runner.cuda_graph_ready
    finally:
        _release(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_rows_beside_sampled_ones_then_alone(tiny, async_scheduling):
    """A decode graph computes the greedy tokens only on the steps that take them (its argmax reads
    the gate InputBatch.graph_greedy): greedy requests decoding beside sampled ones (gate shut, the
    sampler's argmax) and then alone (gate open, the graph's tokens) give the tokens they give alone."""
    path, prompts = tiny
    llm = _llm(path, CUDAGraphMode.FULL, async_scheduling=async_scheduling)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True)
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], greedy, use_tqdm=False)]
        mixed = llm.generate(prompts[:6], [greedy] * 3 + [sampled] * 3, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
        assert [len(o.outputs[0].token_ids) for o in mixed[3:]] == [5] * 3
        assert llm.engine.model_runner.input_batch.graph_greedy.gpu.item() == 1   # the last steps: greedy alone
        assert llm.engine.model_runner.steps_by_mode["FULL"] > 0
    finally:
        _release(llm)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_every_accepted_seed_runs_on_a_cuda_generator(tiny, mode):
    path, prompts = tiny
    llm = _llm(path, mode)
    try:
        for seed in (0, 2**63, 2**64 - 1):
            out = llm.generate([prompts[0]], SamplingParams(seed=seed, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
    finally:
        _release(llm)


def _seeded(n):
    return [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=10, ignore_eos=True,
                           presence_penalty=0.4 if i % 5 == 0 else 0.0) for i in range(n)]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_seeded_requests_reproduce_in_batches_and_under_preemption(tiny, mode):
    path, prompts = tiny
    params = _seeded(len(prompts))
    llm = _llm(path, mode)
    try:
        alone = [llm.generate([p], [s], use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(prompts, params)]
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        _release(llm)
    assert batched == alone
    for options in ({"num_kv_blocks": 12, "max_model_len": 128},
                    {"num_kv_blocks": 12, "max_model_len": 128, "async_scheduling": True}):
        llm = _llm(path, mode, **options)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.engine.scheduler.stats()["num_preemptions"] > 0
        finally:
            _release(llm)
        assert got == alone, options
