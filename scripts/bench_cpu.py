"""Engine vs HF transformers generate on a CPU: 32 prompts x 64 new tokens, same run, printed ratio.

    python scripts/bench_cpu.py [--model default] [--prompts 32] [--tokens 64] [--threads N]

Both sides: fp32, greedy, ignore EOS (every request makes exactly --tokens tokens). HF runs the
whole batch in one left-padded `generate` call with its KV cache, which is its fastest offline
path; the engine runs `LLM.generate` with continuous batching and the paged KV cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

TOPICS = ["the ocean", "a robot", "mountains", "coffee", "the moon", "a library", "trains", "winter"]


def make_prompts(tokenizer, n: int) -> list[str]:
    prompts = []
    for i in range(n):
        ask = f"Write {1 + i % 4} sentences about {TOPICS[i % len(TOPICS)]}" + " in detail" * (i % 3)
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                                     add_generation_prompt=True))
    return prompts


def bench_hf(path: str, prompts: list[str], tokens: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id or 0, temperature=None, top_p=None, top_k=None)
    with torch.inference_mode():
        model.generate(**{k: v[:2] for k, v in batch.items()}, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        started = time.perf_counter()
        out = model.generate(**batch, **kwargs)
        seconds = time.perf_counter() - started
    assert out.shape[1] - batch["input_ids"].shape[1] == tokens
    return len(prompts) * tokens / seconds


def bench_engine(path: str, prompts: list[str], tokens: int) -> float:
    from configs import SamplingParams
    from runner import LLM
    llm = LLM(model=path, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    assert all(len(o.token_ids) == tokens for o in outs)
    return len(prompts) * tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from runner.engine import resolve_model_path
    from transformers import AutoTokenizer
    path = resolve_model_path(args.model)
    prompts = make_prompts(AutoTokenizer.from_pretrained(path), args.prompts)
    engine_tps = bench_engine(path, prompts, args.tokens)
    hf_tps = bench_hf(path, prompts, args.tokens)
    result = {"prompts": args.prompts, "tokens": args.tokens, "threads": torch.get_num_threads(),
              "engine_tok_s": round(engine_tps, 1), "hf_tok_s": round(hf_tps, 1), "ratio": round(engine_tps / hf_tps, 2)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print("| engine tok/s | HF generate tok/s | ratio | threads |\n|---|---|---|---|")
    print(f"| {engine_tps:.1f} | {hf_tps:.1f} | {engine_tps / hf_tps:.2f}x | {torch.get_num_threads()} |")


if __name__ == "__main__":
    main()
