"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2's layer (models/gemma2.py) with
q/k RMSNorm ((1 + w), over head_dim, before RoPE: the `qk_norm` flag), local sliding-window and
global layers in the pattern `layer_types` gives (5:1), and one RoPE table per kind of layer: local
layers rotate with rope_parameters["sliding_attention"] (rope_local_base_freq), global ones with
rope_parameters["full_attention"] (rope_theta and its scaling). Soft-caps only where the config
sets them (None in the released checkpoints).
"""

from __future__ import annotations

from torch import nn

from models.causal_lm import CausalLM
from models.gemma2 import Gemma2Model, GemmaDecoderLayer
from models.hf_config import ModelSpec
from models.rotary import RotaryEmbedding


class Gemma3Model(Gemma2Model):
    def make_rotaries(self, spec: ModelSpec, max_positions: int) -> dict[str, RotaryEmbedding]:
        kinds = sorted(set(spec.hf_config.layer_types))
        self.rotary_embs = nn.ModuleDict({kind: RotaryEmbedding(spec.hf_config, max_positions, layer_type=kind)
                                          for kind in kinds})
        return dict(self.rotary_embs)

    def make_layer(self, spec: ModelSpec, layer_index: int, cache_index: int,
                   rotaries: dict[str, RotaryEmbedding]) -> GemmaDecoderLayer:
        kind = spec.hf_config.layer_types[layer_index]
        return GemmaDecoderLayer(spec, rotaries[kind], cache_index, layer_index)


class Gemma3ForCausalLM(CausalLM):
    model_class = Gemma3Model
