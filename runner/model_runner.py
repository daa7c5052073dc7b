"""The model runner: inputs -> graph dispatch -> forward -> logits -> sampled tokens.

Start-up follows DESIGN.md's warm-up contract: `profile_run` (no KV cache, graphs are
never captured: `cuda_graph_ready` stays False), `initialize_kv_cache`, then
`capture_cudagraphs`, which sets `cuda_graph_ready`. Until then every forward is eager.
The CUDA-graph start-up steps (compile-ahead, graph reserve, capture) are runner/graph_start_up.py's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import logging
import time
from typing import ClassVar

import torch

from attention.backends import get_attention_backend
from attention.forward_context import ForwardContext, get_forward_context, set_forward_context
from configs import CUDAGraphMode, EngineConfig, SamplingParams, set_active_kernel_config
from launch.kernel_cache import hash_triton_ahead, use_triton_cache
from models.hf_config import ModelSpec
from models.layers import decode_step_products, screened_argmax
from models.causal_lm import IntermediateTensors
from models.loader import build_model
from models.parallel_state import tensor_parallel_broadcast, tensor_parallel_group
from runner.cudagraph import (CUDA_GRAPHS, AddressCheck, BatchDescriptor, CapturePhase, CUDAGraphWrapper,
                              CudagraphDispatcher, default_capture_sizes, graph_pool, prime_capture_stream,
                              resolve_cudagraph_mode)
from runner.graph_start_up import GraphStartUp
from runner.input_batch import InputBatch
from runner.outputs import ModelRunnerOutput, PendingOutput
from runner.platform import zeroed_host_tensor
from runner.sampling import SamplingMetadata, SamplingStage, argmax_rows
from runner.sampling.prompt_logprobs import PromptLogprobs
from runner.sampling.stage import all_at_temperature_zero
from runner.scheduler import ScheduledRequest, SchedulerOutput
from runner.start_up_times import StartUpTimes

logger = logging.getLogger(__name__)

CPU_PROFILE_TOKENS = 2
"""Tokens of the CPU profile run: it only has to run the no-KV-cache path once (see `profile_run`).
Two: attention across positions, and below the row counts that count towards packing a linear's
weight (models/layers.PACKED_MIN_ROWS), so the profile run alone never causes a pack."""
PROFILE_SAMPLING = SamplingParams(top_k=50, top_p=0.9, logprobs=5)
"""What every row of the profile run samples with: the candidates pass, the thresholds, the random
draw and the logprobs, so their memory is in the peak and their kernels are compiled at start-up."""


@dataclasses.dataclass
class DecodeOutput:
    """The forward of a uniform-decode step replayed from a graph, on the last stage: the hidden
    rows plus what sampling needs, computed inside the graph: every row's logits (model dtype) and
    their greedy argmax. Why: after the replay the host would otherwise launch the LM head and the
    two argmax kernels eagerly, ~0.1 ms of host time per step (SmolLM2 bs1 on an H100's host:
    sampling's host time 486 -> 121 us a step in `graphrunner bench profile_step --mode FULL
    --batch-size 1 --host-profile`); a greedy step now only copies the tokens out. The logits stay in the graph pool (`pool_fields`:
    a FULL graph copies out hidden and the tokens only), valid until the next replay: the step's
    sampling is enqueued before any later replay."""
    hidden: torch.Tensor
    logits: torch.Tensor
    greedy: torch.Tensor
    pool_fields: ClassVar[tuple[str, ...]] = ("logits",)


def forward_with_decode_head(model, input_ids, positions, intermediate=None, greedy_gate=None):
    """The model's forward, and for a uniform-decode step in a graph mode on the last stage also
    the logits and greedy tokens of every (padded) row, so the graph computes them: a
    `DecodeOutput`. Eager steps (NONE, the profile run) and mixed batches return the hidden rows.
    `greedy_gate` (InputBatch.graph_greedy on the device): the greedy tokens are computed only on
    the steps that take them (`graph_takes_greedy`); at temperature 0.6 the argmax over 256 rows
    of Qwen3's vocabulary cost 70 us a step for nothing (`graphrunner bench throughput
    --profile-kernels 30`, H100: `_argmax_chunks_kernel` and `_argmax_rows_kernel`).
    A function of the model, not a runner method: the graph wrappers hold it, and a bound method
    would make runner -> wrapper -> runner a cycle that keeps a dropped engine's GPU memory
    until the cyclic garbage collector runs."""
    hidden = model.forward(input_ids, positions, intermediate)
    context = get_forward_context()
    desc = context.batch_descriptor
    if desc is None or not desc.uniform_decode or not model.model.is_last or context.kv_caches is None:
        return hidden
    logits = model.compute_logits(hidden, float32=False)
    return DecodeOutput(hidden, logits, argmax_rows(logits, greedy_gate))


def graph_takes_greedy(reqs: list[ScheduledRequest], tp_size: int) -> bool:
    """Whether a decode graph's greedy tokens can be this step's tokens: only a plain greedy step
    (every row at temperature 0: the sampling stage's own rule, `all_at_temperature_zero`) of one
    process takes them (`fast_greedy`); a tensor-parallel step takes the argmax of the gathered
    logits eagerly."""
    return tp_size == 1 and all_at_temperature_zero(reqs)


class ModelRunner(GraphStartUp):
    def __init__(self, config: EngineConfig, spec: ModelSpec, model_path: str, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, layer_range: range | None = None) -> None:
        self.config, self.spec, self.model_path = config, spec, model_path
        set_active_kernel_config(config.kernel)   # before anything below picks a kernel
        if device.type == "cuda":   # Triton compiles into <cache_dir>/triton, beside the native builds
            use_triton_cache(config.kernel.cache_dir)
            hash_triton_ahead(config.kernel.cache_dir)
        if config.parallel.threads is not None:
            torch.set_num_threads(config.parallel.threads)
        self.device, self.dtype, self.max_model_len = device, dtype, max_model_len
        self.layer_range = layer_range if layer_range is not None else range(spec.num_layers)
        tp = tensor_parallel_group()   # set by the distributed executor before the runner exists
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        backend_name = config.model.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if device.type == "cuda" else "torch"
        self.attn_backend = get_attention_backend(backend_name, config.kernel)
        self.cudagraph_mode = resolve_cudagraph_mode(config.compilation.cudagraph_mode,
                                                     self.attn_backend.cudagraph_support, device.type)
        sizes = config.compilation.cudagraph_capture_sizes or default_capture_sizes(
            config.compilation.max_cudagraph_capture_size, self.max_num_reqs)
        sizes = [s for s in sizes if s <= self.max_num_tokens]
        self.dispatcher = CudagraphDispatcher(self.cudagraph_mode, sizes, self.max_num_reqs)
        max_blocks = -(-max_model_len // self.block_size)
        self.async_scheduling = config.resolve_async_scheduling(device.type)
        # With a step in flight the host writes the next step's inputs while the last step's
        # uploads may still be queued: the input batch then guards its pinned staging buffers.
        self.input_batch = InputBatch(self.max_num_tokens, self.max_num_reqs, max_blocks, self.block_size, device,
                                      guard_uploads=self.async_scheduling)
        self._prev_sampled: torch.Tensor | None = None
        """The last launched step's sampled tokens on the device (async): placeholders gather from it."""
        self.sampling = SamplingStage(spec.vocab_size, device)
        """The sampling path (runner/sampling/): the runner hands it the sampling rows and their logits."""
        self.prompt_logprobs = PromptLogprobs()
        self.token_bitmask_provider = None
        """Structured output: `(reqs, rows) -> TokenBitmask | None`, called after the forward is launched
        (the host fills the bitmask while the device runs the step); set by the engine."""
        self.kv_caches: list[torch.Tensor] | None = None
        self.cuda_graph_ready = False
        self.steps_by_mode: collections.Counter = collections.Counter()
        """Steps run per runtime mode name (FULL, PIECEWISE, NONE): the server's /metrics reads it."""
        self.precompile_seconds = 0.0
        """How long `kernels_compiled_ahead` took to queue the compiles (0: not used)."""
        self.compile_wait_seconds = 0.0
        """How long leaving `kernels_compiled_ahead` waited for compiles nothing had needed yet."""
        self.graph_reserve_bytes: int | None = None
        """Memory the graphs will take, once `measure_graph_reserve` has measured (or recalled) it."""
        self.start_up_times = StartUpTimes()
        """Seconds of each start-up phase (runner/executor.start_model_runner fills it; the engine logs it)."""
        self.capture_phase = CapturePhase()
        self.graph_factory = CUDA_GRAPHS
        """What a graph is; CPU tests of the capture state machine swap in a fake."""
        self.model = None

    # ---- start-up -------------------------------------------------------------------------
    def load_model(self) -> None:
        started = time.perf_counter()
        self.model = build_model(self.spec, self.model_path, device=self.device, dtype=self.dtype,
                                 load_format=self.config.model.load_format, layer_range=self.layer_range,
                                 max_positions=self.max_model_len, seed=self.config.seed,
                                 check_finite=self.config.model.check_finite_weights)
        if not self.model.model.is_first:
            # Pipeline stages after the first receive into these, so their graphs see fixed addresses.
            shape = (self.max_num_tokens, self.spec.hidden_size)
            self.intermediate_buffers = IntermediateTensors(
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))
        self._build_graph_wrappers(graph_pool() if self.device.type == "cuda" else None)
        logger.info("loaded %s (%s, %s) in %.2f s; cudagraph mode %s", self.spec.architecture, self.dtype,
                    self.config.model.load_format, time.perf_counter() - started, self.cudagraph_mode.name)

    def _build_graph_wrappers(self, pool) -> None:
        """FULL wraps PIECEWISE wraps the model: each acts only when the forward context's runtime
        mode is its own, so one callable serves every mode the dispatcher picks."""
        forward = self.model_forward = functools.partial(forward_with_decode_head, self.model,
                                                         greedy_gate=self.input_batch.graph_greedy.gpu)
        compilation = self.config.compilation
        check = AddressCheck.from_config(compilation.check_cudagraph_addresses, compilation.debug_cudagraph_addresses)
        warm_every = compilation.warms_up_every_capture(self.config.parallel.world_size)
        self.piecewise = self.full = None
        if self.cudagraph_mode.has_piecewise():
            forward = self.piecewise = CUDAGraphWrapper(forward, CUDAGraphMode.PIECEWISE, pool,
                                                        self.capture_phase, check, self.graph_factory,
                                                        step_graph=compilation.step_graph,
                                                        warm_up_every_capture=warm_every)
        if self.cudagraph_mode.has_full():
            forward = self.full = CUDAGraphWrapper(forward, CUDAGraphMode.FULL, pool, self.capture_phase, check,
                                                   self.graph_factory, warm_up_every_capture=warm_every)
        self.forward = forward

    def release_cuda_graphs(self) -> None:
        """Destroy every captured graph and wait for the GPU. Shutdown of a tensor- or
        pipeline-parallel rank calls this before destroying its process groups: NCCL does not
        destroy a communicator while a graph holding its collectives exists, so
        `destroy_process_group` would hang (pytorch/pytorch#115388)."""
        for wrapper in (self.full, self.piecewise):
            if wrapper is not None:
                wrapper.release_graphs()
        gc.unfreeze()  # a serving process froze its start-up heap (quiet_garbage_collector): graphs included
        gc.collect()  # graphs in reference cycles go now, not at some later collection
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release_step_memory(self) -> None:
        """Drop the graphs and the KV cache and return the caching allocator's free blocks to the
        device (an in-process engine's shutdown: UniProcExecutor.shutdown)."""
        self.release_cuda_graphs()
        self.kv_caches = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def intermediate_view(self, num_tokens: int) -> IntermediateTensors | None:
        """Views [:num_tokens] of the persistent receive buffers (None on the first stage)."""
        if self.model.model.is_first:
            return None
        buffers = self.intermediate_buffers
        return IntermediateTensors(buffers.hidden_states[:num_tokens], buffers.residual[:num_tokens])

    def graph_plan(self) -> tuple[str, list[int]]:
        """(resolved cudagraph mode, capture sizes) this rank would use on its own; the ranks of a
        multi-process engine agree on one (runner/cudagraph/consensus.py) before the load."""
        return self.cudagraph_mode.name, list(self.dispatcher.capture_sizes)

    def adopt_graph_plan(self, mode: CUDAGraphMode, capture_sizes: list[int]) -> None:
        """Use the agreed plan instead of this rank's own (before `load_model` builds the wrappers)."""
        if (mode.name, list(capture_sizes)) != self.graph_plan():
            self.cudagraph_mode = mode
            self.dispatcher = CudagraphDispatcher(mode, capture_sizes, self.max_num_reqs)

    def disable_cudagraphs(self) -> None:
        """Another rank has no graphs ready: run every step eager here too."""
        self.cuda_graph_ready = False
        self.dispatcher.ready = False

    def kv_cache_bytes_per_block(self) -> int:
        # This tensor-parallel rank's KV heads only (spec.num_kv_heads on a single rank).
        per_layer = 2 * self.block_size * self.model.num_local_kv_heads * self.spec.head_dim * self.dtype.itemsize
        return per_layer * len(self.layer_range)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward of max_num_batched_tokens tokens with NO KV cache; returns peak bytes.
        Graph capture is asked for and skipped (there is no cache to capture against)."""
        self.capture_cudagraphs()  # logs the skip and leaves cuda_graph_ready False
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            if self.cudagraph_mode != CUDAGraphMode.NONE:
                prime_capture_stream(self.graph_factory, self.dtype)  # its cuBLAS workspace: in the peak
        # On a CPU the KV budget does not depend on the peak, so the peak is not needed: a small
        # batch (CPU_PROFILE_TOKENS) still exercises the no-KV-cache path and the sampler, without
        # seconds of start-up spent on a large prefill no request asked for.
        hidden = self._forward(*self._profile_batch(), CUDAGraphMode.NONE, None)
        if hidden is not None and self.model.model.is_last:
            self.profile_sampling(hidden, PROFILE_SAMPLING)
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def profile_sampling(self, hidden: torch.Tensor, params: SamplingParams) -> None:
        """The profile run's sampler call: the LM head and the sampler on the first max_num_reqs
        rows of `hidden`, every row with `params` (`queue_sampling_variants` repeats it with
        launches only queued)."""
        logits = self.model.compute_logits(hidden[: min(self.max_num_reqs, hidden.shape[0])], float32=False)
        self.sampling.sampler(logits, SamplingMetadata.from_params([params] * logits.shape[0], {}, self.device))

    def profile_lengths(self) -> list[int]:
        """The profile run's prompt lengths: max_num_batched_tokens of prefill (CPU_PROFILE_TOKENS
        on a CPU) in prompts of at most max_model_len, at most max_num_seqs of them."""
        num_tokens = self.max_num_tokens if self.device.type == "cuda" else min(self.max_num_tokens, CPU_PROFILE_TOKENS)
        per_req = min(self.max_model_len, num_tokens)
        lens = [per_req] * (num_tokens // per_req) + ([num_tokens % per_req] if num_tokens % per_req else [])
        return lens[: self.max_num_reqs]

    def _profile_batch(self):
        """(tokens, metadata) of the profile run (`profile_lengths`), no cache slots."""
        lens = self.profile_lengths()
        requests = [[0] * n for n in lens]
        return sum(lens), self.input_batch.prepare(requests, [0] * len(lens), [[] for _ in lens], sum(lens),
                                                   len(lens), slots_enabled=False)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.model.num_local_kv_heads, self.spec.head_dim)
        # Zeros, not empty: inert padded rows of a graph may read block 0 and must see finite values.
        # On a CPU, zero pages mapped on first touch: resident memory follows the blocks written.
        if self.device.type == "cpu":
            self.kv_caches = [zeroed_host_tensor(shape, self.dtype) for _ in self.layer_range]
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layer_range]
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * self.kv_cache_bytes_per_block() / 2**20)

    # ---- CUDA graphs -----------------------------------------------------------------------
    # ---- one step --------------------------------------------------------------------------
    def _forward(self, padded_tokens: int, common, mode: CUDAGraphMode, desc: BatchDescriptor | None,
                 forward=None):
        metadata = self.attn_backend.build_metadata(common)
        context = ForwardContext(metadata, self.kv_caches, self.attn_backend, mode, desc)
        input_ids, positions = self.input_batch.model_inputs(padded_tokens)
        with set_forward_context(context), decode_step_products(common.uniform_decode):
            return (forward or self.forward)(input_ids, positions, self.intermediate_view(padded_tokens))

    def dispatch(self, sched: SchedulerOutput) -> tuple[CUDAGraphMode, BatchDescriptor | None]:
        """The graph decision. In a multi-process engine rank 0 makes it once and broadcasts it
        with the step (runner/cudagraph/consensus.py); the other ranks pass it to `execute`."""
        if not self.cuda_graph_ready:
            return CUDAGraphMode.NONE, None
        num_reqs = len(sched.scheduled)
        uniform = sched.num_scheduled_tokens == num_reqs  # every request feeds >= 1 token, so each feeds one
        return self.dispatcher.dispatch(sched.num_scheduled_tokens, num_reqs, uniform)

    def _decision(self, sched: SchedulerOutput, decision) -> tuple[CUDAGraphMode, BatchDescriptor | None]:
        """This step's (mode, descriptor): rank 0's broadcast one, or this runner's own choice.
        A decision this rank cannot replay raises here: replaying another graph (or none) would
        leave the other ranks waiting in a collective this rank never joins."""
        if decision is None:
            return self.dispatch(sched)
        mode, desc = decision
        if not self.dispatcher.has(mode, desc):
            raise RuntimeError(f"rank 0 chose the {mode.name} graph {desc} for this step, but this rank (tp rank "
                               f"{self.tp_rank}, layers {self.layer_range.start}..{self.layer_range.stop - 1}) has "
                               f"no such graph (graphs ready: {self.cuda_graph_ready}, mode "
                               f"{self.cudagraph_mode.name}, capture sizes {self.dispatcher.capture_sizes})")
        return mode, desc

    def prepare(self, sched: SchedulerOutput, decision=None):
        mode, desc = self._decision(sched, decision)
        self.steps_by_mode[mode.name] += 1
        reqs = sched.scheduled
        padded_tokens = desc.num_tokens if desc is not None else sched.num_scheduled_tokens
        padded_reqs = max(len(reqs), desc.num_reqs) if desc is not None and mode == CUDAGraphMode.FULL else len(reqs)
        placeholders = None
        if sched.prev_token_rows:
            if self._prev_sampled is None:
                raise RuntimeError("the step feeds placeholder tokens but no previous step's tokens are on the device")
            placeholders = (sched.prev_token_rows, sched.prev_sample_rows, self._prev_sampled)
        common = self.input_batch.prepare([r.token_ids for r in reqs], [r.num_computed_tokens for r in reqs],
                                          [r.block_ids for r in reqs], padded_tokens, padded_reqs,
                                          block_table_ids=[r.block_table_id for r in reqs],
                                          placeholders=placeholders,
                                          graph_greedy=graph_takes_greedy(reqs, self.tp_size))
        return mode, desc, padded_tokens, common

    def padded_num_tokens(self, sched: SchedulerOutput, decision=None) -> int:
        """Token rows this step runs as: what a pipeline stage receives and sends."""
        _, desc = self._decision(sched, decision)
        return desc.num_tokens if desc is not None else sched.num_scheduled_tokens

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, decision=None):
        """Run one scheduled step. Returns sampled tokens (last pipeline stage) or the
        intermediate tensors to send on (other stages). Stages after the first must have
        received this step's input into `intermediate_view(padded_num_tokens(sched, decision))`
        first. `decision`: rank 0's (mode, descriptor) for the step; None: this runner's own."""
        self.sampling.release(sched.finished_ids)  # preempted requests keep their generators and counts
        self.prompt_logprobs.release(sched.finished_ids)
        if not sched.scheduled:
            return ModelRunnerOutput({})
        mode, desc, padded_tokens, common = self.prepare(sched, decision)
        hidden = self._forward(padded_tokens, common, mode, desc)
        if not self.model.model.is_last:
            return hidden
        if self.tp_size > 1:
            return self.sample_tensor_parallel(sched.scheduled, hidden, common)
        return self.sample(sched.scheduled, hidden, common)

    def sample_tensor_parallel(self, reqs: list[ScheduledRequest], hidden, common) -> ModelRunnerOutput | None:
        """The last stage of a tensor-parallel engine, synchronous: TP rank 0's tokens (the sampler
        rank's, which go to rank 0); the others return None (`_launch_tensor_parallel_sampling`)."""
        pending = self._launch_tensor_parallel_sampling(reqs, hidden, common, share_tokens=False)
        return pending.resolve() if self.tp_rank == 0 else None

    @torch.inference_mode()
    def execute_async(self, sched: SchedulerOutput, decision=None) -> PendingOutput:
        """Launch one scheduled step without waiting for it (async scheduling): placeholder inputs
        are gathered on the device from the previous launch's tokens, and the sampled tokens stay
        on the device with a non-blocking copy to pinned host memory under way. The whole model
        (one pipeline stage): one process, or every rank of a tensor-parallel group, each launching
        its share (`decision`: rank 0's, as in `execute`; see `_launch_tensor_parallel_sampling`)."""
        self.sampling.release(sched.finished_ids)  # preempted requests keep their generators and counts
        self.prompt_logprobs.release(sched.finished_ids)
        if not sched.scheduled:
            return PendingOutput.ready(ModelRunnerOutput({}))
        mode, desc, padded_tokens, common = self.prepare(sched, decision)
        hidden = self._forward(padded_tokens, common, mode, desc)
        if self.tp_size > 1:
            pending = self._launch_tensor_parallel_sampling(sched.scheduled, hidden, common, share_tokens=True)
        else:
            pending = self.sample_async(sched.scheduled, hidden, common)
        self._prev_sampled = pending.sampled  # last: a failed launch leaves the previous step's tokens
        return pending

    def _launch_tensor_parallel_sampling(self, reqs: list[ScheduledRequest], hidden, common,
                                         share_tokens: bool) -> PendingOutput:
        """The logits of the vocabulary-parallel LM head are gathered across the TP group (a
        collective), so every TP rank computes them, in the same calls: once for the step's
        sampling rows, once for its prompt-logprob rows. Only TP rank 0 samples. `share_tokens`
        (async scheduling): its tokens then reach the other ranks' devices by a broadcast enqueued
        behind the step (no host sync), so every rank fills the next step's placeholder inputs from
        the same tokens; the other ranks' result carries only those tokens."""
        rows = [i for i, r in enumerate(reqs) if r.sample]
        logits = self._sampling_logits(reqs, rows, hidden, common) if rows else None
        if self.tp_rank == 0:
            pending = self.sample_async(reqs, hidden, common, logits)
            if share_tokens and rows:
                tensor_parallel_broadcast(pending.sampled.long())
            return pending
        self._prompt_logprobs(reqs, hidden, common)   # its logits: the same collective as rank 0's (if any)
        tokens = None
        if share_tokens and rows:
            tokens = tensor_parallel_broadcast(torch.empty(len(rows), dtype=torch.int64, device=self.device))
        return PendingOutput(lambda: ModelRunnerOutput({}), None, tokens)

    def _sampling_logits(self, reqs: list[ScheduledRequest], rows: list[int], out, common) -> torch.Tensor:
        """The logits of the sampling rows (`sample`, `sample_async`) from the forward's output (the
        hidden rows, or a DecodeOutput), in the model's dtype: the sampler makes a float32 copy only
        where something writes into the logits or reads them at full precision (a bf16 value is
        exact in float32), and its GPU kernels convert as they load. A float32 copy here cost a
        conversion kernel and twice the bytes for the draw to read on every step (256 rows of
        Qwen3's vocabulary: 61 us a step on an H100, `graphrunner bench throughput
        --profile-kernels 30`). Row indices, when needed, are uploaded without a host sync."""
        if isinstance(out, DecodeOutput):
            if len(rows) == len(reqs):   # every row samples: the graph computed their logits
                return out.logits[:len(reqs)]
            out = out.hidden
        with decode_step_products(common.uniform_decode):   # the LM head as the step's other products
            if common.uniform_decode and len(rows) == len(reqs):  # row i's one token is hidden row i: no gather
                return self.model.compute_logits(out[:len(reqs)], float32=False)
            last_token = common.query_start_loc_cpu[torch.tensor(rows) + 1].long() - 1
            return self.model.compute_logits(out[self.sampling.to_device(last_token)], float32=False)

    def _greedy_tokens(self, reqs: list[ScheduledRequest], rows: list[int], out, common) -> torch.Tensor:
        """Greedy tokens of the sampling rows: the graph's (DecodeOutput, every row samples), on a
        CPU decode step `screened_argmax` (exact, fewer bytes of LM head), or the argmax of their
        logits in the model dtype (same index, one conversion kernel less)."""
        if isinstance(out, DecodeOutput) and len(rows) == len(reqs):
            return out.greedy[:len(reqs)]
        if (self.device.type == "cpu" and self.tp_size == 1 and not isinstance(out, DecodeOutput) and common.uniform_decode
                and len(rows) == len(reqs) and self.model.final_logit_softcapping is None):
            # A CPU decode step: the LM head read in bf16 first, fp32 only near the top (exact; a
            # soft-capped head's ties may fall elsewhere, so those take the logits below).
            tokens = screened_argmax(out[:len(reqs)], self.model.lm_head)
            if tokens is not None:
                return tokens
        return argmax_rows(self._sampling_logits(reqs, rows, out, common))

    def _token_bitmask(self, reqs: list[ScheduledRequest], rows: list[int]):
        """Structured output: the step's TokenBitmask, filled on the host while the launched forward
        runs; None without a provider or without a constrained row."""
        provider = self.token_bitmask_provider
        return None if provider is None else provider(reqs, rows)

    @property
    def generators(self) -> dict[str, torch.Generator]:
        """The seeded requests' generators, by request id (kept until the request finishes)."""
        return self.sampling.generators

    def _prompt_logprobs(self, reqs: list[ScheduledRequest], hidden, common):
        """`PromptLogprobs.launch` for the step (None when no request asks for prompt logprobs)."""
        if not any(r.sampling_params.prompt_logprobs is not None for r in reqs):
            return None
        hidden_rows = hidden.hidden if isinstance(hidden, DecodeOutput) else hidden
        return self.prompt_logprobs.launch(
            reqs, common.query_start_loc_cpu.tolist(),
            lambda token_rows: self.model.compute_logits(hidden_rows[self.sampling.to_device(
                torch.tensor(token_rows, dtype=torch.int64))], True), self.sampling.to_device)

    def sample_async(self, reqs: list[ScheduledRequest], hidden, common, logits=None) -> PendingOutput:
        """The step's tokens, enqueued by the one sampling path (runner/sampling/stage.py): they stay
        on the device (`PendingOutput.sampled`) and go to pinned host memory by a non-blocking copy
        that a CUDA event marks. `hidden` is the forward's output (hidden rows or a DecodeOutput).
        `logits`: the sampling rows' logits when already computed (tensor parallel: every TP rank
        computes them, so the step's collectives do not depend on the sampling path)."""
        rows = [i for i, r in enumerate(reqs) if r.sample]
        prompt_logprobs = self._prompt_logprobs(reqs, hidden, common)
        if logits is not None:
            sampling_logits, greedy = (lambda: logits), (lambda: argmax_rows(logits))
        else:
            sampling_logits = lambda: self._sampling_logits(reqs, rows, hidden, common)  # noqa: E731
            greedy = lambda: self._greedy_tokens(reqs, rows, hidden, common)  # noqa: E731
        return self.sampling.launch([reqs[i] for i in rows], sampling_logits, greedy, prompt_logprobs,
                                    self._token_bitmask(reqs, rows) if rows else None)

    def sample(self, reqs: list[ScheduledRequest], hidden, common, logits=None) -> ModelRunnerOutput:
        """Synchronous scheduling: `sample_async` and its wait."""
        return self.sample_async(reqs, hidden, common, logits).resolve()
