"""Per-request grammar matchers, the step's bitmask rows, and the sampled tokens' acceptance.

The engine owns one StructuredOutputManager (it holds the tokenizer). For each step:
1. the model runner launches the forward, then calls `token_bitmask(reqs, rows)` (its
   `token_bitmask_provider`): every sampling row of a structured request gets its allowed
   tokens from its matcher, written into a preallocated pinned host buffer while the device
   runs the forward, then copied to the device without a host sync;
2. the sampler applies it to those rows (bitmask.py);
3. the engine hands the step's sampled tokens to `accept` (one xgrammar call): a token the
   grammar refuses fails that request alone; a token that completes the grammar (a stop token
   the grammar allows only at an end state) terminates the matcher and the request ends "stop".

The matcher's stop tokens are the request's (the model's EOS unless ignore_eos, and
stop_token_ids), so EOS is allowed exactly where the grammar may end.

Async scheduling (docs/STRUCTURED_OUTPUT.md): step n+1 is scheduled and its forward launched with
step n in flight; the fill of n+1's rows first calls `before_fill`, with which the engine waits
for step n's tokens and advances the matchers by them, so the fill overlaps n+1's forward and the
masks equal those of synchronous scheduling.

The accepts and the fill hold the GIL (xgrammar's bindings do not release it), so no Python work
overlaps them: they run on the engine's thread, and their cost is host time of every
constrained step (`graphrunner bench structured --xgrammar-only` times them on the host).

The matchers fill rows as wide as the tokenizer's vocabulary (`grammar_vocab_size`); the device
bitmask is as wide as the model's, and its columns past the tokenizer's stay zero, so the ids
past the tokenizer's are never allowed and xgrammar never pays for them. The pinned host rows
and the device bitmask are reused every step: safe because a step's bitmask copy is enqueued
before its sampling, and the next fill happens only after the engine has that step's tokens
(under async scheduling through `before_fill`, which waits for the step in flight).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from configs.structured_outputs import StructuredOutputsParams
from runner.structured_output.bitmask import TokenBitmask
from runner.structured_output.grammar import GrammarCompilerService

logger = logging.getLogger(__name__)

MAX_FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
"""Threads xgrammar fills a step's bitmask rows with at most (half the cores, at most 8: the
engine's own thread and the device's launches keep the rest)."""
ROWS_PER_FILL_THREAD = 32
"""Rows each fill thread gets at least: waking a thread costs about what it saves on a few dozen
rows (`graphrunner bench structured --xgrammar-only` prints the fill per thread count)."""


def fill_threads(rows: int) -> int:
    """Threads for a batched fill of `rows` rows: one per ROWS_PER_FILL_THREAD, 1 to MAX_FILL_THREADS."""
    return max(1, min(MAX_FILL_THREADS, rows // ROWS_PER_FILL_THREAD))


@dataclass(eq=False)
class GrammarState:
    """One request's grammar: its compile (shared), then its own matcher. `ready` tells the
    scheduler it may admit the request (compiled, or failed: the engine then aborts it)."""
    future: Future
    stop_token_ids: list[int] | None = None
    matcher: object | None = None
    submitted: float = 0.0
    stop_ids: frozenset[int] = frozenset()
    """The matcher's stop tokens: only accepting one of them can terminate it."""

    @property
    def ready(self) -> bool:
        return self.future.done()


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, max_num_seqs: int, device: torch.device) -> None:
        self.vocab_size, self.max_num_seqs, self.device = vocab_size, max_num_seqs, device
        self.compilers = GrammarCompilerService(tokenizer, vocab_size)
        self.states: dict[str, GrammarState] = {}
        self._host_bitmask: torch.Tensor | None = None
        self._device_bitmask: torch.Tensor | None = None
        self._rows: tuple | None = None
        """The last step's (constrained rows, number of rows) and their device tensors (indices,
        per-row flags): decode steps mostly repeat them, so they are uploaded only when they change."""
        self._batches: dict[int, object] = {}
        self.terminated: set[str] = set()
        """Requests whose matcher accepted a stop token at an end state (the grammar is complete)."""
        self.compile_wait_seconds = 0.0
        """Time the engine spent waiting for compiles with nothing else to run (`wait_for_compiles`)."""
        self.before_fill = None
        """Async scheduling: called before a step's rows are filled, once some row is constrained. The
        engine sets it while it launches step n+1 with step n in flight: it waits for step n's tokens
        (not for n+1's forward, enqueued after them) and advances the matchers by them."""

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, params: StructuredOutputsParams) -> GrammarState:
        """Parse the constraint (InvalidGrammarError naming the field if bad) and queue its compile."""
        state = GrammarState(self.compilers.submit(params), submitted=time.perf_counter())
        self.states[request_id] = state
        return state

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.terminated.discard(request_id)

    @property
    def active(self) -> bool:
        """Some live request has structured output."""
        return bool(self.states)

    def pop_failed(self) -> list[tuple[str, str]]:
        """(request id, error) of requests whose compile raised; they are forgotten here."""
        failed = []
        for request_id, state in list(self.states.items()):
            if state.matcher is None and state.future.done() and state.future.exception() is not None:
                failed.append((request_id, f"structured_outputs: the grammar failed to compile: "
                                           f"{state.future.exception()}"))
                del self.states[request_id]
        return failed

    def wait_for_compiles(self, timeout: float = 0.05) -> None:
        """Block until some pending compile finishes (the engine has nothing else to run)."""
        pending = [s.future for s in self.states.values() if not s.future.done()]
        if pending:
            started = time.perf_counter()
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            self.compile_wait_seconds += time.perf_counter() - started

    def _matcher(self, state: GrammarState):
        if state.matcher is None:
            from xgrammar import GrammarMatcher
            state.matcher = GrammarMatcher(state.future.result(), override_stop_tokens=state.stop_token_ids or None)
            state.stop_ids = frozenset(state.matcher.stop_token_ids)
        return state.matcher

    # ---- one step ------------------------------------------------------------------------
    def _host(self) -> torch.Tensor:
        """The rows the matchers fill: [max_num_seqs, words of the tokenizer's vocabulary], pinned."""
        if self._host_bitmask is None:
            width = -(-self.compilers.grammar_vocab_size // 32)
            self._host_bitmask = torch.zeros((self.max_num_seqs, width), dtype=torch.int32,
                                             pin_memory=self.device.type == "cuda")
        return self._host_bitmask

    def _device(self) -> torch.Tensor:
        """The bitmask the sampler applies: [max_num_seqs, words of the model's vocabulary]; the
        columns past the host rows' are never written (zero: not allowed)."""
        if self._device_bitmask is None:
            width = -(-self.vocab_size // 32)
            self._device_bitmask = torch.zeros((self.max_num_seqs, width), dtype=torch.int32, device=self.device)
        return self._device_bitmask

    def _row_tensors(self, indices: list[int], num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 device tensors: the constrained rows, and per row 1 if constrained else 0."""
        key = (indices, num_rows)
        if self._rows is None or self._rows[0] != key:
            flags = [0] * num_rows
            for row in indices:
                flags[row] = 1
            host = torch.tensor(indices + flags, dtype=torch.int32)   # one upload for both
            if self.device.type != "cpu":
                host = host.pin_memory().to(self.device, non_blocking=True)
            self._rows = (key, (host[:len(indices)], host[len(indices):]))
        return self._rows[1]

    def _fill(self, matchers: list, host: torch.Tensor, indices: list[int]) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(host, indices[0])
        elif matchers:
            threads = fill_threads(len(matchers))
            batch = self._batches.get(threads)
            if batch is None:
                from xgrammar import BatchGrammarMatcher
                batch = self._batches[threads] = BatchGrammarMatcher(max_threads=threads)
            batch.batch_fill_next_token_bitmask(matchers, host, indices)

    def token_bitmask(self, reqs, rows: list[int]) -> TokenBitmask | None:
        """The bitmask of the step's sampling rows (`reqs[rows[k]]` samples row k), or None when no
        sampling request has structured output. Called by the runner after the forward is launched."""
        states = self.states
        if not states:
            return None
        constrained = [(row, request_id, state) for row, i in enumerate(rows)
                       if (state := states.get(request_id := reqs[i].request_id)) is not None]
        if not constrained:
            return None
        if self.before_fill is not None:  # async scheduling: the matchers take the step in flight's tokens
            self.before_fill()
        host = self._host()
        matchers, indices = [], []
        terminated = self.terminated
        for row, request_id, state in constrained:
            if request_id in terminated:
                # Ended by the token in flight (async scheduling): the row's token is discarded when
                # that step is applied; any mask will do, and a terminated matcher fills none.
                host[row].fill_(-1)
            else:
                matchers.append(self._matcher(state))
                indices.append(row)
        self._fill(matchers, host, indices)
        bitmask = self._device()[:len(rows)]
        bitmask[:, :host.shape[1]].copy_(host[:len(rows)], non_blocking=True)
        indices, flags = self._row_tensors([row for row, _, _ in constrained], len(rows))
        return TokenBitmask(bitmask, indices, self.vocab_size, flags)

    def accept(self, sampled: dict[str, int]) -> dict[str, str]:
        """Advance each structured request's matcher by its sampled token (requests without
        structured output are skipped); {request id: error message} of those whose grammar refuses
        the token. A matcher can end only on one of its stop tokens, so only those rows ask it
        whether it terminated (`terminated`). The accepts sit between a step's tokens and the next
        step's bitmask, on the path the device waits on (docs/PERFORMANCE.md, "Structured output
        overhead"): one Python call per row, which beats xgrammar's `batch_accept_token` at a few
        dozen rows (`graphrunner bench structured --xgrammar-only`)."""
        states, errors = self.states, {}
        for request_id, token in sampled.items():
            state = states.get(request_id)
            if state is None:
                continue
            matcher = self._matcher(state)
            if not matcher.accept_token(token):
                errors[request_id] = f"structured_outputs: the grammar does not accept the sampled token {token}"
            elif token in state.stop_ids and matcher.is_terminated():
                self.terminated.add(request_id)
        return errors

    def is_terminated(self, request_id: str) -> bool:
        return request_id in self.terminated

    def shutdown(self) -> None:
        self.compilers.shutdown()
