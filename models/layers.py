"""The shared building blocks every family builds from: linear (plain and packed, with their
weight loaders), RMSNorm (and Gemma's 1 + w form), the scaled embedding, gated MLP activations
(RoPE is models/rotary.py).

Each block has a torch `reference` (CPU, and the definition of correct) and, on CUDA, one
fused Triton kernel (models/fused_kernels.py): fewer launches per layer is what a small
model's graph replay is bound by. KernelConfig.fused_ops=False turns the kernels off (benchmarks
measure before/after in one run). For one decode row, `Linear` takes the one-row GEMV and the
Llama-family DecoderLayer goes further through models/small_batch_kernels.py (`small_batch`: the
norms fused into the projections that follow them, where that is measured to win);
KernelConfig.small_batch_kernels=False turns only that off.

On a CPU the reference paths are what runs, so they keep HF's rounding points (token-exact
greedy parity) with as few passes and temporaries as that allows, and fp32 linears of small
batches (decode) use an MKL-packed copy of the weight (`Linear`).

Under tensor parallelism (models/parallel_state.py) the packed projections are column-parallel
(`PackedLinear`: each rank keeps and reads its rows of every part) and the projections back to the
hidden size row-parallel (`RowParallelLinear`: one all-reduce); the vocabulary-parallel embedding
and LM head are models/vocab_parallel.py. A single rank builds exactly the modules it always did.

Why one file of ~600 lines: each block's weight loader, torch reference and kernel dispatch are
read together (a new family builds from these and nothing else), the blocks share the dispatch
helpers, and the linears' tensor-parallel forms extend `Linear`'s loader and fast paths, which
`GatedMLP` builds from; RoPE, the one block with tables of its own, is models/rotary.py."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from configs.kernel_config import active_kernel_config
from launch.compile_ahead import compiling_ahead
from launch.native_build import cpu_vendor
from models import cpu_kernels
from models.parallel_state import shard_heads, shard_size, tensor_parallel_all_reduce, tensor_parallel_group
from models.weight_copy import copy_weight


def _fused_kernels():
    """The Triton kernels module, or None when Triton is missing or KernelConfig.fused_ops is off."""
    return _import_fused_kernels() if active_kernel_config().fused_ops else None


@functools.cache
def _import_fused_kernels():
    try:
        from models import fused_kernels
    except ImportError:
        return None
    return fused_kernels


def fused(x: torch.Tensor):
    return _fused_kernels() if x.is_cuda else None


SMALL_BATCH_MAX_ROWS = 1
"""Token counts (x.shape[0]) up to this run a decoder layer through models/small_batch_kernels.py.
Measured on an H100 (`graphrunner bench linear --rows 1 2 32`: bf16, in a CUDA graph, cold weights;
docs/PERFORMANCE.md): at 1 row the fused kernels beat cuBLAS + the separate norm / SiLU*mul kernels
(SmolLM2 layer 20.6 -> 11.8 us), but from 2 rows their tl.dot path loses to cuBLAS at every shape
(SmolLM2 layer 21.5 -> 25.0 us at 2 rows, 21.7 -> 30.8 at 32). With the one-row tiles of
small_batch_kernels.ONE_ROW_TILES (`graphrunner bench gemv_configs`) the one-row GEMV also beats
cuBLAS on large weights, so every projection of a one-row step takes it."""

def _small_batch_kernels():
    """models/small_batch_kernels.py, or None when fused ops are off (KernelConfig.fused_ops) or
    KernelConfig.small_batch_kernels is (only this path off)."""
    if not active_kernel_config().small_batch_kernels or _fused_kernels() is None:
        return None
    return _import_small_batch_kernels()


@functools.cache
def _import_small_batch_kernels():
    try:
        from models import small_batch_kernels
    except ImportError:
        return None
    return small_batch_kernels


def small_batch(x: torch.Tensor):
    """The small-row kernels module for a CUDA x of 1..SMALL_BATCH_MAX_ROWS rows (a decode step),
    else None (CPU runs keep the reference path)."""
    if not x.is_cuda or not 0 < x.shape[0] <= SMALL_BATCH_MAX_ROWS:
        return None
    return _small_batch_kernels()


logger = logging.getLogger(__name__)

PACKED_MAX_ROWS = 64
"""Row counts up to this use the packed weight: on a 2-core Xeon (SmolLM2-135M shapes, weights
cold as in a decode step), packed is faster than F.linear for 4-64 rows, equal for 1-2, and
slower from 128 rows (prefill), where MKL's own packing of B is amortised."""
PACKED_MIN_ROWS = 3
"""Row counts below this take F.linear: packing buys nothing there (see PACKED_MAX_ROWS), and a pack
costs the weight's memory again, so a one-prompt decode never builds one. A weight is packed on its
first product in the packed range: packing later (say, on the second) would make a repeated product
of the same rows compute differently the first time (last-bit differences), so the same request
run twice in one process would not give the same logprobs."""
_PACK_HINT_ROWS = 32
_decode_products = threading.local()


