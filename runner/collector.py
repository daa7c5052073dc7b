"""Python's garbage collector in an engine process: over which objects it runs, and when.

Why it matters: a full collection walks every object the process holds. After torch,
transformers and Triton are imported and a model is built, that is 0.2-0.3 s on a GPU server's
host, with the GIL held: no step is launched and no compile thread's Python runs meanwhile. An
engine start-up ran a dozen of them (the graph-memory measurement and the capture phase each call
`gc.collect()`, and allocation triggers more): 2.5 s of a Llama-3.2-1B start-up with empty kernel
caches on an H100 (docs/PERFORMANCE.md, "GPU: LLM to ready"). Serving triggers them too
(`quiet_garbage_collector`).

The rules, all built on `gc.freeze` (frozen objects are never walked):
- `frozen_heap`, around LLMEngine's start-up, each worker rank's, and the capture phase
  (runner/cudagraph/capture.CapturePhase.capturing) inside them: what is alive when a block begins
  is frozen, so the collections inside walk only what it allocates since (inside the capture
  phase, only what the captures allocate: a collection in every capture would otherwise walk the
  model's objects each time). At the end of the outermost block its garbage is collected and the
  heap unfrozen. Not left frozen: whatever of an engine dropped without `shutdown()` sits in
  reference cycles would then never be collected, with the device memory it holds.
- serving (`quiet_garbage_collector`): after warm-up the heap is frozen for good and the young
  generation is collected every 50,000 allocations instead of 700.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


_depth = 0
"""`frozen_heap` blocks open in this process."""


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what is alive now (after a collection of the young generations, not a full one,
    which would cost the walk this avoids), so that every collection inside walks only what the
    block allocates. Nests: an inner block freezes what was allocated since the outer began, and
    only the outermost one, at its end (an error included), collects its garbage (still a walk of
    its own objects only) and unfreezes the heap."""
    global _depth
    gc.collect(1)
    gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.collect()
            gc.unfreeze()


GC_THRESHOLD = (50_000, 20, 100)
"""A serving process's collector thresholds (Python's default: 700, 10, 10)."""


def quiet_garbage_collector() -> None:
    """Once a serving process has started (the API process, and the engine process after its
    warm-up): move everything alive now (modules, the model's Python objects, the tokenizer, the
    app) out of the collector's reach (`gc.freeze`), and collect the young generation every 50,000
    allocations instead of 700. Reference cycles are still collected, in larger batches.

    Why, in the engine process: each step's DELTA outputs allocate a few containers per stream
    (tuples, lists of token ids), some of which live until the step is sent, so the old generation
    grows and Python runs full collections; a full collection walks every object the process holds
    (torch, transformers, the model) and took 0.24-0.33 s on an H200's host, a stall of every
    stream. Frozen, a full collection walks only what serving allocated. With `graphrunner bench
    serve --engine-process --offline --num-prompts 256 --input-len 256 --output-len 1024`
    (Llama-3.2-1B shape, H200), the engine process ran two such collections within a 5 s run
    without it; server / offline 0.945 / 0.934 with it against 0.824 / 0.807 without, alternating
    (docs/PERFORMANCE.md, Serving). In the API process each streamed token allocates its output,
    chunk and ASGI message: 13% less CPU per token there (0.0676 against 0.0775 ms, medians of
    three interleaved pairs on a CPU)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
