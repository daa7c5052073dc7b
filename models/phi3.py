"""Phi-3 (Phi3ForCausalLM): a Llama-shaped decoder whose checkpoints store q/k/v already fused as
`qkv_proj` and gate/up as `gate_up_proj`; they load as stored (no `packed_modules`: shard id None),
through the same QKVLinear / MergedLinear weight_loader that packs Llama's separate tensors.

Its su / longrope RoPE scaling is the rotary table's business (models/layers.py,
`rope_inverse_frequencies`: short or long factors, chosen once by max_model_len against
original_max_position_embeddings), and its optional `sliding_window` (every layer) the attention
backend's.
"""

from __future__ import annotations

from models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules = {}
