"""Checkpoint -> module: safetensors straight into the parameters, or random `dummy` weights.

Tensors are read one at a time from memory-mapped safetensors files: each, as a safetensors slice
that the receiving loader reads (all of it, or a tensor-parallel rank's rows or columns only:
`loaded[start:stop]`, never the whole tensor, so a rank's host memory stays near its shard), goes to the
`weight_loader(param, loaded_tensor, shard_id)` of the module that owns its parameter (the vLLM /
nano-vllm pattern): the layer knows its own layout, so packed q/k/v (shard ids "q", "k", "v"),
packed gate/up (0, 1) and tensors stored already fused (Phi-3's qkv_proj and gate_up_proj, shard id
None) are one mechanism. HF names map to ours one to one except where the family's
`packed_modules` names a packed target. The weights never exist twice in memory: the one copy
goes from the mapped file into the parameter (on a CPU, parameters live in one huge-page mapping,
models/param_arena.py; to a GPU, through pinned buffers, models/weight_copy.py).

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

from models.causal_lm import CausalLM
from models.hf_config import CheckpointError, ModelSpec
from models.layers import OffsetRMSNorm, WeightLoadError, default_weight_loader
from models.param_arena import place_parameters_in_arena
from models.registry import model_class
from models.safetensors_file import DamagedCheckpointError, read_safetensors_header
from models.weight_copy import PinnedStager, staged_copies

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


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


def _target(model: CausalLM, name: str) -> tuple[str, object] | None:
    """Our (parameter name, shard id) for a checkpoint tensor; None if another rank owns it."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) not in model.layer_range:
        return None
    first, last = model.model.is_first, model.model.is_last
    if name == "model.embed_tokens.weight":
        if first:
            return name, None
        return ("lm_head.weight", "tied") if last and model.spec.tie_word_embeddings else None
    if name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return None  # tied: the embedding is the head; HF ignores a stored copy too
    if (name == "model.norm.weight" or name == "lm_head.weight") and not last:
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in model.packed_modules:
        packed, shard = model.packed_modules[parts[-2]]
        return ".".join(parts[:-2] + [packed, parts[-1]]), shard
    return name, None


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def _expected(model: CausalLM) -> set[tuple[str, object]]:
    """(parameter, shard id) pairs a complete checkpoint fills: a packed parameter's shards, or
    (parameter, None) where the family's checkpoints store it whole."""
    packed_targets = {target for target, _ in model.packed_modules.values()}
    expected = set()
    for name, _ in model.named_parameters():
        owner = _owner(model, name)
        shards = getattr(owner, "shard_ids", ()) if name.split(".")[-2] in packed_targets else ()
        expected.update((name, s) for s in shards or (None,))
    if model.spec.tie_word_embeddings and model.model.is_last and not model.model.is_first:
        expected.discard(("lm_head.weight", None))
        expected.add(("lm_head.weight", "tied"))
    return expected


def _checkpoint_name(model: CausalLM, param: str, shard) -> str:
    if shard == "tied":
        return "model.embed_tokens.weight"
    if shard is None:
        return param
    inverse = {v: k for k, v in model.packed_modules.items()}
    parts = param.split(".")
    return ".".join(parts[:-2] + [inverse[(parts[-2], shard)], parts[-1]])


def destination(model: CausalLM, param_name: str, shard) -> torch.Tensor:
    """Where a checkpoint tensor lands: the parameter, or its shard's rows of a packed one (for
    messages and checks that need the expected shape or the loaded values)."""
    param = model.get_parameter(param_name)
    owner = _owner(model, param_name)
    if shard in (None, "tied") or not hasattr(owner, "shard_view"):
        return param.data
    return owner.shard_view(param, shard)


def checkpoint_shape(model: CausalLM, param_name: str, shard) -> tuple[int, ...]:
    """The shape of the checkpoint tensor that fills (param_name, shard), for messages: larger than
    `destination` where a tensor-parallel rank keeps only its slice of it."""
    owner = _owner(model, param_name)
    if hasattr(owner, "checkpoint_shape"):
        return owner.checkpoint_shape(model.get_parameter(param_name), None if shard == "tied" else shard)
    return tuple(destination(model, param_name, shard).shape)


def _load_one(model: CausalLM, params: dict, param_name: str, shard, tensor) -> None:
    """Hand one checkpoint tensor (a safetensors slice, read by the loader that takes it) to the
    weight_loader of the module that owns the parameter (a tied head of a rank without the
    embedding: the head's own loader, given the embedding's tensor)."""
    param = params[param_name]
    loader = getattr(_owner(model, param_name), "weight_loader", None) or default_weight_loader
    loader(param, tensor, None if shard == "tied" else shard)


