"""Logit controls and penalties, batched over the step's rows (vLLM's meanings and order).

`LogitsProcessors.build` runs on the host once per step: a loop over the ROWS (never over the
vocabulary) that turns each row's settings into flat index tensors; `apply` then changes the
logits of the whole batch with a few indexed kernels, on the device, without a host sync.
Rows without a feature share the step with rows that use it and are left untouched.

Order (vLLM's sampler): allowed_token_ids, bad words, min_tokens, logit_bias, then the
repetition, frequency and presence penalties; temperature and top-k/top-p/min-p come after, in
the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.sampling.kernels import aligned_width, sampling_kernel, triton_module
from runner.sampling.state import SamplingStates, needs_token_state
from runner.scheduler import ScheduledRequest

_NEG_INF = float("-inf")


def needs_processors(req: ScheduledRequest) -> bool:
    """Whether the row's logits must be changed this step (the greedy fast paths cannot serve it)."""
    return req.logits_processors or (req.output_token_count < req.sampling_params.min_tokens
                                     and bool(req.stop_token_ids))


@dataclass
class _Penalties:
    rows: torch.Tensor        # [P] int64, rows of the batch
    slots: torch.Tensor       # [P] int64, their SamplingStates slots
    presence: torch.Tensor    # [P, 1] float32
    frequency: torch.Tensor   # [P, 1] float32
    repetition: torch.Tensor  # [P, 1] float32
    any_repetition: bool
    any_additive: bool
    all_rows: bool = False
    """Every row of the batch, in order: the logits are changed in place, no gather and scatter."""
    row_slots: torch.Tensor | None = None
    """[N] int64: every row's slot, -1 for rows without penalties (the GPU pass's columns)."""
    row_factors: torch.Tensor | None = None
    """[3, N] float32: every row's repetition (1: off), frequency and presence (0: off)."""


@dataclass
class _StateRows:
    """The rows whose sampled tokens `SamplingStates.record` counts after each step, with what it
    needs kept for the plan's steps (so a step launches only the record itself)."""
    rows: torch.Tensor        # [S] int64, rows of the batch
    slots: torch.Tensor       # [S] int64, their SamplingStates slots
    offsets: torch.Tensor     # [S] int64, slots * vocab_size: the slots' rows in the flattened counts
    ones: torch.Tensor        # [S] int32
    all_rows: bool
    """Every row of the batch, in order: the sampled tokens are recorded as they are, no gather."""


@dataclass
class _BadWordPrefixes:
    """Multi-token bad words: ban `last` in `rows` where the output's tail equals `prefix`."""
    rows: torch.Tensor        # [B] int64
    slots: torch.Tensor       # [B] int64
    prefix: torch.Tensor      # [B, W] int64, right-aligned; -2 (never a token, never -1) pads the left
    last: torch.Tensor        # [B] int64


