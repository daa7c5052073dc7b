"""LLM: offline batch generation on top of LLMEngine."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Sequence

from tqdm.auto import tqdm

from configs import EngineConfig, RequestOutputKind, SamplingParams
from runner.engine import InvalidRequestError, LLMEngine
from runner.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict
"""A prompt as vLLM takes it: text, token ids, {"prompt": text} (TextPrompt) or
{"prompt_token_ids": [...]} (TokensPrompt)."""


def _normalize_prompts(prompts) -> list[PromptType]:
    """One prompt or a list of them -> a list (a list of ints is one token-id prompt)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Iterable) or isinstance(prompts, bytes):
        raise TypeError(f"prompts are a string, a list of token ids, a prompt dict or a list of those; "
                        f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _engine_prompt(prompt: PromptType) -> str | list[int]:
    """The text or token ids inside a vLLM-style prompt; a malformed one raises ValueError."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids'; got keys {sorted(prompt)}")
    if isinstance(prompt, (str, list, tuple)):
        return prompt if isinstance(prompt, str) else list(prompt)
    raise ValueError(f"a prompt is a string, a list of token ids or a dict; got {type(prompt).__name__}")


def _final_only(params: list[SamplingParams | None]) -> list[SamplingParams]:
    """The params with output_kind FINAL_ONLY: one copy per distinct params object."""
    copies: dict[int, SamplingParams] = {}
    out = []
    for p in params:
        p = p or SamplingParams()
        if p.output_kind is not RequestOutputKind.FINAL_ONLY:
            if id(p) not in copies:
                copies[id(p)] = p.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY})
            p = copies[id(p)]
        out.append(p)
    return out


class LLM:
    """`LLM(model="path" | pathlib.Path(...) | "default", **engine_options).generate(prompts, sampling_params)`, as in vLLM.

    Options are EngineConfig's fields by name (dtype, device, cudagraph_mode, max_model_len,
    block_size, max_num_seqs, async_scheduling, tensor_parallel_size, pipeline_parallel_size, ...).
    Use as a context manager, or call shutdown(), to release the worker processes of a
    tensor/pipeline parallel engine (docs/PARALLEL.md)."""

    def __init__(self, model: str | os.PathLike = "default", **kwargs) -> None:
        self._shut_down = False
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order, each with its `n` completions. A prompt the engine refuses (empty,
        too long, out-of-vocabulary ids), or one that fails while it runs, comes back finished with
        reason "abort" and `error` set; the others run normally. Requests run as FINAL_ONLY (as in
        vLLM): one output each, when finished, whatever `output_kind` the params name."""
        if self._shut_down:
            raise RuntimeError("this LLM has been shut down (LLM.shutdown() or the end of its `with` block); "
                               "make a new LLM to generate again")
        prompts = _normalize_prompts(prompts)
        params = sampling_params
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        params = _final_only(params)
        results: dict[int, RequestOutput] = {}
        ids: dict[str, int] = {}
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids[self.engine.add_request(_engine_prompt(prompt), p)] = index
            except (InvalidRequestError, ValueError) as error:
                logger.warning("%s", error)
                results[index] = self._rejected(index, prompt, error)
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in ids:
                        results[ids.pop(output.request_id)] = output
                        bar.update(1)
        finally:
            bar.close()
            for request_id in list(ids):  # interrupted: leave nothing queued behind
                self.engine.abort_request(request_id)
        return [results[i] for i in range(len(prompts))]

    @staticmethod
    def _rejected(index: int, prompt: PromptType, error: Exception) -> RequestOutput:
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        token_ids = list(token_ids) if isinstance(token_ids, (list, tuple)) else []   # as given, whatever it was
        completion = CompletionOutput(0, "", [], finish_reason="abort")
        return RequestOutput(f"rejected-{index}", text if isinstance(text, str) else None, token_ids, None,
                             [completion], True, error=str(error))

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with the generation prompt) and generate; one
        conversation (a list of messages) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this checkpoint has none")
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True,
                                                      **(chat_template_kwargs or {}))
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def shutdown(self) -> None:
        """Stop the engine and give back what it holds (an in-process engine: its KV cache and graphs);
        `generate` afterwards raises."""
        self._shut_down = True
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
