"""RoPE inverse frequencies and attention scaling per rope type, from a config's normalized
`rope_parameters` (models/config_json.py): default, linear, llama3, yarn and longrope, written out
with transformers' formulas and float32 rounding points (tests/test_hf_config.py compares them with
transformers' own rope-init functions), so no transformers model or config module is imported.

`dynamic` rescales with the sequence length at run time, which a paged KV cache that stores keys
rotated once cannot follow: it is refused.
"""

from __future__ import annotations

import math

import torch


def rope_head_dim(config, params: dict) -> int:
    """The rotated dimension: head_dim (hidden_size / heads when unset) times partial_rotary_factor."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _base_inverse_frequencies(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _default(config, params: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    return _base_inverse_frequencies(params["rope_theta"], rope_head_dim(config, params)), 1.0


def _linear(config, params: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inverse_frequencies(params["rope_theta"], rope_head_dim(config, params))
    inv_freq /= params["factor"]
    return inv_freq, 1.0


def _llama3(config, params: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inverse_frequencies(params["rope_theta"], rope_head_dim(config, params))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config, params: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    base, dim = params["rope_theta"], rope_head_dim(config, params)
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _longrope(config, params: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3's su scaling: short factors up to original_max_position_embeddings, long ones beyond
    (chosen by `seq_len`, the engine's context limit: see models/rotary.py)."""
    base, dim = params["rope_theta"], rope_head_dim(config, params)
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = bool(seq_len and seq_len > original)
    ext_factors = torch.tensor(params["long_factor"] if long else params["short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * base ** shape), attention_factor


ROPE_TYPES = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope}


def rope_inverse_frequencies(config, layer_type: str | None = None,
                             max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies [rotated dim / 2] and the attention scaling of the config's RoPE
    (of `layer_type`'s where the config keeps one per layer type). `max_positions` picks longrope's
    factors."""
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = params.get("rope_type") or "default"
    if rope_type == "dynamic":
        raise ValueError(f"rope type {rope_type!r} depends on the sequence length at run time; unsupported")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {sorted(ROPE_TYPES)}")
    with torch.device("cpu"):  # real numbers even while the module is being built on "meta"
        return ROPE_TYPES[rope_type](config, params, max_positions)