@contextlib.contextmanager
def decode_step_products(decode: bool) -> Iterator[None]:
    """Marks the products inside as a decode step's (every request adds one token) or not: only a
    decode step's linears take the packed weights. A pack pays for itself over the many steps of a
    decode batch; a prefill of a few dozen tokens (a chat prompt) runs once, and packing every weight
    for it costs more than it saves: for the embedded model ~1.2 s before the first token and ~450 MB
    of resident memory (`graphrunner bench startup`). The model runner wraps each step's forward
    and logits in this; products outside it are not a decode step's."""
    previous = getattr(_decode_products, "active", False)
    _decode_products.active = decode
    try:
        yield
    finally:
        _decode_products.active = previous


def _in_decode_step() -> bool:
    return getattr(_decode_products, "active", False)


class PerWeight:
    """A value derived from a weight tensor (an MKL pack, a bf16 copy), built by `build(weight)` on
    its first use and again whenever the weight's storage or version changes; dropped with the weight."""

    def __init__(self, build) -> None:
        self.build = build
        self._entries: dict[int, tuple] = {}
        """id(weight) -> (weakref to the weight, (data_ptr, version), value)."""

    def __call__(self, weight: torch.Tensor):
        try:
            key = (weight.data_ptr(), weight._version)
        except RuntimeError:  # an inference tensor has no version counter
            key = (weight.data_ptr(), None)
        ident = id(weight)
        entry = self._entries.get(ident)
        if entry is not None and entry[0]() is weight and entry[1] == key:
            return entry[2]
        value = self.build(weight)
        self._entries[ident] = (weakref.ref(weight, lambda _, ident=ident: self._entries.pop(ident, None)), key, value)
        return value


def _packing_format() -> str | None:
    """The packed format CPU linears use now (`pack_format`); None when KernelConfig.cpu_packed_linear
    is off or this torch build has no format. A pack costs about the weight's size in memory again,
    once per weight."""
    return pack_format() if active_kernel_config().cpu_packed_linear else None


def pack_format() -> str | None:
    """The packed-weight format of the CPU linears: KernelConfig.cpu_linear_pack, where `auto` is
    MKL's on Intel CPUs and oneDNN's elsewhere; the other one where the choice is not in this build;
    None with neither.

    Why by vendor: at the embedded model's shapes with 2 threads (`graphrunner bench cpu_linear
    --threads 2`; docs/PERFORMANCE.md), MKL's packed sgemm is the faster on an AVX-512 Xeon (every
    linear of one 32-row step 71.7 vs 80.1 ms, of a 4-row one 35.7 vs 49.8) and oneDNN's on an AVX2
    AMD EPYC (147.5 vs 218.2 ms; 4 rows 46.1 vs 111.9)."""
    choice = active_kernel_config().cpu_linear_pack
    if choice == "auto":
        choice = "mkl" if cpu_vendor() == "GenuineIntel" else "onednn"
    available = [name for name in (choice, "onednn" if choice == "mkl" else "mkl") if format_available(name)]
    return available[0] if available else None


@functools.cache
def format_available(name: str) -> bool:
    if name == "mkl":
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _reorder(name: str, weight: torch.Tensor):
    if name == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_HINT_ROWS)
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)


