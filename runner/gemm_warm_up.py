"""cuBLAS's first call of each GEMM shape the graph captures will run, made on a helper thread while
the main thread runs the start-up's profile batch (and, with empty kernel caches, its compile-ahead
pass).

Why: the first time cuBLAS sees a GEMM shape (M, N, K, dtype, bias) it runs its heuristic and
lazily loads the kernel it picks, about a millisecond of host time against tens of microseconds for
a repeat. A start-up captures graphs at every capture size (51 by default) and each runs the
model's projections (four shapes for most families), so on the main thread those first calls
take a large share of the captures (docs/PERFORMANCE.md, "GPU: LLM to ready"). The heuristic's
results and the loaded kernels belong to the process, not to the thread or stream that asked, and
torch releases the GIL inside each op: a helper thread that makes the first calls leaves the
captures' calls as fast as repeats, while the profile run goes on beside it.

What it repeats: `Linear.product`'s GEMM exactly as a capture calls it, `F.linear(x, weight, bias)`
on a contiguous [M, K] input (`torch.addmm` / `torch.mm` into an output buffer: the same cuBLAS
call), for every distinct (weight shape, dtype, bias) among the model's projections and every
capture size that does not take the one-row GEMV (models/layers.small_batch). Not the LM head: its
output buffer at the largest decode batch (max_num_seqs x vocabulary, 78 MB for Qwen3 at 256 rows)
would land in the profile peak that sizes the KV cache; its first calls stay in the captures.

Memory, so that the KV cache's size does not depend on thread timing: the input and output buffers
(at most BUFFER_BYTES each: 9 MiB in all for Qwen3-0.6B's shapes at 512 rows, 42 MiB for
Llama-3-8B's; larger capture sizes keep their first calls) are allocated before the thread
starts, and the first call of each kind (with a bias and without) is made before `start`
returns, so cuBLAS's workspace for the helper's handle (32 MiB on an H100, kept by torch for the
process) is allocated before the profile run resets its peak; the helper then allocates nothing. `wait` joins the thread before any capture (another thread's CUDA
calls would invalidate a capture in CUDA's global capture mode) and drops the buffers.
A failure on the helper (out of memory, say) is logged and costs only the time it would have saved.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from models.layers import Linear, small_batch

logger = logging.getLogger(__name__)

BUFFER_BYTES = 32 << 20
"""The largest input or output a warmed GEMM may have: the buffers count in the profile peak, so in
what the KV cache loses (a capture size of 8192 rows would cost Llama-3-8B 0.7 GB of it)."""


def gemm_signatures(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias as `product` receives it) of each distinct projection shape in `model` (a
    models/causal_lm model or one pipeline stage of it): one per (weight shape, dtype, bias shape),
    the LM head (`model.lm_head`, where this stage has it) left out (see the module docstring)."""
    seen, signatures = set(), []
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        if not isinstance(module, Linear) or module is head:
            continue
        weight, bias = module.weight, module.product_bias()
        key = (tuple(weight.shape), weight.dtype, None if bias is None else (tuple(bias.shape), bias.dtype))
        if key not in seen:
            seen.add(key)
            signatures.append((weight, bias))
    return signatures


class GemmWarmUp:
    """Makes the first call of every (signature, row count) on a helper thread: `start`, then
    `wait` before the first capture."""

    def __init__(self, signatures: list[tuple[torch.Tensor, torch.Tensor | None]], row_counts: list[int],
                 device: torch.device) -> None:
        self.device = device
        self.calls = [(weight, bias, rows) for rows in sorted(set(row_counts)) for weight, bias in signatures
                      if rows > 0 and not _takes_gemv(weight, rows)
                      and rows * max(weight.shape) * weight.element_size() <= BUFFER_BYTES]
        """(weight, bias, M), smallest M first."""
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._inputs = self._outputs = None

    def start(self) -> None:
        """Allocate the buffers, make the first call of each shape kind, then leave the rest to the
        helper thread (see the module docstring: the order keeps the profile peak exact)."""
        if not self.calls:
            return
        self._inputs = torch.empty(max(m * w.shape[1] * w.element_size() for w, _, m in self.calls),
                                   dtype=torch.uint8, device=self.device)
        self._outputs = torch.empty(max(m * w.shape[0] * w.element_size() for w, _, m in self.calls),
                                    dtype=torch.uint8, device=self.device)
        primed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(primed,), name="graphrunner-gemm-warm-up", daemon=True)
        self._thread.start()
        primed.wait()

    def wait(self) -> None:
        """Join the helper and drop its buffers; logs what it did."""
        if self._thread is None:
            return
        waited = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - waited
        self._thread, self._inputs, self._outputs = None, None, None
        if self.error is not None:
            logger.warning("the cuBLAS warm-up stopped (%s: %s); the captures make the first calls it left",
                           type(self.error).__name__, self.error)
            return
        logger.info("cuBLAS warm-up: first calls of %d GEMM shapes on a helper thread in %.2f s (waited %.2f s for it)",
                    len(self.calls), self.seconds, waited)

    def _run(self, primed: threading.Event) -> None:
        started = time.perf_counter()
        try:
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            with torch.inference_mode(), contextlib.ExitStack() as on:
                if stream is not None:   # the current device and stream are the thread's own in torch
                    on.enter_context(torch.cuda.device(self.device))
                    on.enter_context(torch.cuda.stream(stream))
                first_of_each_kind = {}   # with a bias and without: each allocates its workspace
                for call in self.calls:
                    first_of_each_kind.setdefault(call[1] is None, call)
                for call in first_of_each_kind.values():
                    self._call(*call)
                if stream is not None:
                    stream.synchronize()   # the workspace is allocated: the main thread may reset its peak
                primed.set()
                for call in self.calls:   # the first ones again too: repeats, microseconds
                    self._call(*call)
                if stream is not None:
                    stream.synchronize()
        except BaseException as error:  # noqa: BLE001 - a start-up optimisation: reported by `wait`
            self.error = error
        finally:
            primed.set()
            self.seconds = time.perf_counter() - started

    def _call(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
        """F.linear(x, weight, bias) for a contiguous x of `rows` rows, as `Linear.product` calls it
        for a 2-D input (F.linear itself is addmm with a bias, mm without), into the output buffer."""
        n, k = weight.shape
        x = self._inputs[: rows * k * weight.element_size()].view(weight.dtype).view(rows, k)
        out = self._outputs[: rows * n * weight.element_size()].view(weight.dtype).view(rows, n)
        if bias is None:
            torch.mm(x, weight.t(), out=out)
        else:
            torch.addmm(bias, x, weight.t(), out=out)


def _takes_gemv(weight: torch.Tensor, rows: int) -> bool:
    """Whether `Linear.product` sends `rows` rows to the one-row GEMV instead of cuBLAS."""
    return small_batch(weight.new_empty((rows, 0))) is not None   # it reads the rows and the device only

