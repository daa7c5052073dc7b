"""Batched token sampling: logit processors, greedy, temperature, min-p / top-k / top-p, seeds,
logprobs.

Everything runs on the logits' device for the whole batch at once. The only Python
loop is over rows whose request has a seed (one vectorized draw each), as in vLLM.
The sampler never reads a device value back to the host, so it adds no sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from configs.sampling_params import SamplingParams
from runner.sampling.processors import LogitsProcessors


@functools.cache
def _greedy_kernels():
    """runner/greedy.py (Triton), or None where Triton is not installed (it is optional)."""
    try:
        from runner import greedy
    except ImportError:
        return None
    return greedy


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of 2-D logits; on a GPU by runner/greedy.py's two short launches
    (torch's one-block reduction is slow for one row of a large vocabulary: see that module). On a
    CPU by `max(dim=-1).indices`: the same index (the first maximum; NaN wins as in argmax), and
    faster than argmax there for a decode batch's logits."""
    kernels = _greedy_kernels() if logits.is_cuda else None
    if kernels is not None:
        return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices if logits.device.type == "cpu" else logits.argmax(dim=-1)

# Temperatures below this are greedy (as in vLLM): dividing by ~0 only overflows.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters as device tensors, plus host-side fast-path flags.

    The flags are computed on the host from the params, so the sampler can skip work
    (a sort, a softmax) without reading tensors back from the device.
    """

    temperature: torch.Tensor  # [N] float32; < _SAMPLING_EPS means greedy
    top_k: torch.Tensor  # [N] int64; 0 = off (the sampler treats it as vocab size)
    top_p: torch.Tensor  # [N] float32; 1.0 = off
    min_p: torch.Tensor  # [N] float32; 0.0 = off
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator
    max_num_logprobs: int | None = None  # None: no row asked for logprobs
    token_bitmask: object | None = None
    """Structured output (runner/structured_output.TokenBitmask): its rows' disallowed tokens go to
    -inf before anything else; None when no row is constrained."""
    processors: LogitsProcessors | None = None  # None: no row's logits change this step

    @classmethod
    def from_params(cls, params: list[SamplingParams], generators: dict[int, torch.Generator],
                    device: torch.device | str, processors: LogitsProcessors | None = None) -> SamplingMetadata:
        """Builds the metadata for a batch whose row i samples with params[i].

        Generators of greedy rows are dropped: greedy rows draw no random numbers.
        """
        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        top_k = [max(p.top_k, 0) for p in params]  # -1 and 0 both mean off
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_k=all(k == 0 for k in top_k),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_min_p=all(p.min_p <= 0.0 for p in params),
            generators={i: g for i, g in generators.items() if not greedy[i]},
            max_num_logprobs=max(requested) if requested else None,
            processors=processors,
        )


@dataclass
class LogprobsTensors:
    """Raw logprobs: log_softmax of the logits as the model produced them, before
    temperature and filtering (vLLM's default logprobs_mode="raw_logprobs"). Rows that
    asked for fewer than max_num_logprobs (or none) are sliced by the caller."""

    sampled_logprobs: torch.Tensor  # [N] float32, logprob of the sampled token
    sampled_ranks: torch.Tensor  # [N] int64, 1 + number of tokens with a strictly larger logprob
    topk_token_ids: torch.Tensor  # [N, k] int64, most likely first
    topk_logprobs: torch.Tensor  # [N, k] float32, descending


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None


class Sampler:
    """Turns a batch of logits [N, V] into one token per row.

    The logit processors (min_tokens, penalties, bias, allowed ids, bad words) change the logits
    first; logprobs are those of the logits as the model produced them (vLLM's default).
    Greedy rows take the argmax. Random rows: logits / temperature, then min-p, top-k and
    top-p masks (vLLM's order; top-p is taken over the distribution already renormalized
    by min-p and top-k), then softmax and an exponential race (see `_race`).
    Mixed batches compute both and pick per row with torch.where.
    """

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        raw = logits = logits.float()  # no-op for float32; only the structured-output mask writes into it
        if metadata.token_bitmask is not None:  # structured output: the constrained rows, on the device, first
            metadata.token_bitmask.apply(logits)
        if metadata.processors is not None:
            logits = metadata.processors.apply(logits)
        greedy_ids = None if metadata.all_random else argmax_rows(logits)
        if metadata.all_greedy:
            sampled = greedy_ids
        else:
            probs = torch.softmax(self.masked_logits(logits, metadata), dim=-1)
            sampled = self._race(probs, metadata.generators)
            if greedy_ids is not None:
                sampled = torch.where(metadata.temperature < _SAMPLING_EPS, greedy_ids, sampled)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(raw, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def masked_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature-scaled logits with every filtered-out token set to -inf (a new tensor).

        Greedy rows are scaled by 1 instead of 0; their result is discarded anyway.
        """
        temp = metadata.temperature
        x = logits / temp.masked_fill(temp < _SAMPLING_EPS, 1.0).unsqueeze(1)
        if not metadata.no_min_p:
            # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p): no softmax needed.
            # min_p = 0 gives log 0 = -inf, which masks nothing.
            threshold = x.amax(dim=-1, keepdim=True) + metadata.min_p.log().unsqueeze(1)
            x = x.masked_fill(x < threshold, float("-inf"))
        if not (metadata.no_top_k and metadata.no_top_p):
            x = self._top_k_top_p(x, metadata)
        return x

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """One ascending sort serves both filters, with per-row thresholds from tensors.

        top-k keeps tokens >= the k-th largest value (ties with it are all kept).
        top-p keeps the smallest descending-probability prefix whose mass is >= top_p:
        the token that brings the mass to top_p is included, and the most likely token
        is always kept. In the ascending order that is "drop token i if the mass of
        tokens up to and including i is <= 1 - top_p".
        """
        vocab = x.shape[-1]
        sorted_x, order = x.sort(dim=-1)
        if not metadata.no_top_k:
            k = metadata.top_k.masked_fill(metadata.top_k <= 0, vocab).clamp(max=vocab)
            kth_largest = sorted_x.gather(1, (vocab - k).unsqueeze(1))
            sorted_x = sorted_x.masked_fill(sorted_x < kth_largest, float("-inf"))
        if not metadata.no_top_p:
            cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
            drop = cum <= (1.0 - metadata.top_p).unsqueeze(1)
            drop[:, -1] = False
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return sorted_x.scatter(1, order, sorted_x)

    @staticmethod
    def _race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """Samples each row of probs via argmax(probs / q), q ~ Exp(1) i.i.d.

        P(argmax = i) = p_i / sum(p) (the exponential race), so no cumsum/multinomial is
        needed and it stays one batched kernel. q for the whole batch comes from the
        default generator; rows with a seeded request then redraw their q from their own
        generator, so a seeded row depends only on its own logits and generator state.
        """
        q = torch.empty_like(probs).exponential_()
        for row, gen in generators.items():
            q[row].exponential_(generator=gen)
        # Exp(1) may return exactly 0 on some backends; 0/0 = NaN would win the argmax and
        # pick a filtered token. A tiny floor keeps filtered tokens (p = 0) at 0.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)

    @staticmethod
    def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
        logprobs = torch.log_softmax(logits, dim=-1)
        sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))
        ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1)  # sorted, descending
        return LogprobsTensors(sampled_logprobs=sampled_lp.squeeze(1), sampled_ranks=ranks,
                               topk_token_ids=top_ids, topk_logprobs=top_lp)