def packed_product(name: str, x: torch.Tensor, pack, weight: torch.Tensor, bias: torch.Tensor | None,
                   rows: int) -> torch.Tensor:
    """x @ weight.T + bias through `pack` (a `build_pack(name, weight)`); oneDNN's reads only the pack."""
    if name == "mkl":
        return torch.ops.mkl._mkl_linear(x, pack, weight, bias, rows)
    return torch.ops.mkldnn._linear_pointwise(x, pack, bias, "none", [], "")


def build_pack(name: str, weight: torch.Tensor):
    """`weight` ([N, K] fp32, CPU) packed in format `name` ("mkl" or "onednn"); None (this weight
    stays unpacked) when packing fails its check.

    Both formats carry their own metadata: the row count given to the packing is a blocking hint,
    and the product is computed for any row count (PaddlePaddle packs with m=1 and computes whole
    batches). Each new pack is checked once against F.linear at a row count other than the hint.
    A failed check concerns this weight only (a weight holding NaN or Inf fails it whatever the
    library does), so it never switches packing off for other weights or for later engines in the
    same process: their linears must compute what a fresh process computes."""
    try:
        with torch.no_grad():
            pack = _reorder(name, weight.detach())
            probe = torch.randn(_PACK_HINT_ROWS // 2 + 1, weight.shape[1], generator=torch.Generator().manual_seed(0))
            got = packed_product(name, probe, pack, weight, None, probe.shape[0])
            expected = F.linear(probe, weight)
        ok = torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    except RuntimeError as error:
        ok, pack = False, error
    if not ok:
        logger.warning("%s packed linear not used for a [%d, %d] weight: %s", name, *weight.shape,
                       pack if isinstance(pack, Exception) else "its check failed")
        return None
    return pack


weight_packs = {name: PerWeight(functools.partial(build_pack, name)) for name in ("mkl", "onednn")}
"""One cache per format: engines of different formats in one process never share a pack."""


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, unexpected, or of the wrong shape."""


def default_weight_loader(param: torch.Tensor, loaded, shard_id=None) -> None:
    """Copy a checkpoint tensor stored exactly as the parameter is (no packing, no slicing).

    `loaded`, here and in every weight_loader, is a torch.Tensor or a safetensors slice
    (`safe_open(...).get_slice(name)`, not yet read): a loader reads only what it keeps
    (`loaded[:]` here; a tensor-parallel rank would read `loaded[start:stop]`)."""
    if shard_id is not None:
        raise WeightLoadError(f"this parameter is not packed, yet shard {shard_id!r} was given")
    _copy_checked(param.data, loaded)


def loaded_shape(loaded) -> tuple[int, ...]:
    """The shape of a checkpoint tensor or of a safetensors slice (read without reading the data)."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def _copy_checked(dest: torch.Tensor, loaded) -> None:
    if loaded_shape(loaded) != tuple(dest.shape):
        raise WeightLoadError(f"expected {tuple(dest.shape)}, found {loaded_shape(loaded)}")
    copy_weight(dest, loaded if isinstance(loaded, torch.Tensor) else loaded[:])


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names); on a CPU, fp32 inputs of PACKED_MIN_ROWS to
    PACKED_MAX_ROWS rows in a decode step (`decode_step_products`: batched decode) multiply by a
    packed copy of the weight (MKL's or oneDNN's, `pack_format`), made on the weight's first such
    product, so the library does not repack the weight on every call. Bit-identical to F.linear from 16 rows on at the measured shapes; the
    same sum in another order (last-bit differences) below that.

    `weight_loader(param, loaded, shard_id)` places a checkpoint tensor into one of its
    parameters (models/loader.py calls it for every tensor): a plain Linear takes tensors as
    stored; the packed subclasses below also take one shard at a time, and under tensor
    parallelism read only their rank's rows (`PackedLinear`); `RowParallelLinear` reads its
    columns; the vocabulary-parallel embedding and head are models/vocab_parallel.py."""

    shard_ids: tuple = ()
    """The shard ids a packed layer is loaded from, one checkpoint tensor each (empty: unpacked)."""

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is None:   # stored as we keep it (unpacked, or already fused as Phi-3's)
            _copy_checked(param.data, loaded)
            return
        _copy_checked(self.shard_view(param, shard_id), loaded)

    def checkpoint_shape(self, param: nn.Parameter, shard_id) -> tuple[int, ...]:
        """The shape of the checkpoint tensor that fills `param` (or its shard `shard_id`), for
        messages: what a tensor-parallel rank keeps is smaller than what it reads from."""
        return tuple(self.shard_view(param, shard_id).shape)

    def shard_view(self, param: nn.Parameter, shard_id) -> torch.Tensor:
        """The rows of `param` (weight or bias) that shard `shard_id` fills; the whole of it for None."""
        if shard_id is None:
            return param.data
        return param.data.narrow(0, *self.shard_rows(shard_id))

    def shard_rows(self, shard_id) -> tuple[int, int]:
        """(first output row, row count) of one shard in the packed weight (and bias)."""
        raise WeightLoadError(f"{type(self).__name__} is not packed, yet shard {shard_id!r} was given")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.product_bias())

    def product_bias(self) -> torch.Tensor | None:
        """The bias `forward` hands to `product` (a row-parallel layer adds its own after the
        all-reduce), for code that repeats the layer's GEMM as it runs (runner/gemm_warm_up.py)."""
        return self.bias

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias by the fastest path for x's shape (a row-parallel layer passes bias
        None and adds its bias after the all-reduce)."""
        kernels = small_batch(x) if x.dim() == 2 else None
        if kernels is not None:   # one row: the one-row GEMV streams the weight faster than cuBLAS
            return kernels.linear(x, self.weight, bias)
        if compiling_ahead():
            # The compile-ahead pass (launch/compile_ahead.py) only collects the Triton launches of
            # the start-up's batches, which do not run: what follows reads this product's shape, not
            # its values. A cuBLAS call here would spend the main thread's time on cuBLAS's first call
            # of each shape, which runner/gemm_warm_up.py makes on a helper thread meanwhile. Zeros,
            # not empty memory: the sampler's torch ops in that pass then see finite logits.
            return x.new_zeros((*x.shape[:-1], self.weight.shape[0]))
        rows = x.shape[0] if x.dim() == 2 else (x.numel() // x.shape[-1] if x.numel() else 0)
        if (x.is_cuda or not _in_decode_step() or not PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS
                or x.dtype != torch.float32 or self.weight.dtype != torch.float32):
            return F.linear(x, self.weight, bias)
        name = _packing_format()
        pack = None if name is None else weight_packs[name](self.weight)
        if pack is None:
            return F.linear(x, self.weight, bias)
        return packed_product(name, x, pack, self.weight, bias, rows)


class PackedLinear(Linear):
    """Several projections of one input stacked along the output rows, each loaded from its own
    checkpoint tensor (a shard id) or all from one stored fused tensor (shard id None), and
    column-parallel: under tensor parallelism each rank keeps a contiguous row block of every part
    and reads only that block (`loaded[start:stop]` of a safetensors slice). Subclasses fill
    `parts`: shard id -> (rows kept here, first kept row in the part's checkpoint tensor, the
    part's rows in the checkpoint); the kept rows are stacked in shard_ids order."""

    parts: dict

    def __init__(self, in_features: int, parts: dict, bias: bool) -> None:
        super().__init__(in_features, sum(kept for kept, _, _ in parts.values()), bias=bias)
        self.parts, self.shard_ids = parts, tuple(parts)
        self.sharded = any(kept != rows for kept, _, rows in parts.values())
        """Whether this rank keeps only part of the checkpoint's rows (tensor_parallel_size > 1)."""

    def shard_rows(self, shard_id) -> tuple[int, int]:
        start = 0
        for shard in self.shard_ids:
            if shard == shard_id:
                return start, self.parts[shard][0]
            start += self.parts[shard][0]
        raise WeightLoadError(f"{type(self).__name__} has no shard {shard_id!r}; its shards: {self.shard_ids}")

    def checkpoint_shape(self, param: nn.Parameter, shard_id) -> tuple[int, ...]:
        shards = self.shard_ids if shard_id is None else (shard_id,)
        return (sum(self.parts[s][2] for s in shards), *param.shape[1:])

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if not self.sharded:   # the whole checkpoint tensor is ours
            super().weight_loader(param, loaded, shard_id)
            return
        expected = self.checkpoint_shape(param, shard_id)
        if loaded_shape(loaded) != expected:
            raise WeightLoadError(f"expected {expected}, found {loaded_shape(loaded)}")
        offset = 0   # where a part starts in a fused tensor
        for shard in (self.shard_ids if shard_id is None else (shard_id,)):
            kept, first, rows = self.parts[shard]
            source = offset + first
            self.shard_view(param, shard).copy_(loaded[source:source + kept])
            offset += rows


class QKVLinear(PackedLinear):
    """q, k and v projections packed in one weight [(Hq + 2 Hkv) D, hidden]: one matmul. Loaded
    from q_proj / k_proj / v_proj (shard ids "q", "k", "v") or from a stored fused qkv_proj.
    `num_heads` / `num_kv_heads` are the checkpoint's; this rank keeps `heads` of them
    (models/parallel_state.shard_heads: its q heads and the KV heads they attend to)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> None:
        group = tensor_parallel_group()
        self.heads = shard_heads(num_heads, num_kv_heads, group.size, group.rank)
        q_size, kv_size = self.heads.num_heads * head_dim, self.heads.num_kv_heads * head_dim
        kv_part = (kv_size, self.heads.kv_head_start * head_dim, num_kv_heads * head_dim)
        super().__init__(hidden, {"q": (q_size, self.heads.q_head_start * head_dim, num_heads * head_dim),
                                  "k": kv_part, "v": kv_part}, bias)
        self.q_size, self.kv_size = q_size, kv_size


class MergedLinear(PackedLinear):
    """Several projections of one input stacked along the output rows (gate and up: shard ids 0
    and 1, from gate_proj / up_proj, or from a stored fused gate_up_proj). `out_sizes` are the
    checkpoint's; under tensor parallelism each rank keeps 1/size of each (`field` names the
    config value in the error when one does not divide)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, field: str = "out_features") -> None:
        group = tensor_parallel_group()
        kept = [shard_size(size, group.size, field) for size in out_sizes]
        super().__init__(in_features, {i: (k, group.rank * k, size) for i, (k, size) in
                                       enumerate(zip(kept, out_sizes))}, bias)
        self.out_sizes = tuple(kept)


