"""The one sampling path of a step, shared by synchronous and async scheduling.

`SamplingStage.launch` takes the step's sampling rows and a way to get their logits, enqueues
the sampling on the device and returns a `PendingOutput` at once: async scheduling keeps it in
flight, the synchronous engine resolves it at once (the same path plus a wait). The runner
hands over only the rows and the logits (or the greedy tokens its graph or its CPU LM head
already computed: `fast_greedy`, used only for a plain greedy step, where no row asks for
logprobs or a logit processor).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runner.outputs import ModelRunnerOutput, PendingOutput
from runner.sampling.logprobs import logprobs_entries
from runner.sampling.processors import LogitsProcessors
from runner.sampling.sampler import Sampler, SamplingMetadata
from runner.sampling.state import SamplingStates
from runner.scheduler import ScheduledRequest


_REQUEST_ID = operator.attrgetter("request_id")
_TEMPERATURE = operator.attrgetter("sampling_params.temperature")


def all_at_temperature_zero(reqs: list[ScheduledRequest]) -> bool:
    """Whether every row's temperature is exactly 0: the first condition of a plain greedy step,
    the only kind that takes `fast_greedy` (`SamplingStage._plan`). The runner asks it before the
    forward, to tell a decode graph whether to compute its greedy tokens
    (runner/model_runner.py `graph_takes_greedy`), so both read the one rule. A C-level pass."""
    return not any(map(_TEMPERATURE, reqs))


def _inside_min_tokens(reqs: list[ScheduledRequest], rows: list[int]) -> tuple[int, ...]:
    """Those of `rows` whose request has fewer output tokens than its min_tokens."""
    return tuple(row for row in rows if reqs[row].output_token_count < reqs[row].sampling_params.min_tokens)


@dataclass
class _Plan:
    """What a step's sampling needs from its requests' settings (device tensors included), kept
    for the next step with the same rows (`SamplingStage._plan`)."""
    inside_min_tokens: tuple[int, ...]
    """The rows whose request is still inside its min_tokens (their stop tokens are banned)."""
    min_token_rows: list[int]
    """The rows whose request has min_tokens at all: the only ones that can be inside them."""
    processors: LogitsProcessors | None
    metadata: SamplingMetadata | None
    """None: a plain greedy step (no processors, no logprobs)."""
    request_ids: list[str]
    num_logprobs: list[int | None] | None


class SamplingStage:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.sampler = Sampler()
        self.states = SamplingStates(vocab_size, device)
        self._last_plan: _Plan | None = None

    @property
    def generators(self) -> dict[str, torch.Generator]:
        return self.states.generators

    def release(self, request_ids) -> None:
        """Finished requests: their generators and token state go (preempted ones keep theirs)."""
        request_ids = list(request_ids)
        if request_ids:
            self._last_plan = None   # an id may come back as a new request, with other settings
        self.states.release(request_ids)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A small host tensor to the device without a host sync (a pageable copy would wait for
        the step in flight): through pinned memory, which the caching host allocator keeps until
        the copy has run."""
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def launch(self, reqs: list[ScheduledRequest], logits: Callable[[], torch.Tensor],
               fast_greedy: Callable[[], torch.Tensor],
               prompt_logprobs: Callable[[], dict] | None = None, token_bitmask=None) -> PendingOutput:
        """Sample one token for each of `reqs` (row i for reqs[i]). `logits()` gives their logits
        [len(reqs), V]; `fast_greedy()` their argmax, for a plain greedy step. `prompt_logprobs`
        (from `PromptLogprobs.launch`, enqueued before this) builds the step's prompt logprobs
        once its copies are on the host. `token_bitmask` (structured output, a TokenBitmask of the
        constrained rows, or None) is applied to the logits first; a step with one never takes
        `fast_greedy` (the graph's argmax or the CPU screen would ignore the mask): a plain greedy
        one takes the argmax of `logits()` under the mask, without the sampler's metadata."""
        if not reqs:
            if prompt_logprobs is None:
                return PendingOutput.ready(ModelRunnerOutput({}))
            return self._pending(reqs, torch.empty(0, dtype=torch.int64, device=self.device), None,
                                 prompt_logprobs)
        plan = self._plan(reqs)
        processors, metadata, logprobs = plan.processors, plan.metadata, None
        if metadata is None and token_bitmask is None:
            sampled = fast_greedy()
        elif metadata is None:  # structured greedy: the argmax under the mask
            sampled = token_bitmask.argmax(logits())
        else:
            metadata.token_bitmask = token_bitmask
            result = self.sampler(logits(), metadata)
            metadata.token_bitmask = None
            sampled, logprobs = result.sampled_token_ids, result.logprobs
            if processors is not None and not result.recorded:
                processors.record(sampled)
        return self._pending(reqs, sampled, logprobs, prompt_logprobs, plan)

    def _plan(self, reqs: list[ScheduledRequest]) -> _Plan:
        """The step's processors and metadata: the last step's while its rows are the same requests
        in the same order with the same rows inside min_tokens (what decode steps mostly are),
        else built (a loop over the rows and a few small uploads). The check is a C-level list
        compare of the ids, and a look at the rows that have min_tokens at all."""
        request_ids = list(map(_REQUEST_ID, reqs))
        plan = self._last_plan
        if plan is not None and plan.request_ids == request_ids:
            if _inside_min_tokens(reqs, plan.min_token_rows) == plan.inside_min_tokens:
                return plan
        params = [req.sampling_params for req in reqs]
        min_token_rows = [row for row, p in enumerate(params) if p.min_tokens > 0]
        inside = _inside_min_tokens(reqs, min_token_rows)
        processors = LogitsProcessors.build(reqs, self.states, self.vocab_size, self.to_device)
        metadata = None
        if processors is not None or not all_at_temperature_zero(reqs) or any(p.logprobs is not None for p in params):
            generators = {row: self.states.generator(req) for row, req in enumerate(reqs)
                          if req.sampling_params.seed is not None}
            metadata = SamplingMetadata.from_params(params, generators, self.device, processors, self.to_device)
        num_logprobs = [p.logprobs for p in params]
        self._last_plan = plan = _Plan(inside, min_token_rows, processors, metadata, request_ids,
                                       num_logprobs if any(k is not None for k in num_logprobs) else None)
        return plan

    def _pending(self, reqs: list[ScheduledRequest], sampled: torch.Tensor, logprobs,
                 prompt_logprobs: Callable[[], dict] | None = None, plan: _Plan | None = None) -> PendingOutput:
        # Non-blocking to the host: pinned destinations (`_to_copy` pins them for a CUDA source).
        host = sampled.to("cpu", non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            host_logprobs = [t.to("cpu", non_blocking=True) for t in (logprobs.topk_token_ids, logprobs.topk_logprobs,
                                                                       logprobs.sampled_logprobs,
                                                                       logprobs.sampled_ranks)]
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        if plan is not None:
            request_ids, num_logprobs = plan.request_ids, plan.num_logprobs
        else:
            request_ids = [req.request_id for req in reqs]
            num_logprobs = [req.sampling_params.logprobs for req in reqs]

        def finish() -> ModelRunnerOutput:
            token_ids = host.tolist()
            output = ModelRunnerOutput(dict(zip(request_ids, token_ids)))
            if host_logprobs is not None:
                top_ids, top_lps, sampled_lps, sampled_ranks = (t.tolist() for t in host_logprobs)
                output.logprobs = logprobs_entries(request_ids, num_logprobs, token_ids, sampled_lps, sampled_ranks,
                                                   top_ids, top_lps)
            if prompt_logprobs is not None:
                output.prompt_logprobs = prompt_logprobs()
            return output

        return PendingOutput(finish, event, sampled)
