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

from configs.kernel_config import active_kernel_config
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


@functools.cache
def _race_kernel():
    """runner/sampling/race_kernel.py (Triton), or None where Triton is not installed."""
    try:
        from runner.sampling import race_kernel
    except ImportError:
        return None
    return race_kernel


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
    candidates: int = 0
    """How many of each row's largest values the top-k/top-p thresholds need (host): the largest
    top_k, or 0 (the whole vocabulary, a full sort) when a row asks for top-p without top-k."""
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
            candidates=0 if any(k == 0 and p.top_p < 1.0 for k, p in zip(top_k, params)) else max(top_k),
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
    by min-p and top-k) as one per-row threshold on the logits, then an exponential race
    (`_race` in torch on a CPU; on a GPU runner/sampling/race_kernel.py does filter, temperature
    and race in one pass over the logits).
    Mixed batches compute both and pick per row with torch.where.
    """

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        raw = logits.float()  # no-op for float32; only the structured-output mask writes into it
        # A copy made here (bf16 logits) may be changed in place when the raw values are not needed.
        owned = raw is not logits and metadata.max_num_logprobs is None
        logits = raw
        if metadata.token_bitmask is not None:  # structured output: the constrained rows, on the device, first
            metadata.token_bitmask.apply(logits)
        if metadata.processors is not None:
            logits = metadata.processors.apply(logits, inplace=owned)
            owned = True
        greedy_ids = None if metadata.all_random else argmax_rows(logits)
        if metadata.all_greedy:
            sampled = greedy_ids
        else:
            kernel = (_race_kernel() if logits.is_cuda and logits.stride(1) == 1 and active_kernel_config().triton_sampling
                      else None)
            if kernel is not None:  # one pass over the logits (runner/sampling/race_kernel.py)
                threshold = self.threshold(logits, metadata)
                sampled = kernel.race(logits, self._temperature(metadata), threshold,
                                      kernel.row_seeds(logits.shape[0], metadata.generators, logits.device))
            else:
                sampled = self._race(self.masked_logits(logits, metadata, inplace=owned), metadata.generators)
            if greedy_ids is not None:
                sampled = torch.where(metadata.temperature < _SAMPLING_EPS, greedy_ids, sampled)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(raw, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _temperature(metadata: SamplingMetadata) -> torch.Tensor:
        """[N, 1]: the rows' temperatures, 1 for greedy rows (their draw is discarded anyway)."""
        return metadata.temperature.masked_fill(metadata.temperature < _SAMPLING_EPS, 1.0).unsqueeze(1)

    def masked_logits(self, logits: torch.Tensor, metadata: SamplingMetadata, inplace: bool = False) -> torch.Tensor:
        """Temperature-scaled logits with every filtered-out token set to -inf (a new tensor, or
        `logits` itself when `inplace`): every filter is one per-row threshold (`threshold`)."""
        temp = self._temperature(metadata)
        threshold = self.threshold(logits, metadata)
        drop = None if threshold is None else logits < threshold
        x = logits.div_(temp) if inplace else logits / temp
        if drop is not None:
            x = x.masked_fill_(drop, float("-inf"))
        return x

    def threshold(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
        """[N, 1]: the smallest logit min-p, top-k and top-p keep in each row (None: no filter).

        On the logits before temperature (dividing by a positive temperature keeps their order),
        so no scaled copy of the batch is needed: min-p from the row's maximum, top-k and top-p
        from the row's largest values only (`_top_k_top_p_threshold`: a top-k of the largest
        top_k, no sort of the vocabulary unless a row asks for top-p without top-k).
        """
        threshold = None
        if not metadata.no_min_p:
            # p_i < min_p * p_max  <=>  x_i / T < x_max / T + log(min_p): no softmax needed.
            # min_p = 0 gives log 0 = -inf, which masks nothing.
            log_min_p = metadata.min_p.log().unsqueeze(1)
            threshold = logits.amax(dim=-1, keepdim=True) + self._temperature(metadata) * log_min_p
        if not (metadata.no_top_k and metadata.no_top_p):
            top = self._top_k_top_p_threshold(logits, metadata, threshold)
            threshold = top if threshold is None else torch.maximum(threshold, top)
        return threshold

    def _top_k_top_p_threshold(self, x: torch.Tensor, metadata: SamplingMetadata,
                               min_p_threshold: torch.Tensor | None) -> torch.Tensor:
        """[N, 1]: the smallest logit top-k and top-p keep in each row (-inf: keep all).

        top-k keeps tokens >= the k-th largest value (ties with it are all kept); over the tokens
        min-p keeps, when fewer than k are left it keeps them all. top-p then keeps the smallest
        most-likely-first prefix whose mass, in the distribution (after temperature) renormalized
        over what min-p and top-k keep, is >= top_p: a token is kept when the mass of the tokens
        above it is < top_p (the most likely token always is); tokens tied with the last kept one
        are kept too.

        Only the `candidates` largest values of each row are needed (`torch.topk`, sorted): the
        top-k threshold is the k-th of them, and everything top-p keeps is among them. The only
        other tokens that count are those tied with a row's k-th value beyond the candidates:
        their number (one compare over the row) adds their mass to the renormalization.
        """
        vocab = x.shape[-1]
        k_max = metadata.candidates if 0 < metadata.candidates < vocab else vocab
        if k_max == vocab:
            values = x.sort(dim=-1, descending=True).values
        else:
            values = x.topk(k_max, dim=-1).values  # sorted, largest first
        if min_p_threshold is not None:
            values = values.masked_fill(values < min_p_threshold, float("-inf"))
        neg_inf = float("-inf")   # a Python scalar: no upload
        top_k = metadata.top_k
        if metadata.no_top_k:
            k_threshold = values.new_full((x.shape[0], 1), neg_inf)
        else:
            index = (top_k.clamp(max=k_max) - 1).clamp(min=0).unsqueeze(1)
            k_threshold = torch.where((top_k > 0).unsqueeze(1), values.gather(1, index), neg_inf)
        if metadata.no_top_p:
            return k_threshold
        temp = self._temperature(metadata)
        kept = (values >= k_threshold) & (values > float("-inf"))   # a prefix; min-p's -inf never
        weights = torch.where(kept, torch.exp((values - values[:, :1]) / temp), 0.0)
        total = weights.sum(dim=-1, keepdim=True)
        if k_max < vocab:  # ties with the k-th value past the candidates (k_threshold finite there)
            beyond = (x >= k_threshold).sum(dim=-1, keepdim=True) - kept.sum(dim=-1, keepdim=True)
            finite = torch.isfinite(k_threshold)
            total = total + torch.where(finite, beyond * torch.exp((k_threshold - values[:, :1]) / temp), 0.0)
        above = weights.cumsum(dim=-1) - weights   # mass of the candidates before each
        keep_p = kept & (above < metadata.top_p.unsqueeze(1) * total)
        last = (keep_p.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        p_threshold = torch.where((metadata.top_p < 1.0).unsqueeze(1), values.gather(1, last), neg_inf)
        return torch.maximum(k_threshold, p_threshold)

    @staticmethod
    def _race(x: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """Samples each row of softmax(x) via argmax(softmax(x) / q) = argmax(x - log q),
        q ~ Exp(1) i.i.d. (x: filtered, scaled logits, -inf where filtered out; changed in place).

        P(argmax = i) = p_i / sum(p) (the exponential race), so no softmax, cumsum or
        multinomial is needed and it stays a few batched kernels. q for the whole batch comes
        from the default generator; rows with a seeded request then redraw their q from their
        own generator, so a seeded row depends only on its own logits and generator state.
        """
        q = torch.empty_like(x).exponential_()
        for row, gen in generators.items():
            q[row].exponential_(generator=gen)
        # Exp(1) may return exactly 0 on some backends: log 0 = -inf would let a filtered token
        # (x = -inf) win with NaN. A tiny floor keeps log q finite.
        q.clamp_(min=torch.finfo(q.dtype).tiny).log_()
        return x.sub_(q).argmax(dim=-1)

    @staticmethod
    def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
        logprobs = torch.log_softmax(logits, dim=-1)
        sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))
        ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1)  # sorted, descending
        return LogprobsTensors(sampled_logprobs=sampled_lp.squeeze(1), sampled_ranks=ranks,
                               topk_token_ids=top_ids, topk_logprobs=top_lp)