class RowParallelLinear(Linear):
    """A projection back to the hidden size (attention's o_proj, the MLP's down_proj) whose INPUT
    features are split across the tensor-parallel ranks: each rank multiplies its block of the
    features (the heads / MLP columns it holds) by its column block of the weight, one all-reduce
    adds the partial sums, and the bias (replicated, read whole) is added once, after it. Built
    only when tensor_parallel_size > 1 (`row_parallel_linear`): a single rank keeps a plain Linear,
    with no collective and no extra pass."""

    def __init__(self, in_features: int, out_features: int, bias: bool, field: str = "in_features") -> None:
        group = tensor_parallel_group()
        super().__init__(shard_size(in_features, group.size, field), out_features, bias=bias)
        self.tp_rank, self.full_in_features = group.rank, in_features

    def checkpoint_shape(self, param: nn.Parameter, shard_id) -> tuple[int, ...]:
        return (param.shape[0], self.full_in_features) if param.dim() == 2 else tuple(param.shape)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is not None or param.dim() == 1:   # the bias: replicated, read whole
            super().weight_loader(param, loaded, shard_id)
            return
        expected = self.checkpoint_shape(param, None)
        if loaded_shape(loaded) != expected:
            raise WeightLoadError(f"expected {expected}, found {loaded_shape(loaded)}")
        start = self.tp_rank * self.in_features
        param.data.copy_(loaded[:, start:start + self.in_features])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.product(x, self.product_bias()))

    def product_bias(self) -> None:
        return None   # added once, after the all-reduce (`reduce`)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial product -> the full one: all-reduce, then the bias once."""
        out = tensor_parallel_all_reduce(partial)
        return out if self.bias is None else out.add_(self.bias)


