"""Checkpoint -> module: safetensors straight into the parameters, or random `dummy` weights.

Tensors are read one at a time from memory-mapped safetensors files and copied into the
(already allocated, already typed) parameters, so the weights never exist twice in memory.
HF names map to ours one to one, except q/k/v_proj -> qkv_proj and gate/up_proj ->
gate_up_proj, which are packed for one matmul each.
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

logger = logging.getLogger(__name__)

_PACKED = {  # HF projection -> (our packed projection, shard id)
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, unexpected, or of the wrong shape."""


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
        with safe_open(file, framework="pt") as handle:
            mapping.update((name, file) for name in handle.keys())
    return mapping


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


@torch.no_grad()
def load_safetensors(model: LlamaForCausalLM, folder: Path) -> None:
    files = checkpoint_tensor_files(folder)
    params = dict(model.named_parameters())
    expected, loaded = _expected(model), set()
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} named in the index does not exist")
        with safe_open(file, framework="pt") as handle:
            present = set(handle.keys())
            for name in names:
                target = _target(model, name)
                if target is None:
                    continue
                param_name, shard = target
                if param_name not in params:
                    raise WeightLoadError(f"unexpected tensor {name!r} in {file.name}: no such parameter "
                                          f"in {model.spec.architecture}")
                if name not in present:
                    raise WeightLoadError(f"missing tensor {name!r}: the index names {file.name}, which lacks it")
                tensor = handle.get_tensor(name)
                dest = params[param_name].data
                if shard is not None:
                    start, stop = _shard_slice(model, param_name.split(".")[-2], shard)
                    dest = dest[start:stop]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise WeightLoadError(f"shape mismatch for {name!r} in {file.name}: expected "
                                          f"{tuple(dest.shape)}, found {tuple(tensor.shape)}")
                dest.copy_(tensor)
                is_tied_head = param_name == "lm_head.weight" and name == "model.embed_tokens.weight"
                loaded.add((param_name, "tied" if is_tied_head else shard))
    missing = sorted(_checkpoint_name(p, s) for p, s in expected - loaded)
    if missing:
        searched = ", ".join(sorted({f.name for f in files.values()}))
        raise WeightLoadError(f"missing tensor(s) {missing} in checkpoint {str(folder)!r} (searched {searched})")


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
                max_positions: int | None = None, seed: int = 0) -> LlamaForCausalLM:
    """Allocate the module on `device` in `dtype` without initialising it, then fill it."""
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
        load_safetensors(model, Path(folder))
    return model.eval()
