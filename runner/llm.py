"""LLM: offline batch generation on top of LLMEngine."""

from __future__ import annotations

import logging
from typing import Sequence

from tqdm.auto import tqdm

from configs import EngineConfig, SamplingParams
from runner.engine import InvalidRequestError, LLMEngine
from runner.outputs import RequestOutput

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """`LLM(model="path" | "default", **engine_options).generate(prompts, params)`.

    Options are EngineConfig's fields by name (dtype, device, cudagraph_mode, max_model_len,
    block_size, max_num_seqs, async_scheduling, ...). Use as a context manager, or call shutdown(),
    to release pipeline workers."""

    def __init__(self, model: str = "default", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order. A prompt the engine refuses (empty, too long, out-of-vocabulary ids)
        comes back finished with reason "abort" and `error` set; the others run normally."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        results: dict[int, RequestOutput] = {}
        ids: dict[str, int] = {}
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids[self.engine.add_request(prompt, p)] = index
            except InvalidRequestError as error:
                logger.warning("%s", error)
                token_ids = list(prompt) if not isinstance(prompt, str) else []
                results[index] = RequestOutput(request_id=f"rejected-{index}", prompt=prompt if isinstance(prompt, str)
                                               else None, prompt_token_ids=token_ids, text="", token_ids=[],
                                               finished=True, finish_reason="abort", error=str(error))
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

    def chat(self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with the generation prompt) and generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this checkpoint has none")
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                   for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