def row_parallel_linear(in_features: int, out_features: int, bias: bool, field: str) -> Linear:
    """A Linear whose input features are split over the tensor-parallel ranks: RowParallelLinear
    under tensor parallelism, a plain Linear (today's module, no collective) on a single rank."""
    if tensor_parallel_group().size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, field)


def linear_by(kernels, x: torch.Tensor, layer: Linear) -> torch.Tensor:
    """`kernels.linear(x, weight, bias)` (a fused path's own GEMV: models/small_batch_kernels.py) with
    `layer`'s parameters; a RowParallelLinear's all-reduce and bias follow it. Where the push
    all-reduce is set up, a row-parallel GEMV that can sums its output over the ranks itself
    (`kernels.linear_all_reduce`): one kernel instead of two."""
    if not isinstance(layer, RowParallelLinear):
        return kernels.linear(x, layer.weight, layer.product_bias())
    push = tensor_parallel_group().push
    out = kernels.linear_all_reduce(x, layer.weight, push) if push is not None else None
    if out is None:
        return layer.reduce(kernels.linear(x, layer.weight, layer.product_bias()))
    return out if layer.bias is None else out.add_(layer.bias)


SCREEN_MIN_ROWS = 16
"""`screened_argmax` serves batches of at least this many rows: from 16 rows F.linear over a subset
of the vocabulary gives bit for bit the logits of the whole product (and of the packed path) at the
measured shapes, so the screened pick is the full argmax's; below that MKL picks other kernels."""
SCREEN_ERROR = 2.0 ** -6
"""|bf16 logit - any fp32 logit| <= SCREEN_ERROR * ||h|| * ||w_j||. With u = 2^-8 (bf16 rounding):
rounding h and w costs (2u + u^2) sum|h_i w_ij|, the bf16 output u more, fp32 accumulation (bf16
products are exact in fp32) and the fp32 reference ~K * 2^-24 each (K = 576: 3.4e-5; under 5e-4 up
to K = 8192); ~0.0119 in all for SmolLM2, and
sum|h_i w_ij| <= ||h|| ||w_j|| (Cauchy-Schwarz). 2^-6 = 0.0156 leaves a 30% margin; the weight's
first use checks the bound on random rows (`_bf16_screen`)."""


