"""Issues 2 and 3 on the real embedded SmolLM2-135M-Instruct: HF parity, fp32, CPU."""

from __future__ import annotations

import pytest
import torch

from checkpoints import hf_greedy_generate, hf_prefill_logits
from configs import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "List three fruits.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for writing readable Python code, with a tiny example of a function that has a docstring.",
    "Who wrote Hamlet?",
]


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.embedded import ensure_smollm2
    path = ensure_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    return path, tokenizer, hf, prompts


@pytest.fixture(scope="module")
def llm(smollm2):
    from runner import LLM
    return LLM(model=str(smollm2[0]), dtype="float32", device="cpu")


def test_prefill_logits_match_hf(smollm2):
    from model_helpers import load_ours, prefill_logits
    path, tokenizer, hf, prompts = smollm2
    ours = load_ours(path)
    ids = [tokenizer.encode(p) for p in prompts[:4]]
    for got, prompt in zip(prefill_logits(ours, ids), ids):
        assert (got - hf_prefill_logits(hf, prompt)).abs().max().item() < 1e-4


def test_batch_greedy_tokens_match_hf_generate(smollm2, llm):
    path, tokenizer, hf, prompts = smollm2
    params = SamplingParams(temperature=0.0, max_tokens=40)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy_generate(hf, [tokenizer.encode(p) for p in prompts], params.max_tokens)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "Paris" in outs[0].outputs[0].text
    for out, exp in zip(outs, expected):
        assert out.outputs[0].text == tokenizer.decode(exp, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == ("stop" if exp[-1] in (hf.generation_config.eos_token_id,) else "length")


def test_chat_answer_says_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text and out.metrics.first_token_latency > 0


def test_stop_string_cuts_text(llm, smollm2):
    prompt = smollm2[3][0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop=["Paris"]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "Paris"
    assert "Paris" not in out.outputs[0].text and out.outputs[0].text.startswith("The capital")
