"""Checkpoint -> module: safetensors straight into the parameters, or random `dummy` weights.

Tensors are read one at a time from memory-mapped safetensors files and copied into the
(already allocated, already typed) parameters, so the weights never exist twice in memory.
HF names map to ours one to one, except q/k/v_proj -> qkv_proj and gate/up_proj ->
gate_up_proj, which are packed for one matmul each.

Damage fails here, not as garbage text later: each file's header is checked against its size
(models/safetensors_file.py), a missing tensor or a wrong shape is named with the expected and
found shapes, and (unless `check_finite=False`) every loaded tensor is checked for NaN/Inf.
That check sums each tensor where it was copied to (NaN and Inf survive a sum; a sum is
several times cheaper than `isfinite(t).all()`, which writes a bool per element) and reads
all the sums back at once; only a tensor whose sum is not finite is examined element-wise,
so a sum that merely overflowed is not an error. Its cost, Llama-3.2-1B shape in bfloat16 on
a 2-core CPU: 49 ms for the whole model, against 2.4 s for `isfinite(t).all()` per tensor and
0.75-2.5 s for the load itself (`python -m runner.benchmarks.load_check --out /tmp/load_check`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from models.hf_config import CheckpointError, ModelSpec
from models.llama import LlamaForCausalLM
from models.safetensors_file import DamagedCheckpointError, read_safetensors_header

logger = logging.getLogger(__name__)

_PACKED = {  # HF projection -> (our packed projection, shard id)
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, unexpected, or of the wrong shape."""


class NonFiniteWeightError(WeightLoadError):
    """A checkpoint tensor holds NaN or Inf values (a damaged file, or a failed conversion)."""


def checkpoint_tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or by listing every file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint folder {str(folder)!r} has no *.safetensors files")
    mapping: dict[str, Path] = {}
    for file in files:
        mapping.update((name, file) for name in read_safetensors_header(file))
    return mapping


def _open(file: Path):
    """safe_open, with the file named in any error it raises (its own messages name none)."""
    try:
        return safe_open(file, framework="pt")
    except Exception as error:  # safetensors_rust.SafetensorError is not importable by a stable name
        raise DamagedCheckpointError(f"damaged checkpoint file {str(file)!r}: {error}") from error


class _FiniteCheck:
    """Collects one device-side sum per loaded tensor and checks them all with one read-back."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, Path, torch.Tensor]] = []
        self.sums: list[torch.Tensor] = []

    def add(self, name: str, file: Path, dest: torch.Tensor) -> None:
        if dest.is_floating_point():
            self.pending.append((name, file, dest))
            self.sums.append(dest.sum())

    def check(self) -> None:
        if not self.sums:
            return
        finite = torch.isfinite(torch.stack([s.float() for s in self.sums])).tolist()
        for (name, file, dest), ok in zip(self.pending, finite):
            if ok:
                continue
            nan, inf = int(torch.isnan(dest).sum()), int(torch.isinf(dest).sum())
            if nan or inf:  # else the sum only overflowed
                raise NonFiniteWeightError(
                    f"tensor {name!r} in {str(file)!r} holds {nan} NaN and {inf} Inf values (of {dest.numel()}, "
                    f"as {str(dest.dtype).removeprefix('torch.')}): the file is damaged or was converted wrongly "
                    f"(check_finite_weights=False skips this check)")


def _shard_slice(model: LlamaForCausalLM, packed: str, shard) -> tuple[int, int]:
    spec = model.spec
    if packed == "gate_up_proj":
        return shard * spec.intermediate_size, (shard + 1) * spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[shard]


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, object] | None:
    """Our (parameter name, shard) for a checkpoint tensor; None if another rank owns it."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) not in model.layer_range:
        return None
    first, last = model.model.is_first, model.model.is_last
    if name == "model.embed_tokens.weight":
        if first:
            return name, None
        return ("lm_head.weight", None) if last and model.spec.tie_word_embeddings else None
    if name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return None  # tied: the embedding is the head; HF ignores a stored copy too
    if (name == "model.norm.weight" or name == "lm_head.weight") and not last:
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _PACKED:
        packed, shard = _PACKED[parts[-2]]
        return ".".join(parts[:-2] + [packed, parts[-1]]), shard
    return name, None


