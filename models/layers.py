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

Why one file of ~480 lines: each block's weight loader, torch reference and kernel dispatch are
read together (a new family builds from these and nothing else), and the blocks share the
dispatch helpers; RoPE, the one block with tables of its own, is models/rotary.py."""

from __future__ import annotations

import functools
import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from configs.kernel_config import active_kernel_config
from models import cpu_kernels
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
_PACK_HINT_ROWS = 32
class PerWeight:
    """A value derived from a weight tensor (an MKL pack, a bf16 copy), built by `build(weight)` on
    first use and again whenever the weight's storage or version changes; dropped with the weight."""

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


def _packing_enabled() -> bool:
    """MKL's packed sgemm (torch.ops.mkl._mkl_linear) is there and passed its check, and
    KernelConfig.cpu_packed_linear is on. A pack costs about the weight's size in memory again, once per weight."""
    return active_kernel_config().cpu_packed_linear and not _packing_failed and _packing_available()


@functools.cache
def _packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


_packing_failed = False
"""Set when a pack fails its check: packing stays off for the process."""


def _build_pack(weight: torch.Tensor):
    """MKL-packed copy of `weight` ([N, K] fp32, CPU); None when MKL packing fails its check.

    MKL's packed format carries its own metadata: the row count given to the packing is a
    blocking hint, and the product is computed for any row count (PaddlePaddle packs with
    m=1 and computes whole batches). A new pack is checked once against F.linear at a row
    count other than the hint; any mismatch switches packing off for the process."""
    try:
        with torch.no_grad():
            pack = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)
            probe = torch.randn(_PACK_HINT_ROWS // 2 + 1, weight.shape[1], generator=torch.Generator().manual_seed(0))
            got = torch.ops.mkl._mkl_linear(probe, pack, weight, None, probe.shape[0])
            expected = F.linear(probe, weight)
        ok = torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    except RuntimeError as error:
        ok, pack = False, error
    if not ok:
        global _packing_failed
        logger.warning("MKL packed linear disabled: %s", pack if isinstance(pack, Exception) else "check failed")
        _packing_failed = True
        return None
    return pack


_weight_pack = PerWeight(_build_pack)


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
    """nn.Linear (same parameters, same names); on a CPU, fp32 inputs of at most PACKED_MAX_ROWS
    rows (decode steps) multiply by an MKL-packed copy of the weight, so MKL does not repack the
    weight on every call. Bit-identical to F.linear from 16 rows on at the measured shapes; the
    same sum in another order (last-bit differences) below that.

    `weight_loader(param, loaded, shard_id)` places a checkpoint tensor into one of its
    parameters (models/loader.py calls it for every tensor): a plain Linear takes tensors as
    stored; the packed subclasses below also take one shard at a time. A tensor-parallel layer
    would narrow `loaded` to its rank's rows or columns here, and nowhere else."""

    shard_ids: tuple = ()
    """The shard ids a packed layer is loaded from, one checkpoint tensor each (empty: unpacked)."""

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is None:   # stored as we keep it (unpacked, or already fused as Phi-3's)
            _copy_checked(param.data, loaded)
            return
        _copy_checked(self.shard_view(param, shard_id), loaded)

    def shard_view(self, param: nn.Parameter, shard_id) -> torch.Tensor:
        """The rows of `param` (weight or bias) that shard `shard_id` fills; the whole of it for None."""
        if shard_id is None:
            return param.data
        return param.data.narrow(0, *self.shard_rows(shard_id))

    def shard_rows(self, shard_id) -> tuple[int, int]:
        """(first output row, row count) of one shard in the packed weight (and bias)."""
        raise WeightLoadError(f"{type(self).__name__} is not packed, yet shard {shard_id!r} was given")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = small_batch(x) if x.dim() == 2 else None
        if kernels is not None:   # one row: the one-row GEMV streams the weight faster than cuBLAS
            return kernels.linear(x, self.weight, self.bias)
        rows = x.shape[0] if x.dim() == 2 else (x.numel() // x.shape[-1] if x.numel() else 0)
        if (x.is_cuda or not 0 < rows <= PACKED_MAX_ROWS or x.dtype != torch.float32
                or self.weight.dtype != torch.float32 or not _packing_enabled()):
            return F.linear(x, self.weight, self.bias)
        pack = _weight_pack(self.weight)
        if pack is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, pack, self.weight, self.bias, rows)


class QKVLinear(Linear):
    """q, k and v projections packed in one weight [(Hq + 2 Hkv) D, hidden]: one matmul. Loaded
    from q_proj / k_proj / v_proj (shard ids "q", "k", "v") or from a stored fused qkv_proj."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden, q_size + 2 * kv_size, bias=bias)
        self.q_size, self.kv_size = q_size, kv_size

    def shard_rows(self, shard_id) -> tuple[int, int]:
        q, kv = self.q_size, self.kv_size
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]


class MergedLinear(Linear):
    """Several projections of one input stacked along the output rows (gate and up: shard ids 0
    and 1, from gate_proj / up_proj, or from a stored fused gate_up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = tuple(out_sizes)
        self.shard_ids = tuple(range(len(out_sizes)))

    def shard_rows(self, shard_id) -> tuple[int, int]:
        return sum(self.out_sizes[:shard_id]), self.out_sizes[shard_id]


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


def _build_screen(weight: torch.Tensor):
    """(bf16 copy of `weight`, fp32 row norms, their max) for `screened_argmax`; None when the
    weight is not finite or the bf16 product misses the SCREEN_ERROR bound on random rows (a CPU
    whose bf16 matmul does not accumulate in fp32)."""
    with torch.no_grad():
        w, screen = weight.detach(), None
        if bool(torch.isfinite(w).all()):
            w16, norms = w.to(torch.bfloat16), w.norm(dim=1)
            probe = torch.randn(SCREEN_MIN_ROWS, w.shape[1], generator=torch.Generator().manual_seed(0))
            error = (F.linear(probe.to(torch.bfloat16), w16).float() - F.linear(probe, w)).abs()
            bound = SCREEN_ERROR * probe.norm(dim=1, keepdim=True) * norms
            if bool((error <= bound / 4).all()):
                screen = (w16, norms, float(norms.max()))
            else:
                logger.warning("screened CPU argmax disabled: the bf16 product misses its error bound")
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
    GELU with the tanh approximation (`gelu_tanh`, Gemma's gelu_pytorch_tanh)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
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
