"""Run our model outside the engine: flattened prefill with no KV cache (the warm-up case)."""

from __future__ import annotations

import torch

from attention.backends.torch_sdpa import TorchSDPABackend
from attention.forward_context import ForwardContext, set_forward_context
from models import build_model, load_hf_config, model_spec
from runner.input_batch import InputBatch


def load_ours(path, dtype=torch.float32, load_format="auto"):
    spec = model_spec(load_hf_config(path))
    return build_model(spec, path, device=torch.device("cpu"), dtype=dtype, load_format=load_format)


@torch.inference_mode()
def prefill_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position of every prompt, all prompts in ONE flattened forward."""
    total = sum(len(p) for p in prompts)
    batch = InputBatch(total, len(prompts), 1, 16, torch.device("cpu"))
    common = batch.prepare(prompts, [0] * len(prompts), [[] for _ in prompts], total, len(prompts),
                              slots_enabled=False)
    context = ForwardContext(common, None, TorchSDPABackend())
    input_ids, positions = batch.model_inputs(total)
    with set_forward_context(context):
        hidden = model(input_ids, positions)
    logits = model.compute_logits(hidden)
    starts = common.query_start_loc_cpu.tolist()
    return [logits[a:b] for a, b in zip(starts[:-1], starts[1:])]


def mixed_step_tokens(engine, mixed: list[list[int]], params) -> list[list[int]]:
    """Request 0 decodes while requests 1 and 2 prefill, so one step holds both kinds; the finished
    token ids of the three requests, in order."""
    engine.add_request(mixed[0], params, request_id="m0")
    while True:
        outs = engine.step()
        if outs and len(outs[0].outputs[0].token_ids) == 2:
            break
    engine.add_request(mixed[1], params, request_id="m1")
    engine.add_request(mixed[2], params, request_id="m2")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done["m0"], done["m1"], done["m2"]]


def generated_tokens(llm, prompts, params) -> list[list[int]]:
    """The token ids of each prompt's first completion, in order."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