def _screening_enabled() -> bool:
    """KernelConfig.cpu_screened_argmax=False turns `screened_argmax` off (the full fp32 LM head runs)."""
    return active_kernel_config().cpu_screened_argmax


SCREEN_TIMED_SIZE = 1 << 22
"""Heads of at least this many weights (SmolLM2's: 28M) screen only where `_bf16_product_pays`; smaller
ones take too little time to measure, and too little to matter."""


def _bf16_product_pays(probe: torch.Tensor, w: torch.Tensor, w16: torch.Tensor) -> bool:
    """The bf16 product takes at most 0.8x the fp32 one's time (best of three each, interleaved). Where
    torch has no fast bf16 GEMM for this CPU (without AVX-512 or Arm's bf16 extension it converts
    element by element: 2.3x the fp32 time, [32, 576] x [49152, 576], with ONEDNN_MAX_CPU_ISA=AVX2
    ATEN_CPU_CAPABILITY=avx2), reading half the bytes does not pay for it."""
    probe16, best32, best16 = probe.to(torch.bfloat16), float("inf"), float("inf")
    for _ in range(3):
        started = time.perf_counter()
        F.linear(probe, w)
        middle = time.perf_counter()
        F.linear(probe16, w16)
        best32, best16 = min(best32, middle - started), min(best16, time.perf_counter() - middle)
    return best16 <= 0.8 * best32


def _build_screen(weight: torch.Tensor):
    """(bf16 copy of `weight`, fp32 row norms, their max) for `screened_argmax`; None when the
    weight is not finite, the bf16 product misses the SCREEN_ERROR bound on random rows (a CPU
    whose bf16 matmul does not accumulate in fp32), or it is not faster than the fp32 one here."""
    with torch.no_grad():
        w, screen = weight.detach(), None
        if bool(torch.isfinite(w).all()):
            w16, norms = w.to(torch.bfloat16), w.norm(dim=1)
            probe = torch.randn(SCREEN_MIN_ROWS, w.shape[1], generator=torch.Generator().manual_seed(0))
            error = (F.linear(probe.to(torch.bfloat16), w16).float() - F.linear(probe, w)).abs()
            bound = SCREEN_ERROR * probe.norm(dim=1, keepdim=True) * norms
            if not bool((error <= bound / 4).all()):
                logger.warning("screened CPU argmax disabled: the bf16 product misses its error bound")
            elif w.numel() >= SCREEN_TIMED_SIZE and not _bf16_product_pays(probe, w, w16):
                logger.info("screened CPU argmax off: torch's bf16 product is not faster than fp32 on this CPU")
            else:
                screen = (w16, norms, float(norms.max()))
    return screen


