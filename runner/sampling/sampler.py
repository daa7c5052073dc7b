"""Batched token sampling: logit processors, greedy, temperature, min-p / top-k / top-p, seeds,
logprobs.

Everything runs on the logits' device for the whole batch at once. The only Python
loop is over rows whose request has a seed (one vectorized draw each), as in vLLM.
The sampler never reads a device value back to the host, so it adds no sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from configs.sampling_params import SamplingParams
from runner.sampling.kernels import aligned_width, sampling_kernel, triton_module
from runner.sampling.processors import LogitsProcessors


def argmax_rows(logits: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of 2-D logits; on a GPU by runner/greedy.py's two short launches
    (torch's one-block reduction is slow for one row of a large vocabulary: see that module), which
    skip their work while the device's `gate` holds 0 (see `greedy.argmax_rows`). On a CPU by
    `max(dim=-1).indices`: the same index (the first maximum; NaN wins as in argmax), and faster
    than argmax there for a decode batch's logits."""
    kernels = triton_module("greedy") if logits.is_cuda else None
    if kernels is not None:
        return kernels.argmax_rows(logits, gate)
    return logits.max(dim=-1).indices if logits.device.type == "cpu" else logits.argmax(dim=-1)

# Temperatures below this are greedy (as in vLLM): dividing by ~0 only overflows.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters as device tensors, plus host-side fast-path flags.

    The flags are computed on the host from the params, so the sampler can skip work
    (a sort, a softmax) without reading tensors back from the device. The derived columns
    (`scale` ... `top_k_index`) are what every step of the same rows needs from the params:
    computed once here (the stage keeps the metadata for the next steps with the same rows), so a
    step launches no kernel to rebuild them.
    """

    temperature: torch.Tensor  # [N] float32; < _SAMPLING_EPS means greedy
    top_k: torch.Tensor  # [N] int64; 0 = off (the sampler treats it as vocab size)
    top_p: torch.Tensor  # [N] float32; 1.0 = off
    min_p: torch.Tensor  # [N] float32; 0.0 = off
    greedy: torch.Tensor  # [N] bool: temperature < _SAMPLING_EPS
    scale: torch.Tensor  # [N, 1] float32: the temperature, 1 for greedy rows (their draw is discarded)
    min_p_offset: torch.Tensor  # [N, 1] float32: scale * log(min_p), -inf where min-p is off
    top_p_column: torch.Tensor  # [N, 1] float32: top_p
    top_p_on: torch.Tensor  # [N, 1] bool: top_p < 1
    top_k_on: torch.Tensor  # [N, 1] bool: top_k > 0
    top_k_index: torch.Tensor  # [N, 1] int64: max(top_k, 1) - 1, the k-th largest value's index
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    max_top_k: int = 0
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
                    device: torch.device | str, processors: LogitsProcessors | None = None,
                    to_device: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplingMetadata:
        """Builds the metadata for a batch whose row i samples with params[i].

        The columns are computed on the host and moved with three uploads (floats, ints, flags) by
        `to_device` (default: `.to(device)`); the fields are views of them. Generators of greedy
        rows are dropped: greedy rows draw no random numbers.
        """
        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        top_k = [max(p.top_k, 0) for p in params]  # -1 and 0 both mean off
        requested = [p.logprobs for p in params if p.logprobs is not None]
        floats, ints, flags = _columns(params, greedy, top_k)
        move = to_device or (lambda t: t.to(device))
        n = len(params)
        floats, ints, flags = move(floats)[:, :n], move(ints)[:, :n], move(flags)[:, :n]
        temperature, top_p, min_p, scale, min_p_offset = floats
        return cls(
            temperature=temperature, top_k=ints[0], top_p=top_p, min_p=min_p, greedy=flags[0],
            scale=scale.unsqueeze(1), min_p_offset=min_p_offset.unsqueeze(1), top_p_column=top_p.unsqueeze(1),
            top_p_on=flags[1].unsqueeze(1), top_k_on=flags[2].unsqueeze(1), top_k_index=ints[1].unsqueeze(1),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_k=all(k == 0 for k in top_k),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_min_p=all(p.min_p <= 0.0 for p in params),
            max_top_k=max(top_k, default=0),
            candidates=0 if any(k == 0 and p.top_p < 1.0 for k, p in zip(top_k, params)) else max(top_k, default=0),
            generators={i: g for i, g in generators.items() if not greedy[i]},
            max_num_logprobs=max(requested) if requested else None,
            processors=processors,
        )


def _columns(params: list[SamplingParams], greedy: list[bool],
             top_k: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host tensors of `SamplingMetadata.from_params`: float32 [5, W] (temperature, top_p,
    min_p, scale, min_p_offset), int64 [2, W] (top_k, top-k index), bool [3, W] (greedy, top-p on,
    top-k on), of which the first N = len(params) columns are the rows' (the rest zeros). The
    derived floats are computed in float32 by torch, as the sampler used to per step.
    W = `aligned_width` of N for the narrowest field (bool), so every field starts 16-byte
    aligned: with W = N the fields of a batch of, say, 14 rows were not, and the draw compiled a
    second variant inside serving (one that start-up had not compiled ahead)."""
    n = len(params)
    width = aligned_width(n, 1)
    floats = torch.zeros(5, width, dtype=torch.float32)
    floats[0, :n] = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    floats[1, :n] = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    floats[2, :n] = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    greedy_rows = torch.tensor(greedy, dtype=torch.bool)
    floats[3, :n] = floats[0, :n].masked_fill(greedy_rows, 1.0)
    floats[4, :n] = floats[3, :n] * floats[2, :n].log()   # min_p = 0: log 0 = -inf, which masks nothing
    ints = torch.zeros(2, width, dtype=torch.int64)
    ints[:, :n] = torch.tensor([top_k, [max(k, 1) - 1 for k in top_k]], dtype=torch.int64).view(2, n)
    flags = torch.zeros(3, width, dtype=torch.bool)
    flags[:, :n] = torch.stack([greedy_rows, floats[1, :n] < 1.0, torch.tensor(top_k, dtype=torch.int64) > 0])
    return floats, ints, flags


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
    recorded: bool = False
    """The draw already counted the tokens into the penalty state (`LogitsProcessors.record` is
    then not needed)."""


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

    def __init__(self) -> None:
        self._workspace: dict = {}
        """The GPU pass's buffers, kept for the next step of the same shapes (logits_pass)."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        passed = self._gpu_pass(logits, metadata)
        if passed is not None:
            return passed
        # float32 logits only where something writes into them or reads them at full precision
        # (the mask, the processors, logprobs); else the model's dtype is read as it is (a bf16
        # value is exact in float32, so every threshold and compare gives what a copy would).
        raw = logits
        if (metadata.token_bitmask is not None or metadata.processors is not None
                or metadata.max_num_logprobs is not None):
            raw = logits.float()  # no-op for float32; only the structured-output mask writes into it
        # A copy made here (bf16 logits) may be changed in place when the raw values are not needed.
        owned = raw is not logits and metadata.max_num_logprobs is None
        logits = raw
        if metadata.token_bitmask is not None:  # structured output: the constrained rows, on the device, first
            metadata.token_bitmask.apply(logits)
        if metadata.processors is not None:
            logits = metadata.processors.apply(logits, inplace=owned)
            owned = True
        return self._draw(logits, raw, metadata, owned)

    def _gpu_pass(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput | None:
        """On a GPU with the Triton sampling kernels: the structured-output mask, the penalties
        (where they are all the processors do), the float32 copy they need and the top-k
        candidates of the thresholds in one pass over the logits (runner/sampling/logits_pass.py),
        then the draw. None where the pass does not apply: other processors this step, a mask that
        does not cover the logits or with logprobs, no Triton, or nothing for it to do."""
        kernel = sampling_kernel("sampling.logits_pass", logits)
        processors, bitmask = metadata.processors, metadata.token_bitmask
        if (kernel is None or (processors is not None and not processors.only_penalties)
                or (bitmask is not None and (not bitmask.read_on_device(logits)
                                             or metadata.max_num_logprobs is not None))):
            return None   # (logprobs under a mask are those of the masked logits: the torch path's order)
        vocab = logits.shape[1]
        k = 0 if metadata.all_greedy else self._top_count(metadata, vocab)
        columns = min(k + 1, vocab) if 0 < k < vocab else 0
        if columns > kernel.MAX_CANDIDATES:
            columns = 0   # torch.topk
        penalties = None if processors is None else processors.penalty_columns()
        if penalties is None and bitmask is None and not columns:
            return None
        out = None
        if penalties is not None or bitmask is not None:   # kept for the next step of the same shape
            out = self._workspace.get("out")
            if out is None or out.shape != logits.shape or out.device != logits.device:
                out = self._workspace["out"] = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        mask = None if bitmask is None else (bitmask.bitmask, bitmask.constrained)
        settings = None
        if columns:   # the thresholds in the sort's launch
            settings = (metadata.scale, metadata.min_p_offset, metadata.top_k, metadata.top_p)
        candidates = kernel.logits_pass(logits, out, penalties, columns, mask, settings, self._workspace)
        raw = logits.float() if metadata.max_num_logprobs is not None else logits
        # The race counts its tokens into the penalty state where every row races (no greedy row
        # takes its argmax after it) and no multi-token bad word keeps a window of recent tokens.
        record = None
        if penalties is not None and metadata.all_random and processors.states.recent.shape[1] == 0:
            record = (penalties.slots, penalties.output_counts, penalties.seen)
        return self._draw(logits if out is None else out, raw, metadata, owned=out is not None, candidates=candidates,
                          record=record)

    def _draw(self, logits: torch.Tensor, raw: torch.Tensor, metadata: SamplingMetadata, owned: bool,
              candidates=None, record=None) -> SamplerOutput:
        """The tokens of the processed `logits` (greedy argmax, the filtered random draw) and the
        logprobs of `raw`; `candidates`: the thresholds' candidates, if the GPU pass made them;
        `record`: the penalty state the GPU draw counts its tokens into (runner/sampling/race_kernel.py)."""
        greedy_ids = None if metadata.all_random else argmax_rows(logits)
        recorded = False
        if metadata.all_greedy:
            sampled = greedy_ids
        else:
            kernel = sampling_kernel("sampling.race_kernel", logits)
            if kernel is not None:  # one pass over the logits (runner/sampling/race_kernel.py)
                sampled = kernel.race(logits, metadata.scale, self.threshold(logits, metadata, candidates),
                                      kernel.row_seeds(logits.shape[0], metadata.generators, logits.device),
                                      candidates, record)
                recorded = record is not None
            else:
                sampled = self._race(self.masked_logits(logits, metadata, inplace=owned), metadata.generators)
            if greedy_ids is not None:
                sampled = torch.where(metadata.greedy, greedy_ids, sampled)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(raw, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, recorded=recorded)

    def masked_logits(self, logits: torch.Tensor, metadata: SamplingMetadata, inplace: bool = False) -> torch.Tensor:
        """Temperature-scaled float32 logits with every filtered-out token set to -inf (a new
        tensor, or `logits` itself when `inplace`, float32 logits the caller owns): every filter is
        one per-row threshold (`threshold`)."""
        threshold = self.threshold(logits, metadata)
        drop = None if threshold is None else logits < threshold
        x = logits.div_(metadata.scale) if inplace else logits / metadata.scale   # float32 either way
        if drop is not None:
            x = x.masked_fill_(drop, float("-inf"))
        return x

    def threshold(self, logits: torch.Tensor, metadata: SamplingMetadata, candidates=None) -> torch.Tensor | None:
        """[N, 1] float32: the smallest logit min-p, top-k and top-p keep in each row (None: no filter).
        `candidates`: the GPU pass's `Candidates` (runner/sampling/logits_pass.py), made with the
        rows' settings: their thresholds are already computed, by the same rules.

        On the logits before temperature (dividing by a positive temperature keeps their order),
        so no scaled copy of the batch is needed: min-p from the row's maximum, top-k and top-p
        from the row's largest values only (a top-k of the largest top_k, no sort of the
        vocabulary unless a row asks for top-p without top-k). On a GPU with Triton sampling on,
        one launch after the top-k (runner/sampling/threshold_kernel.py); else torch ops
        (`_top_k_top_p_threshold`), the reference of that kernel.
        """
        if metadata.no_min_p and metadata.no_top_k and metadata.no_top_p:
            return None
        kernel = sampling_kernel("sampling.threshold_kernel", logits)
        if kernel is not None:
            if candidates is not None:   # computed in the pass's sort launch
                return candidates.threshold
            values, k = self._candidates(logits, metadata, extra=1)
            return kernel.thresholds(values, k, logits, metadata.scale, metadata.min_p_offset, metadata.top_k,
                                     metadata.top_p)
        threshold = None
        if not metadata.no_min_p:
            # p_i < min_p * p_max  <=>  x_i / T < x_max / T + log(min_p): no softmax needed.
            # min_p = 0 gives log 0 = -inf, which masks nothing.
            threshold = logits.amax(dim=-1, keepdim=True).float() + metadata.min_p_offset
        if not (metadata.no_top_k and metadata.no_top_p):
            top = self._top_k_top_p_threshold(logits, metadata, threshold)
            threshold = top if threshold is None else torch.maximum(threshold, top)
        return threshold

    @staticmethod
    def _top_count(metadata: SamplingMetadata, vocab: int) -> int:
        """How many of each row's largest values the top-k / top-p thresholds need: the largest
        top_k, the whole vocabulary (a full sort) when a row asks for top-p without top-k, 0 when
        no row asks for either."""
        if metadata.no_top_k and metadata.no_top_p:
            return 0
        return metadata.candidates if 0 < metadata.candidates < vocab else vocab

    @staticmethod
    def _candidates(x: torch.Tensor, metadata: SamplingMetadata, extra: int = 0) -> tuple[torch.Tensor, int]:
        """(values, k): each row's largest values, sorted, largest first: the `k` that the
        thresholds need (the largest top_k, or the whole vocabulary when a row asks for top-p
        without top-k) and `extra` more where the vocabulary has them; just the maximum (k = 1)
        for min-p alone. In the logits' dtype."""
        vocab = x.shape[-1]
        k = Sampler._top_count(metadata, vocab)
        if k == 0:
            return x.amax(dim=-1, keepdim=True), 1
        if k == vocab:
            return x.sort(dim=-1, descending=True).values, vocab
        return x.topk(min(k + extra, vocab), dim=-1).values, k

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
        values, k_max = self._candidates(x, metadata)
        values = values.float()
        if min_p_threshold is not None:
            values = values.masked_fill(values < min_p_threshold, float("-inf"))
        neg_inf = float("-inf")   # a Python scalar: no upload
        if metadata.no_top_k:
            k_threshold = values.new_full((x.shape[0], 1), neg_inf)
        else:
            index = metadata.top_k_index
            if metadata.max_top_k > k_max:   # top_k past the vocabulary
                index = index.clamp(max=k_max - 1)
            k_threshold = torch.where(metadata.top_k_on, values.gather(1, index), neg_inf)
        if metadata.no_top_p:
            return k_threshold
        temp = metadata.scale
        kept = (values >= k_threshold) & (values > float("-inf"))   # a prefix; min-p's -inf never
        weights = torch.where(kept, torch.exp((values - values[:, :1]) / temp), 0.0)
        total = weights.sum(dim=-1, keepdim=True)
        if k_max < vocab:  # ties with the k-th value past the candidates (k_threshold finite there)
            beyond = (x >= k_threshold).sum(dim=-1, keepdim=True) - kept.sum(dim=-1, keepdim=True)
            finite = torch.isfinite(k_threshold)
            total = total + torch.where(finite, beyond * torch.exp((k_threshold - values[:, :1]) / temp), 0.0)
        above = weights.cumsum(dim=-1) - weights   # mass of the candidates before each
        keep_p = kept & (above < metadata.top_p_column * total)
        last = (keep_p.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        p_threshold = torch.where(metadata.top_p_on, values.gather(1, last), neg_inf)
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
