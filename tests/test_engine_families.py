"""Phi-3, Gemma 2 and Gemma 3 text through the whole engine on CPU, token-exact with HF transformers
(float32, greedy): prompts longer than the sliding window (8 or 12 positions) and than a KV block,
with chunked prefill mixing prefill chunks and decode rows in one step, and a tiny cache that
forces preemption. The same families run in every CUDA graph mode in tests/test_engine_cuda.py."""

from __future__ import annotations

import pytest
import torch

from checkpoints import hf_greedy_generate, make_tiny_checkpoint
from configs import SamplingParams
from runner import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

FAMILIES = {
    # name: (family, checkpoint options, engine options)
    "phi3_window": ("phi3", {"sliding_window": 12}, {}),
    # max_model_len 64 = original_max_position_embeddings: longrope's short factors, as HF uses them.
    "phi3_longrope": ("phi3", {"rope_scaling": "longrope"}, {"max_model_len": 64}),
    "gemma2": ("gemma2", {}, {}),
    "gemma3": ("gemma3", {}, {}),
}
ENGINE_OPTIONS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 16, "max_num_seqs": 3},   # prefill chunks beside decode rows
    "preemption": {"num_kv_blocks": 8, "max_model_len": 128, "max_num_seqs": 4},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    kind, checkpoint_options, engine_options = FAMILIES[name]
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp(name) / name, kind, with_tokenizer=False,
                                    **checkpoint_options)
    g = torch.Generator().manual_seed(3)
    lengths = (3, 40, 17, 1, 29, 9) if "max_model_len" in engine_options else (3, 40, 17, 1, 70, 9)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    expected = hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)
    return name, path, engine_options, prompts, expected


@pytest.mark.parametrize("options", sorted(ENGINE_OPTIONS))
def test_greedy_tokens_match_hf(family, options):
    name, path, engine_options, prompts, expected = family
    llm = LLM(model=str(path), dtype="float32", device="cpu", **{**ENGINE_OPTIONS[options], **engine_options})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected, name
    if options == "preemption":
        assert llm.engine.scheduler.stats()["num_preemptions"] > 0


def test_gemma2_through_the_triton_backend(tmp_path):
    """The CUDA default backend's kernel (interpreted here: TRITON_INTERPRET=1) with Gemma 2's
    alternating windows and soft-caps, in chunked prefill and decode steps: HF's tokens."""
    from attention.kernels import unified_attention  # noqa: F401  (skips cleanly without triton)
    path, hf = make_tiny_checkpoint(tmp_path / "gemma2", "gemma2", with_tokenizer=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (20, 3, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = hf_greedy_generate(hf, prompts, params.max_tokens, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", device="cpu", attention_backend="triton",
              max_num_batched_tokens=16, max_num_seqs=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
