"""What every decoder-only family shares: the pipeline slice, the embedding, the final norm, the LM
head, and how checkpoint names map onto packed parameters.

A family (models/llama.py, phi3.py, gemma2.py, gemma3.py) subclasses `DecoderModel` to say how one
of its layers is built and `CausalLM` to name that model, its checkpoint's packed projections and
its logit soft-cap. The fast paths are in the shared layers (models/layers.py), which every family
builds from, so a family file holds only the arithmetic that makes it that family.

The forward takes flattened tokens (no batch or padding dimension) and reads per-step attention
state from the forward context. Under pipeline parallelism a rank holds only its contiguous slice of
layers; the first rank embeds, the last normalises and projects.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Iterator

import torch
from torch import nn

from models.hf_config import ModelSpec
from models.layers import RMSNorm, soft_cap
from models.parallel_state import shard_heads, tensor_parallel_group
from models.rotary import RotaryEmbedding
from models.vocab_parallel import lm_head_linear, vocab_embedding


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next."""
    hidden_states: torch.Tensor
    residual: torch.Tensor


def add_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None):
    """(norm(hidden + residual), hidden + residual); the first layer (residual None) starts the
    residual stream with its input."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def layer_sliding_window(spec: ModelSpec, layer_index: int) -> int | None:
    """The sliding window of one layer: `sliding_window` for the layers `layer_types` marks
    "sliding_attention" (every layer when the config has no layer_types), None otherwise."""
    config = spec.hf_config
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_index] != "sliding_attention":
        return None
    return int(window)


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm, over one pipeline slice. Subclasses build the layers
    (`make_layer`) and say which rotary tables they use (`make_rotaries`)."""

    norm_class: ClassVar[type[RMSNorm]] = RMSNorm
    embedding_scaled: ClassVar[bool] = False
    """Gemma multiplies the embedding by sqrt(hidden_size)."""

    def __init__(self, spec: ModelSpec, layer_range: range, max_positions: int) -> None:
        super().__init__()
        self.is_first = layer_range.start == 0
        self.is_last = layer_range.stop == spec.num_layers
        if self.is_first:
            scale = spec.hidden_size ** 0.5 if self.embedding_scaled else None
            self.embed_tokens = vocab_embedding(spec.vocab_size, spec.hidden_size, scale)
        rotaries = self.make_rotaries(spec, max_positions)
        self._rotaries = list(rotaries.values())
        # Keyed by the global layer index so parameter names match the checkpoint's.
        self.layers = nn.ModuleDict({str(i): self.make_layer(spec, i, n, rotaries)
                                     for n, i in enumerate(layer_range)})
        layer_types = getattr(spec.hf_config, "layer_types", None)
        self.layer_kinds = [(layer_types[i] if layer_types else None, layer_sliding_window(spec, i))
                            for i in layer_range]
        """Per local layer, what of its own decides which kernel variants it launches: its
        `layer_types` entry (Gemma 3's local / global rotary table) and its sliding window."""
        self._forwarded_layers: list[nn.Module] | None = None
        if self.is_last:
            self.norm = self.norm_class(spec.hidden_size, spec.rms_norm_eps)

    def make_rotaries(self, spec: ModelSpec, max_positions: int) -> dict[str, RotaryEmbedding]:
        """The model's rotary tables by name (one, shared by every layer, unless overridden)."""
        self.rotary_emb = RotaryEmbedding(spec.hf_config, max_positions)
        return {"default": self.rotary_emb}

    def make_layer(self, spec: ModelSpec, layer_index: int, cache_index: int,
                   rotaries: dict[str, RotaryEmbedding]) -> nn.Module:
        """Layer `layer_index` of the model (`cache_index`: its KV cache among this slice's). Each
        family's DecoderModel builds its own (models/llama.py, gemma2.py, gemma3.py; Phi-3 takes Llama's)."""
        raise NotImplementedError(f"{type(self).__name__} does not build its layers: a family's DecoderModel "
                                  "subclass defines make_layer")

    def one_layer_of_each_kind(self) -> list[nn.Module]:
        """The local layers whose kernel launches differ from every other's: the first of each kind
        (its class and `layer_kinds`), where the slice's first layer on the first rank is a kind of
        its own (it starts the residual stream: its input norm adds no residual). Every other layer
        launches the same kernels with the same specialisations as the one chosen for its kind: the
        same shapes, and its weights and KV cache at addresses aligned alike."""
        chosen, seen = [], set()
        for n, (layer, kind) in enumerate(zip(self.layers.values(), self.layer_kinds)):
            key = (type(layer), kind, self.is_first and n == 0)
            if key not in seen:
                seen.add(key)
                chosen.append(layer)
        return chosen

    @contextmanager
    def kinds_only(self) -> Iterator[None]:
        """Inside the block the forward runs `one_layer_of_each_kind` instead of every layer. For
        the start-up's compile-ahead pass (runner/graph_start_up.py), which only collects the kernel
        variants a forward launches and discards its output: two of Qwen3-0.6B's 28 layers launch
        all of them."""
        self._forwarded_layers = self.one_layer_of_each_kind()
        try:
            yield
        finally:
            self._forwarded_layers = None

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None = None):
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden_states, intermediate.residual
        for rotary in self._rotaries:
            rotary.begin_step(positions)  # cos/sin gathered once, shared by every layer
        try:
            for layer in self._forwarded_layers or self.layers.values():
                hidden, residual = layer(positions, hidden, residual)
        finally:
            for rotary in self._rotaries:
                rotary.end_step()
        if not self.is_last:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


