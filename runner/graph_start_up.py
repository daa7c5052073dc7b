"""The CUDA-graph start-up steps of the model runner: compile the start-up's Triton kernels ahead
(`kernels_compiled_ahead`), measure the graphs' memory before the KV cache is sized
(`measure_graph_reserve`), and capture every graph the dispatcher may pick (`capture_cudagraphs`).

Why a base class of ModelRunner and not a collaborator: these steps drive the runner's own forward
(`_forward`, `_profile_batch`, `initialize_kv_cache`, `_build_graph_wrappers`) on its own buffers,
and the engine, the pipeline workers and the tests call them on the runner. Keeping them here leaves
runner/model_runner.py with one job: run a step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from configs import CUDAGraphMode, SamplingParams
from launch.compile_ahead import compile_ahead, compile_threads, queuing_launches
from launch.kernel_cache import wait_triton_key
from runner import start_up_record
from runner.cudagraph import AddressCheck, BatchDescriptor, capture_all, graph_pool, measure_graph_memory
from runner.gemm_warm_up import GemmWarmUp, gemm_signatures

logger = logging.getLogger(__name__)


class GraphStartUp:
    """Mixed into ModelRunner (see the module docstring); uses its config, dispatcher, input batch,
    capture phase, graph wrappers and forward."""

    def _dummy_batch(self, desc: BatchDescriptor) -> tuple[list[list[int]], int]:
        """Inert requests of the descriptor's shape (every slot -1: capture never writes the cache)."""
        if desc.uniform_decode:   # one request per token (a PIECEWISE key's canonical num_reqs is 0)
            return [[0]] * desc.num_tokens, desc.num_tokens
        per_req = self.max_model_len
        num_reqs = max(desc.num_reqs, -(-desc.num_tokens // per_req))
        lens = [1] * (num_reqs - 1)
        lens.append(desc.num_tokens - sum(lens))
        return [[0] * n for n in lens], max(num_reqs, desc.num_reqs)

    def _capture_one(self, mode: CUDAGraphMode, desc: BatchDescriptor, forward=None) -> None:
        """The descriptor's inert batch through the graph wrappers (which capture it), or through
        `forward` instead (the model itself: `kernels_compiled_ahead`)."""
        requests, padded_reqs = self._dummy_batch(desc)
        common = self.input_batch.prepare(requests, [0] * len(requests), [[] for _ in requests],
                                             desc.num_tokens, padded_reqs, slots_enabled=False)
        self._forward(desc.num_tokens, common, mode, desc, forward)

    def start_gemm_warm_up(self) -> GemmWarmUp:
        """cuBLAS's first calls of every projection shape the captures will run, started on a helper
        thread (runner/gemm_warm_up.py); `wait()` it before the first capture. It does nothing where
        nothing is captured (a CPU, graphs off) or with CompilationConfig.gemm_warm_up off."""
        captures = self.cudagraph_mode != CUDAGraphMode.NONE and self.device.type == "cuda"
        if not (captures and self.config.compilation.gemm_warm_up):
            return GemmWarmUp([], [], self.device)
        warm_up = GemmWarmUp(gemm_signatures(self.model),
                             [desc.num_tokens for _, desc in self.dispatcher.all_keys_to_capture()], self.device)
        warm_up.start()
        return warm_up

    def _compiles_ahead(self) -> bool:
        return (self.cudagraph_mode != CUDAGraphMode.NONE and self.device.type == "cuda"
                and compile_threads(self.config.compilation.compile_threads) > 0)

    def _start_up_key(self) -> str:
        place = (self.tp_rank, self.layer_range.start, self.layer_range.stop)
        return start_up_record.start_up_key(self.config, self.model_path, self.device, place)

    def earlier_start_up(self) -> start_up_record.StartUpRecord | None:
        """The record an earlier start-up of this configuration left (runner/start_up_record.py): its
        kernels are in the cache, so `kernels_compiled_ahead(queue=False)` pays off, and its
        measured graph reserve serves again (`measure_graph_reserve(recorded=...)`)."""
        if not self._compiles_ahead():
            return None
        return start_up_record.read(self.config.kernel.cache_dir, self._start_up_key())

    def record_start_up(self) -> None:
        """After a start-up that captured its graphs: its kernels are in the cache now, and its graph
        reserve is known. A cache folder that cannot be written costs the next start-up its
        shortcut, not this one its start."""
        if self._compiles_ahead() and self.cuda_graph_ready and self.graph_reserve_bytes is not None:
            try:
                start_up_record.record(self.config.kernel.cache_dir, self._start_up_key(), self.graph_reserve_bytes)
            except OSError as error:
                logger.warning("could not record this start-up in the kernel cache (%s); the next start-up "
                               "runs the compile-ahead pass and measures the graph reserve again", error)

    @contextmanager
    def kernels_compiled_ahead(self, queue: bool = True) -> Iterator[None]:
        """Start-up inside this block compiles its Triton kernels on compiler threads
        (launch/compile_ahead.py) instead of one at a time at their first launch.
        Entering queues the compile of every variant the profile run and the graph captures will
        launch: the inert batches run once through the model itself (no graph wrapper; one layer
        of each kind, `DecoderModel.kinds_only`: the other layers launch the same variants), the
        profile batch without a KV cache, each capture key in its runtime mode (so FULL's split-KV
        attention and the decode head pick the variants the capture will) against a one-block
        scratch KV cache of the real cache's layout; then, on the rank that samples, the sampler's
        and every variant of the eager greedy argmax (runner/greedy.queue_variants). The compiles
        start in that order, so the model's, which the profile run meets first and which hold the
        longest (the attention kernels), are not queued behind the sampler's. The compiles then run
        while the block does its work: a launch of a kernel still compiling waits for that one.
        Leaving waits for the rest. A plain block on a CPU, with graphs off, with
        CompilationConfig.compile_threads=0, or with `queue` False (every rank found the record of
        an earlier start-up of this configuration, `earlier_start_up`: the cached kernels load
        at their first launch, sooner than the queue pass would find them)."""
        if self.device.type == "cuda":
            wait_triton_key()   # its first kernel lookup needs Triton's own key (launch/kernel_cache.py)
        if not self._compiles_ahead():
            yield
            return
        if not queue:
            logger.info("the kernel cache holds this start-up's kernels (runner/start_up_record.py): "
                        "no compile-ahead pass")
            yield
            return
        threads = compile_threads(self.config.compilation.compile_threads)
        started = time.perf_counter()
        with compile_ahead(threads) as asynchronous:
            if asynchronous:
                with queuing_launches():   # the compiles start in this order: the model's first
                    with self.model.model.kinds_only():
                        self._run_start_up_batches(self.model_forward)
                    if self.model.model.is_last:
                        self.queue_sampling_variants()
                self.precompile_seconds = time.perf_counter() - started
                logger.info("queued the compiles of the start-up's kernels (%d graph shapes) on %d threads in "
                            "%.2f s", len(self.dispatcher.all_keys_to_capture()), threads, self.precompile_seconds)
            yield
            waiting = time.perf_counter()
        self.compile_wait_seconds = time.perf_counter() - waiting

    def queue_sampling_variants(self) -> None:
        """Inside `queuing_launches`: the sampler's kernels of the profile run (the same call on
        a batch of the profile run's rows, without logprobs: their gather would index with the
        draw's tokens, which a queued launch never writes; the kernels are the same), the draw of
        rows at a temperature alone (vLLM's default SamplingParams: no candidate lists, another
        variant of the draw, which otherwise compiled inside the first sampled step), and, on the
        rank that samples, every variant of the eager greedy argmax (runner/greedy.queue_variants)."""
        from runner import greedy
        from runner.model_runner import PROFILE_SAMPLING
        rows = min(self.max_num_reqs, sum(self.profile_lengths()))
        hidden = torch.zeros(rows, self.spec.hidden_size, dtype=self.dtype, device=self.device)
        self.profile_sampling(hidden, PROFILE_SAMPLING.model_copy(update={"logprobs": None}))
        self.profile_sampling(hidden, SamplingParams(temperature=1.0))
        if self.tp_rank == 0:
            greedy.queue_variants(self.spec.vocab_size, (self.dtype, torch.float32), self.device)

    def _run_start_up_batches(self, forward) -> None:
        """The profile batch (no KV cache), then every capture key's inert batch in the key's
        runtime mode against a one-block scratch KV cache (dropped afterwards), through `forward`."""
        with torch.inference_mode():
            self._forward(*self._profile_batch(), CUDAGraphMode.NONE, None, forward)
            self.initialize_kv_cache(1)
            try:
                for mode, desc in self.dispatcher.all_keys_to_capture():
                    self._capture_one(mode, desc, forward)
            finally:
                self.kv_caches = None

    def capture_cudagraphs(self) -> None:
        """Capture every graph the dispatcher may pick, largest first, in one shared pool.
        Skipped (one log line, cuda_graph_ready stays False) while there is no KV cache."""
        if self.cudagraph_mode == CUDAGraphMode.NONE:
            return
        if self.kv_caches is None:
            logger.info("cudagraph capture skipped: no KV cache yet (profile run); forwards run eager")
            return
        keys = self.dispatcher.all_keys_to_capture()
        with torch.inference_mode(), self.capture_phase.capturing():
            self.capture_summary = capture_all(keys, lambda key: self._capture_one(*key),
                                               desc=f"capturing {self.cudagraph_mode.name} graphs",
                                               estimate_bytes=self.graph_reserve_bytes)
        wrappers = [w for w in (self.full, self.piecewise) if w is not None]
        if wrappers and wrappers[0].address_check is not AddressCheck.OFF:
            recorded = sum(w.address_record_seconds for w in wrappers)
            self.capture_summary = dataclasses.replace(self.capture_summary, address_record_seconds=recorded)
            logger.info("cudagraph address check (%s): recorded the addresses of %d graphs in %.4f s; each graph's "
                        "first replay compares them", wrappers[0].address_check.value,
                        self.capture_summary.num_graphs, recorded)
        self.dispatcher.mark_ready()
        self.cuda_graph_ready = True

    def measure_graph_reserve(self, recorded: int | None = None) -> int:
        """Bytes the graphs will take: `recorded` where an earlier start-up of this configuration
        measured it (`earlier_start_up`; measuring again gives the same within a few MiB), else
        measured now: the largest graph of each runtime mode (uniform-decode and
        mixed separately: the first computes the logits too) captured once into a throwaway pool of
        its own (against a one-block scratch KV cache) and measured; the reserve is the largest of
        these. That is the whole cost, not a sample of it: the real
        captures go largest first into ONE pool shared by both modes, every later graph reuses
        the blocks the earlier ones freed, and no graph keeps an output of its own (see
        `CUDAGraphWrapper`), so the pool peaks at the most any single graph needs. (Capturing
        both largest graphs into one throwaway pool measured 1.56x the real cost on an H100:
        docs/PERFORMANCE.md.)"""
        if self.cudagraph_mode == CUDAGraphMode.NONE or self.device.type != "cuda":
            self.graph_reserve_bytes = 0
            return 0
        if recorded is not None:
            self.graph_reserve_bytes = recorded
            logger.info("graph memory from the record of an earlier start-up: %.1f MiB", recorded / 2**20)
            return recorded
        largest = {}   # per mode, the largest uniform-decode graph (it holds the LM head: DecodeOutput) and mixed one
        for mode, desc in self.dispatcher.all_keys_to_capture():
            largest.setdefault((mode, desc.uniform_decode), desc)

        def release() -> None:  # drop the throwaway graphs before the measurement empties the cache
            self._build_graph_wrappers(None)
            self.kv_caches = None

        def measure(mode: CUDAGraphMode, desc: BatchDescriptor) -> int:
            def capture_largest(pool) -> None:
                self._build_graph_wrappers(pool)
                self.initialize_kv_cache(1)
                with torch.inference_mode(), self.capture_phase.capturing():
                    self._capture_one(mode, desc)
            return measure_graph_memory(capture_largest, release=release)

        try:
            self.graph_reserve_bytes = max(measure(mode, desc) for (mode, _), desc in largest.items())
        finally:
            self.kv_caches = None
            self._build_graph_wrappers(graph_pool())
        return self.graph_reserve_bytes