_bf16_screen = PerWeight(_build_screen)


def screened_argmax(hidden: torch.Tensor, head: nn.Linear) -> torch.Tensor | None:
    """argmax_j of head(hidden)[:, j] (first maximum on ties) for fp32 CPU rows, reading the LM head's
    weight in bf16 (half the bytes: the fp32 head was ~13% of a bs32 SmolLM2 decode step on a 2-core
    CPU) and then in fp32 only for the tokens that could still be the maximum. None where it does not
    apply (GPU, not fp32, bias, fewer than SCREEN_MIN_ROWS rows, non-finite rows, switched off).

    Exact, not approximate: with e_j = SCREEN_ERROR * ||h|| * ||w_j|| bounding |bf16 - fp32 logit|
    a_j - l_j, floor = max_j(a_j - e_j) is at most the fp32 maximum, and a token j can reach the
    maximum only if a_j + e_j >= floor. Those tokens' fp32 logits come from F.linear on their weight
    rows (bit-identical to the whole product's from SCREEN_MIN_ROWS rows on), and the first maximum
    among them, in vocabulary order, is the full argmax."""
    weight = head.weight
    if tensor_parallel_group().size > 1:   # each rank holds one vocabulary block: the gathered logits decide
        return None
    if (hidden.is_cuda or hidden.dtype != torch.float32 or weight.dtype != torch.float32 or head.bias is not None
            or hidden.dim() != 2 or hidden.shape[0] < SCREEN_MIN_ROWS or not _screening_enabled()):
        return None
    screen = _bf16_screen(weight)
    if screen is None or not bool(torch.isfinite(hidden).all()):
        return None
    w16, norms, max_norm = screen
    approx = F.linear(hidden.to(torch.bfloat16), w16)                      # [R, V]
    slack = SCREEN_ERROR * hidden.norm(dim=1)                              # e_j / ||w_j|| per row
    found = cpu_kernels.screen_candidates(approx, slack, norms, max_norm)  # the passes below, in one C call
    ids, candidates, floor = _screen_candidates(approx.float(), slack, norms, max_norm) if found is None else found
    if ids.numel() < SCREEN_MIN_ROWS:  # MKL's narrowest products differ: pad, the test decides again
        ids = torch.unique(torch.cat([ids, torch.arange(min(SCREEN_MIN_ROWS, weight.shape[0]))]))
        candidates = approx.index_select(1, ids).float() + slack[:, None] * norms[ids] >= floor
    exact = F.linear(hidden, weight.index_select(0, ids)).masked_fill_(~candidates, float("-inf"))
    return ids[exact.max(dim=1).indices]                                    # ids ascend: ties go left