@torch.no_grad()
def load_safetensors(model: CausalLM, folder: Path, check_finite: bool = True,
                     pinned_staging: bool | None = None) -> None:
    """Walk the checkpoint once; every tensor goes to its parameter's weight_loader
    (`check_finite`: then fail on NaN/Inf in what was loaded, naming the tensor;
    `pinned_staging`: copy to a GPU through pinned buffers, models/weight_copy.py; None: on a GPU)."""
    files = checkpoint_tensor_files(folder)
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device if params else torch.device("cpu")
    if pinned_staging is None:
        pinned_staging = device.type == "cuda"
    stager = PinnedStager(device) if pinned_staging else None
    expected, loaded = _expected(model), set()
    finite = _FiniteCheck()
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} named in the index does not exist")
        with staged_copies(stager):
            present = read_safetensors_header(file)
            for name in names:
                target = _target(model, name)
                if target is None:
                    continue
                param_name, shard = target
                if param_name not in params:
                    raise WeightLoadError(f"unexpected tensor {name!r} in {file.name}: no such parameter "
                                          f"in {model.spec.architecture}")
                if name not in present:
                    raise WeightLoadError(f"missing tensor {name!r} (expected shape "
                                          f"{checkpoint_shape(model, param_name, shard)}, found none): "
                                          f"the index names {file.name}, which lacks it")
                try:   # its own mapping, unmapped once copied: the file's pages never pile up resident
                    with _open(file) as mapped:
                        _load_one(model, params, param_name, shard, mapped.get_slice(name))
                except WeightLoadError as error:
                    raise WeightLoadError(f"shape mismatch for {name!r} in {file.name}: {error}") from None
                if check_finite:
                    finite.add(name, file, destination(model, param_name, shard))
                loaded.add((param_name, shard))
    # A packed parameter stored whole (shard id None) covers its shards too.
    missing = sorted((_checkpoint_name(model, p, s), checkpoint_shape(model, p, s))
                     for p, s in expected - loaded if (p, None) not in loaded)
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
        if name.endswith("norm.weight"):   # an OffsetRMSNorm multiplies by 1 + weight
            param.fill_(0.0 if isinstance(_owner(model, name), OffsetRMSNorm) else 1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Module.to_empty without its cost: every meta parameter and buffer replaced by an
    uninitialised tensor of its shape and dtype on `device` (a tensor several modules share gets
    one replacement; to_empty would make one per module). Not `to_empty` itself: its
    torch.empty_like on a meta tensor runs torch's Python reference, which imports torch.fx's
    symbolic shapes and sympy (~2 s of a GPU start-up: docs/PERFORMANCE.md, "GPU: LLM to ready")."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(meta tensor) -> (it, its replacement)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:   # the meta tensor stays referenced here, so its id is not reused
                    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = (t, torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter)
                                   else empty)
                table[name] = made[id(t)][1]


def allocate_model(spec: ModelSpec, *, device: torch.device, dtype: torch.dtype,
                   layer_range: range | None = None, max_positions: int | None = None,
                   huge_pages: bool = True) -> CausalLM:
    """The module on `device` in `dtype`, parameters allocated but not written (on a CPU in one
    huge-page mapping, models/param_arena.py, unless `huge_pages=False`: torch's allocator, which
    `graphrunner bench load` compares), buffers computed."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(spec.architecture)(spec, layer_range, max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    materialize(model, device)
    if device.type == "cpu" and huge_pages:
        place_parameters_in_arena(model)
    model.reset_buffers()
    return model


def build_model(spec: ModelSpec, folder: str | Path, *, device: torch.device, dtype: torch.dtype,
                load_format: str = "auto", layer_range: range | None = None,
                max_positions: int | None = None, seed: int = 0, check_finite: bool = True,
                pinned_staging: bool | None = None) -> CausalLM:
    """Allocate the module on `device` in `dtype` without initialising it, then fill it
    (`check_finite`: fail on NaN/Inf in the checkpoint's tensors; `pinned_staging`: see
    load_safetensors)."""
    model = allocate_model(spec, device=device, dtype=dtype, layer_range=layer_range, max_positions=max_positions)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        try:
            load_safetensors(model, Path(folder), check_finite, pinned_staging)
        except (WeightLoadError, DamagedCheckpointError) as error:
            from models.embedded import rebuild_hint_for
            hint = rebuild_hint_for(Path(folder))
            if hint is None:
                raise
            raise type(error)(f"{error}; {hint}") from error
    return model.eval()
