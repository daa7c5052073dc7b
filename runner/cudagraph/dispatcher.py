"""Which graph serves a batch: keys, padding and the per-step choice.

A captured graph bakes in tensor shapes, so a batch runs as the graph of the smallest
capture size >= its token count; the extra rows are padding. Padded rows are inert: the
runner gives padded tokens slot_mapping -1 (no KV-cache write) and token_request_index
-1, and padded requests query length 0 and seq_len 0, so they change no real row and
never touch the cache; their output rows are unspecified (but finite) and are never
sampled.

Keys, one set per runtime mode, built once:
- FULL, uniform decode: `BatchDescriptor(n, n, True)` for capture sizes n <= max_num_seqs
  (one token per request, so num_reqs == num_tokens, padded requests included).
- FULL, mixed (mode FULL with an ALWAYS backend): `BatchDescriptor(n, min(n, max_num_seqs), False)`.
  The attention launch inside a FULL graph is sized by num_reqs too (query_start_loc,
  seq_lens, block_table rows), so requests are padded as well: to the most a batch of n
  tokens can hold (num_reqs <= num_tokens always, and <= max_num_seqs). One key per size.
- PIECEWISE: `BatchDescriptor(n, 0, False)`. The segments hold no attention (it runs
  eagerly between them and reads the step's real metadata), so no captured kernel depends
  on num_reqs or on uniformity; the canonical 0 makes one graph per size serve every batch.
- PIECEWISE, uniform decode (mode PIECEWISE only, where no FULL graph serves decode steps):
  also `BatchDescriptor(n, 0, True)` for capture sizes n <= max_num_seqs. Its graph also
  computes the decode head (logits and greedy tokens of every row, as a FULL decode graph
  does: runner/model_runner.py `forward_with_decode_head`), so a decode step launches no LM
  head and argmax after the replay. Why: that eager head was ~0.1 ms of host time per
  SmolLM2 step, a third of what PIECEWISE cost over FULL once its replay was one graph launch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from configs.graph_mode import CUDAGraphMode


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """The shape a graph was captured for: padded token count, padded request count, and
    whether every request adds exactly one token. Hashable: it keys the captured graphs."""

    num_tokens: int
    num_reqs: int
    uniform_decode: bool


def default_capture_sizes(max_size: int = 512, max_num_seqs: int | None = None) -> list[int]:
    """The sizes to capture up to max_size: 1, 2, 4, 8, 16, 24, 32, multiples of 16 up to 256, multiples
    of 32 above. Each size is a graph of each mode that start-up captures, one after another, so the
    grid is as coarse as padding allows. Up to 128 rows a decode step is bound by reading the weights
    and a padded row costs little; from 128 to 256 a larger model's step turns compute-bound and
    padding stays under 16 rows; above 256 only mixed batches run, with under 32 padded rows. Up to
    512 that is 29 sizes, 50 graphs in FULL_AND_PIECEWISE, where vLLM's grid (multiples of 8 up to
    256, of 16 up to 512) has 51 sizes and 86 graphs. docs/PERFORMANCE.md ("A coarser capture grid")
    has what each grid costs in start-up and throughput, and the commands.

    `max_num_seqs` (up to max_size) is a size too: the largest decode batch then has a FULL graph of
    its own instead of padding past max_num_seqs, where only the mixed mode's graphs are."""
    grid = [1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16), *range(288, max_size + 1, 32)]
    if max_num_seqs is not None:
        grid.append(max_num_seqs)
    return sorted({s for s in grid if s <= max_size})