def _checkpoint_name(param: str, shard) -> str:
    if shard == "tied":
        return "model.embed_tokens.weight"
    if shard is None:
        return param
    inverse = {v: k for k, v in _PACKED.items()}
    parts = param.split(".")
    return ".".join(parts[:-2] + [inverse[(parts[-2], shard)], parts[-1]])


def _expected(model: LlamaForCausalLM) -> set[tuple[str, object]]:
    expected = set()
    for name, _ in model.named_parameters():
        packed = name.split(".")[-2]
        shards = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}.get(packed, (None,))
        expected.update((name, s) for s in shards)
    if model.spec.tie_word_embeddings and model.model.is_last and not model.model.is_first:
        expected.discard(("lm_head.weight", None))
        expected.add(("lm_head.weight", "tied"))
    return expected


def _destination(model: LlamaForCausalLM, params: dict[str, nn.Parameter], param_name: str, shard) -> torch.Tensor:
    """Where a checkpoint tensor goes: the parameter, or its shard's rows of a packed one."""
    dest = params[param_name].data
    if shard not in (None, "tied"):
        start, stop = _shard_slice(model, param_name.split(".")[-2], shard)
        dest = dest[start:stop]
    return dest


@torch.no_grad()
def load_safetensors(model: LlamaForCausalLM, folder: Path, check_finite: bool = True) -> None:
    files = checkpoint_tensor_files(folder)
    params = dict(model.named_parameters())
    expected, loaded = _expected(model), set()
    finite = _FiniteCheck()
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} named in the index does not exist")
        present = set(read_safetensors_header(file))
        with _open(file) as handle:
            for name in names:
                target = _target(model, name)
                if target is None:
                    continue
                param_name, shard = target
                if param_name not in params:
                    raise WeightLoadError(f"unexpected tensor {name!r} in {file.name}: no such parameter "
                                          f"in {model.spec.architecture}")
                dest = _destination(model, params, param_name, shard)
                if name not in present:
                    raise WeightLoadError(f"missing tensor {name!r} (expected shape {tuple(dest.shape)}, found none): "
                                          f"the index names {file.name}, which lacks it")
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise WeightLoadError(f"shape mismatch for {name!r} in {file.name}: expected "
                                          f"{tuple(dest.shape)}, found {tuple(tensor.shape)}")
                dest.copy_(tensor)
                if check_finite:
                    finite.add(name, file, dest)
                is_tied_head = param_name == "lm_head.weight" and name == "model.embed_tokens.weight"
                loaded.add((param_name, "tied" if is_tied_head else shard))
    missing = sorted((_checkpoint_name(p, s), tuple(_destination(model, params, p, s).shape))
                     for p, s in expected - loaded)
    if missing:
        searched = ", ".join(sorted({f.name for f in files.values()}))
        listed = ", ".join(f"{name!r} (expected shape {shape}, found none)" for name, shape in missing)
        raise WeightLoadError(f"missing tensor(s) {listed} in checkpoint {str(folder)!r} (searched {searched})")
    finite.check()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the checkpoint's shapes (for benchmarks without weights), drawn on the
    model's own device (an 8B model's worth of CPU randn would take minutes): small normal
    values keep activations finite through many layers; norms start at one."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)


def build_model(spec: ModelSpec, folder: str | Path, *, device: torch.device, dtype: torch.dtype,
                load_format: str = "auto", layer_range: range | None = None,
                max_positions: int | None = None, seed: int = 0,
                check_finite: bool = True) -> LlamaForCausalLM:
    """Allocate the module on `device` in `dtype` without initialising it, then fill it
    (`check_finite`: fail on NaN/Inf in the checkpoint's tensors)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(spec, layer_range, max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    model.to_empty(device=device)
    model.reset_buffers()
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        try:
            load_safetensors(model, Path(folder), check_finite)
        except (WeightLoadError, DamagedCheckpointError) as error:
            from models.embedded import rebuild_hint_for
            hint = rebuild_hint_for(Path(folder))
            if hint is None:
                raise
            raise type(error)(f"{error}; {hint}") from error
    return model.eval()