def _screen_candidates(approx: torch.Tensor, slack: torch.Tensor, norms: torch.Tensor, max_norm: float):
    """(ids that may hold a row's maximum, candidates [R, C]: for which rows, floor [R, 1]) from the
    bf16 logits approx [R, V] (here in fp32): the torch form of cpu_kernels.screen_candidates."""
    slack = slack[:, None]
    # Coarse, one pass: the floor is at least top - slack * max_norm, and e_j <= slack * max_norm.
    # (amax, not max: a tenth of the time on a CPU, and no index is needed.)
    coarse = approx.amax(dim=1, keepdim=True) - 2 * max_norm * slack
    ids = ((approx - coarse).amax(dim=0) >= 0).nonzero().squeeze(1)
    near = approx.index_select(1, ids)                                      # [R, C]
    near_slack = slack * norms[ids]
    floor = (near - near_slack).amax(dim=1, keepdim=True)  # max_j(a_j - e_j): the top token is in ids
    candidates = near + near_slack >= floor
    keep = candidates.any(dim=0)
    return ids[keep], candidates[:, keep], floor


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual`, adds it first and returns the new
    residual too (the fused add+norm of vLLM, one less pass over the hidden states)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def kernel_weight(self) -> torch.Tensor:
        """The weight the kernels multiply by (OffsetRMSNorm: 1 + weight)."""
        return self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        exact = self.kernel_rounds_like_reference(x)
        kernels = fused(x) if exact else None
        if kernels is None:   # a CPU decode step: one C pass (models/cpu_kernels.py) where it applies
            result = cpu_kernels.add_rms_norm(x, residual, self.kernel_weight(), self.eps) if exact else None
            return self.reference(x, residual) if result is None else result
        shape = x.shape
        result = kernels.add_rms_norm(x.reshape(-1, shape[-1]), self.kernel_weight(), self.eps,
                                      None if residual is None else residual.reshape(-1, shape[-1]))
        if residual is None:
            return result.view(shape)
        return result[0].view(shape), result[1].view(shape)

    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """HF's LlamaRMSNorm, rounding for rounding: weight * (x * rsqrt(mean(x^2) + eps)), in
        float32; the scale is updated in place and the two products reuse one output."""
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x if x.dtype == torch.float32 else x.float()  # (a no-op .float() still costs a dispatch)
        scale = x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            out = torch.mul(x32, scale).mul_(self.weight)
        else:
            out = self.weight * (x32 * scale).to(x.dtype)
        return out if residual is None else (out, residual)

    def kernel_rounds_like_reference(self, x: torch.Tensor) -> bool:
        """The kernels round the normalised x to the model dtype before the weight multiply, as
        this reference does: always true here."""
        return True


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32, rounded once
    at the end. The stored weight is the offset from one (HF keeps it so: zeros mean identity).
    The kernels multiply by a float32 copy of 1 + weight, made once per weight version; in
    float32 they are then this reference's roundings exactly, in lower precision they would round
    once more (before the weight), so those take the reference."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def kernel_weight(self) -> torch.Tensor:
        return _one_plus(self.weight)

    def kernel_rounds_like_reference(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32

    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        scale = x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        out = (x32 * scale * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


_one_plus = PerWeight(lambda weight: 1.0 + weight.detach().float())


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding whose rows are multiplied by `scale` (Gemma: sqrt(hidden), rounded to the model
    dtype first, as HF does); scale None is the plain lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def reset_parameters(self) -> None:
        """Nothing: the loader (or init_dummy_weights) writes every weight. nn.Embedding's own
        normal_ init, on the meta device the model is built on, imports torch._dynamo (about 2 s and
        100 MB of a CPU start-up, `python -X importtime`) to draw values nobody reads."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().forward(input_ids)
        if self.scale is None:
            return hidden
        return hidden * torch.tensor(self.scale, dtype=hidden.dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's logit soft-capping), in x's dtype; cap None: x."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up packed in one matmul; act is SiLU (`silu`) or
    GELU with the tanh approximation (`gelu_tanh`, Gemma's gelu_pytorch_tanh). Under tensor
    parallelism gate/up are column-parallel (each rank its block of the intermediate columns) and
    down is row-parallel: one all-reduce per MLP."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias, field="intermediate_size")
        self.down_proj = row_parallel_linear(intermediate, hidden, bias, "intermediate_size")
        self.activation = activation
        self.activate = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(self.gate_up_proj(x)))

    @staticmethod
    def activate_gelu_tanh(gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (HF's GELUTanh): one Triton kernel on CUDA, else the torch ops."""
        kernels = fused(gate_up)
        if kernels is not None and gate_up.dim() == 2:
            return kernels.gelu_tanh_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    @staticmethod
    def activate_silu(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up_proj's output, what down_proj reads."""
        kernels = fused(gate_up)
        if kernels is not None:
            return kernels.silu_and_mul(gate_up)
        out = cpu_kernels.silu_mul(gate_up)  # a CPU decode step: one C pass, bit for bit the ops below
        if out is not None:
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # silu(gate) * up, one temporary


ACTIVATIONS = {"silu": GatedMLP.activate_silu, "gelu_tanh": GatedMLP.activate_gelu_tanh}
"""Gated activations by name; HF's hidden_act names map here through `activation_name`."""
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def activation_name(hf_name: str) -> str:
    """Our activation for a config's hidden_act / hidden_activation (a clear error if unsupported)."""
    if hf_name not in _HF_ACTIVATIONS:
        raise ValueError(f"unsupported hidden activation {hf_name!r}; supported: {', '.join(sorted(_HF_ACTIVATIONS))}")
    return _HF_ACTIVATIONS[hf_name]