class CudagraphDispatcher:
    """Owns the keys to capture and picks `(runtime_mode, descriptor)` for each step.

    `mode` must already be resolved (`resolve_cudagraph_mode`). Until `mark_ready()` (graphs
    captured) every dispatch is NONE: the profile run and anything before capture run eager.
    """

    def __init__(self, mode: CUDAGraphMode, capture_sizes: list[int], max_num_seqs: int) -> None:
        if any(s < 1 for s in capture_sizes):
            raise ValueError(f"capture sizes must be positive, got {capture_sizes}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        self.mode = mode
        self.max_num_seqs = max_num_seqs
        self.capture_sizes = sorted(set(capture_sizes)) if mode != CUDAGraphMode.NONE else []
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0
        # padded_sizes[num_tokens] -> the capture size that batch runs as (index 0 unused: 0).
        self.padded_sizes = [0] * (self.max_capture_size + 1)
        for n in range(1, self.max_capture_size + 1):
            self.padded_sizes[n] = self.capture_sizes[bisect.bisect_left(self.capture_sizes, n)]
        self._keys: dict[CUDAGraphMode, frozenset[BatchDescriptor]] = {
            CUDAGraphMode.FULL: frozenset(), CUDAGraphMode.PIECEWISE: frozenset()}
        for runtime_mode, uniform in ((mode.decode_mode(), True), (mode.mixed_mode(), False)):
            if runtime_mode == CUDAGraphMode.NONE:
                continue
            keys = {self._key(runtime_mode, n, uniform) for n in self.capture_sizes}
            self._keys[runtime_mode] = self._keys[runtime_mode] | {k for k in keys if k is not None}
        self.ready = False

    def _key(self, runtime_mode: CUDAGraphMode, n: int, uniform: bool) -> BatchDescriptor | None:
        if runtime_mode == CUDAGraphMode.PIECEWISE:
            if uniform and n > self.max_num_seqs:   # a uniform batch of n tokens has n requests
                return None
            return BatchDescriptor(n, 0, uniform)
        if uniform:  # FULL, uniform decode: one request per token, at most max_num_seqs requests
            return BatchDescriptor(n, n, True) if n <= self.max_num_seqs else None
        return BatchDescriptor(n, min(n, self.max_num_seqs), False)

    def mark_ready(self) -> None:
        """Graphs are captured: dispatch may now pick them."""
        self.ready = True

    def has(self, runtime_mode: CUDAGraphMode, key: BatchDescriptor | None) -> bool:
        """Whether this dispatcher may serve `(runtime_mode, key)` (NONE: always)."""
        if runtime_mode == CUDAGraphMode.NONE:
            return key is None
        return self.ready and key in self._keys.get(runtime_mode, ())

    def keys(self, runtime_mode: CUDAGraphMode) -> list[BatchDescriptor]:
        """Keys of one runtime mode (FULL or PIECEWISE), largest first."""
        return sorted(self._keys.get(runtime_mode, ()), key=_largest_first)

    def all_keys_to_capture(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every `(runtime_mode, key)` to capture, largest first: the first capture sizes the
        shared pool and later, smaller graphs reuse its memory."""
        pairs = [(m, k) for m in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE) for k in self._keys[m]]
        return sorted(pairs, key=lambda p: (_largest_first(p[1]), p[0].value))

    def dispatch(self, num_tokens: int, num_reqs: int,
                 uniform_decode: bool) -> tuple[CUDAGraphMode, BatchDescriptor | None]:
        """`(runtime_mode, padded descriptor)` for a batch, or `(NONE, None)` to run it eagerly
        (not ready, too many tokens, or no graph of the needed kind). A uniform batch whose FULL
        key is missing (num_reqs padded past max_num_seqs) falls back to the mixed mode."""
        if num_tokens < 1 or not 1 <= num_reqs <= num_tokens:
            raise ValueError(f"need 1 <= num_reqs <= num_tokens, got {num_reqs=} {num_tokens=}")
        if uniform_decode and num_reqs != num_tokens:
            raise ValueError(f"a uniform-decode batch has one token per request, got {num_reqs=} {num_tokens=}")
        if not self.ready or num_tokens > self.max_capture_size:
            return CUDAGraphMode.NONE, None
        padded = self.padded_sizes[num_tokens]
        candidates = [(self.mode.decode_mode(), True)] if uniform_decode else []
        candidates.append((self.mode.mixed_mode(), False))
        for runtime_mode, uniform in candidates:
            if runtime_mode == CUDAGraphMode.NONE:
                continue
            key = self._key(runtime_mode, padded, uniform)
            if key is not None and key in self._keys[runtime_mode] and (
                    runtime_mode == CUDAGraphMode.PIECEWISE or num_reqs <= key.num_reqs):
                return runtime_mode, key
        return CUDAGraphMode.NONE, None


def _largest_first(key: BatchDescriptor) -> tuple[int, int, bool]:
    return (-key.num_tokens, -key.num_reqs, not key.uniform_decode)