LLAMA_PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
"""HF projection -> (our packed projection, shard id), for checkpoints that store them apart."""


class CausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], intermediate=None)` -> hidden [T, H] on the last
    pipeline rank, IntermediateTensors elsewhere; `compute_logits(hidden [N, H])` -> [N, V] fp32
    (model dtype on request), the whole vocabulary on every tensor-parallel rank.

    Under tensor parallelism (models/parallel_state.py, set before the model is built) every
    layer holds its rank's share; `num_local_heads` / `num_local_kv_heads` say how many heads."""

    model_class: ClassVar[type[DecoderModel]]
    packed_modules: ClassVar[dict[str, tuple[str, object]]] = LLAMA_PACKED_MODULES
    """Checkpoint module name -> (our module, shard id): models/loader.py calls our module's
    `weight_loader` with that shard id. A name absent here loads as stored (shard id None)."""

    def __init__(self, spec: ModelSpec, layer_range: range | None = None, max_positions: int | None = None):
        super().__init__()
        self.spec = spec
        group = tensor_parallel_group()
        heads = shard_heads(spec.num_heads, spec.num_kv_heads, group.size, group.rank)
        self.num_local_heads = heads.num_heads
        """Attention q heads this tensor-parallel rank holds (spec.num_heads on a single rank)."""
        self.num_local_kv_heads = heads.num_kv_heads
        """KV heads this rank holds and caches: its KV cache is [2, blocks, block_size,
        num_local_kv_heads, head_dim] (spec.num_kv_heads on a single rank; 1 where there are fewer
        KV heads than ranks, each replicated on size / num_kv_heads ranks)."""
        self.layer_range = layer_range if layer_range is not None else range(spec.num_layers)
        self.model = self.model_class(spec, self.layer_range, max_positions or spec.max_position_embeddings)
        self.final_logit_softcapping = getattr(spec.hf_config, "final_logit_softcapping", None)
        """Gemma 2: logits = cap * tanh(logits / cap). None: the LM head's output as it is."""
        if self.model.is_last:
            self.lm_head = lm_head_linear(spec.hidden_size, spec.vocab_size)
            if spec.tie_word_embeddings and self.model.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight

    def reset_buffers(self) -> None:
        """Recompute non-parameter state after `loader.materialize` (the module is built on the meta
        device to skip a useless random init) and re-tie the head to the embedding."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_cache()
        if hasattr(self, "lm_head") and self.model.is_first and self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_local_layers(self) -> int:
        return len(self.layer_range)

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None = None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits of the rows of hidden; in float32 for the sampler, or in the model dtype where
        only their argmax is needed (the same index: the float32 values are exact conversions).
        One row on a GPU: `Linear` streams the LM head through the one-row GEMV."""
        logits = soft_cap(self.lm_head(hidden), self.final_logit_softcapping)
        return logits.float() if float32 else logits