@dataclass
class LogitsProcessors:
    """One step's logit changes as device index tensors (None: nothing of that kind this step)."""
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, tokens) set to -inf: single-token bad words, and EOS / stop ids inside min_tokens."""
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(rows that restrict, their local row index per allowed pair, allowed tokens)."""
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(rows, tokens, biases) added."""
    bad_word_prefixes: _BadWordPrefixes | None = None
    penalties: _Penalties | None = None
    states: SamplingStates | None = None
    state_rows: _StateRows | None = None
    _penalty_columns: object = None
    """`penalty_columns`' result, kept for the next steps of the plan."""

    @classmethod
    def build(cls, reqs: list[ScheduledRequest], states: SamplingStates, vocab_size: int,
              to_device) -> LogitsProcessors | None:
        """The processors of a step whose row i samples for reqs[i]; None when no row needs any.
        `to_device` moves a small host tensor to the logits' device without a host sync."""
        if not any(needs_processors(req) for req in reqs):
            return None
        banned_rows, banned_tokens = [], []
        allowed_rows, allowed_local, allowed_tokens = [], [], []
        bias_rows, bias_tokens, bias_values = [], [], []
        prefix_rows, prefix_slots, prefixes, prefix_last = [], [], [], []
        pen_rows, pen_slots, presence, frequency, repetition = [], [], [], [], []
        state_rows, state_slots = [], []
        for row, req in enumerate(reqs):
            params = req.sampling_params
            if params.allowed_token_ids is not None:
                allowed_local += [len(allowed_rows)] * len(params.allowed_token_ids)
                allowed_rows.append(row)
                allowed_tokens += params.allowed_token_ids
            slot = states.slot(req) if needs_token_state(req) else None
            if slot is not None:
                state_rows.append(row)
                state_slots.append(slot)
            for word in req.bad_words_token_ids or ():
                if len(word) == 1:
                    banned_rows.append(row)
                    banned_tokens.append(word[0])
                else:
                    prefix_rows.append(row)
                    prefix_slots.append(slot)
                    prefixes.append(word[:-1])
                    prefix_last.append(word[-1])
            if req.output_token_count < params.min_tokens:
                stops = [t for t in req.stop_token_ids if 0 <= t < vocab_size]
                banned_rows += [row] * len(stops)
                banned_tokens += stops
            if params.logit_bias:
                bias_rows += [row] * len(params.logit_bias)
                bias_tokens += params.logit_bias.keys()
                bias_values += params.logit_bias.values()
            if slot is not None and (params.presence_penalty or params.frequency_penalty
                                     or params.repetition_penalty != 1.0):
                pen_rows.append(row)
                pen_slots.append(slot)
                presence.append(params.presence_penalty)
                frequency.append(params.frequency_penalty)
                repetition.append(params.repetition_penalty)

        def ints(values: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.int64))

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.float32).unsqueeze(1))

        out = cls(states=states)
        if banned_rows:
            out.banned = (ints(banned_rows), ints(banned_tokens))
        if allowed_rows:
            out.allowed = (ints(allowed_rows), ints(allowed_local), ints(allowed_tokens))
        if bias_rows:
            out.bias = (ints(bias_rows), ints(bias_tokens),
                        to_device(torch.tensor(bias_values, dtype=torch.float32)))
        if prefix_rows:
            width = states.recent.shape[1]
            padded = [[-2] * (width - len(p)) + p for p in prefixes]
            out.bad_word_prefixes = _BadWordPrefixes(ints(prefix_rows), ints(prefix_slots),
                                                     ints(padded).view(len(padded), width), ints(prefix_last))
        if pen_rows:
            count = len(reqs)
            row_slots, row_rep, row_freq, row_pres = [-1] * count, [1.0] * count, [0.0] * count, [0.0] * count
            for i, row in enumerate(pen_rows):
                row_slots[row], row_rep[row], row_freq[row], row_pres[row] = (pen_slots[i], repetition[i],
                                                                              frequency[i], presence[i])
            factors = torch.ones(3, aligned_width(count, 4), dtype=torch.float32)   # one penalty-pass variant
            factors[:, :count] = torch.tensor([row_rep, row_freq, row_pres], dtype=torch.float32)
            out.penalties = _Penalties(ints(pen_rows), ints(pen_slots), floats(presence), floats(frequency),
                                       floats(repetition), any(r != 1.0 for r in repetition),
                                       any(p or f for p, f in zip(presence, frequency)),
                                       pen_rows == list(range(count)), ints(row_slots), to_device(factors)[:, :count])
        if state_rows:
            # One upload: rows, slots, offsets.
            rows, slots, offsets = ints(state_rows + state_slots + [s * vocab_size for s in state_slots]).view(3, -1)
            out.state_rows = _StateRows(rows, slots, offsets, torch.ones_like(rows, dtype=torch.int32),
                                        state_rows == list(range(len(reqs))))
        return out

    def apply(self, logits: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """The processed logits (float32): a new tensor, or with `inplace` (float32 `logits` the
        caller owns) `logits` itself, changed (no copy of the batch's logits)."""
        x = logits if inplace else logits.float().clone()
        if self.allowed is not None:
            rows, local, tokens = self.allowed
            keep = torch.zeros(rows.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
            keep[local, tokens] = True
            x[rows] = x[rows].masked_fill(~keep, _NEG_INF)
        if self.bad_word_prefixes is not None:
            b = self.bad_word_prefixes
            tail = self.states.recent[b.slots]
            match = ((tail == b.prefix) | (b.prefix == -2)).all(dim=1)
            # Adding -inf where the prefix matches and 0 elsewhere bans without a host-side mask.
            x.index_put_((b.rows, b.last), torch.zeros_like(b.last, dtype=x.dtype).masked_fill(match, _NEG_INF),
                         accumulate=True)
        if self.banned is not None:
            x[self.banned] = _NEG_INF   # a Python scalar: no host-to-device copy (which would sync)
        if self.bias is not None:
            rows, tokens, values = self.bias
            x.index_put_((rows, tokens), values, accumulate=True)
        if self.penalties is not None:
            x = self._apply_penalties(x, self.penalties)
        return x

    @property
    def only_penalties(self) -> bool:
        """Whether the penalties are all this step changes (the GPU pass then also makes the
        float32 copy: runner/sampling/logits_pass.py)."""
        return (self.penalties is not None and self.allowed is None and self.banned is None and self.bias is None
                and self.bad_word_prefixes is None)

    def penalty_columns(self):
        """The penalties as runner/sampling/logits_pass.py's PenaltyColumns (None: no penalties):
        made once and kept for the plan's steps, anew only where the states' tensors have grown."""
        p = self.penalties
        if p is None:
            return None
        columns = self._penalty_columns
        if columns is None or columns.output_counts is not self.states.output_counts:
            rep, freq, pres = p.row_factors
            columns = self._penalty_columns = triton_module("sampling.logits_pass").PenaltyColumns(
                p.row_slots, rep, freq, pres, self.states.output_counts, self.states.seen)
        return columns

    def _apply_penalties(self, x: torch.Tensor, p: _Penalties) -> torch.Tensor:
        kernel = sampling_kernel("sampling.logits_pass", x)
        if kernel is not None:  # one pass over the logits, in place (runner/sampling/logits_pass.py)
            kernel.logits_pass(x, x, self.penalty_columns(), 0)
            return x
        return self._apply_penalties_torch(x, p)

    def _apply_penalties_torch(self, x: torch.Tensor, p: _Penalties) -> torch.Tensor:
        """The penalties with torch ops (CPU; the reference of the GPU kernel)."""
        counts = self.states.output_counts[p.slots]
        rows = x if p.all_rows else x[p.rows]   # changed in place below
        if p.any_repetition:  # HF / vLLM: over prompt and output tokens
            seen = self.states.seen[p.slots] != 0   # in the prompt or the output
            scaled = torch.where(rows > 0, rows / p.repetition, rows * p.repetition)
            torch.where(seen, scaled, rows, out=rows)
        if p.any_additive:    # vLLM / OpenAI: over output tokens
            rows.sub_(p.frequency * counts).sub_(p.presence * (counts > 0))
        if not p.all_rows:
            x[p.rows] = rows
        return x

    def record(self, sampled: torch.Tensor) -> None:
        """After sampling: count the step's tokens into the requests' state (on the device)."""
        r = self.state_rows
        if r is not None:
            self.states.record(r.slots, sampled if r.all_rows else sampled[r.rows], r.offsets, r.ones)
