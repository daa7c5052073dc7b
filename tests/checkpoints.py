"""Tiny random HF checkpoints written by transformers itself, plus HF reference outputs.

Why: parity tests need checkpoints whose layout and config are exactly what the Hub would
give us (key names, sharding index, tied embeddings, rope_parameters), without downloads.
Letting transformers' own `*ForCausalLM(config).save_pretrained()` write them means our loader
is tested against the real format, and the returned HF model is the reference implementation.

Weights are re-drawn after HF's init on purpose: HF zeroes biases and sets norm weights to 1,
which would make the q/k/v biases (Qwen2) and q/k norms (Qwen3) invisible to a parity test, and
its std-0.02 init gives near-uniform logits whose greedy argmax flips on float noise.

Usage from a test (tests/ is on sys.path under pytest's default rootdir-less import mode):
    from checkpoints import make_tiny_checkpoint, hf_greedy_generate, hf_prefill_logits
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES: dict[str, tuple[type, type, dict]] = {
    # family: (config class, model class, what makes it that family)
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4)),  # MHA
    "llama_gqa": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2)),
    # sliding_window=None: Mistral v0.3 style; a window < seq len is a different feature.
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict()),  # q/k/v biases are built in
    # head_dim 32 with 4 heads: q_proj is 64 -> 128, so head_dim != hidden / heads.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, num_hidden_layers=3)),
    # Fused qkv_proj / gate_up_proj in the checkpoint; original_max_position_embeddings 64 < 256 so
    # longrope's short/long factors (rope_scaling="longrope") both matter at tiny sizes.
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(original_max_position_embeddings=64)),
    # Soft-caps small enough to bend these scores and logits; window 8 < the test prompts;
    # layers alternate sliding / global (HF's default layer_types); head_dim != hidden / heads.
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(head_dim=32, num_hidden_layers=3, query_pre_attn_scalar=24,
                                                     sliding_window=8, attn_logit_softcapping=3.0,
                                                     final_logit_softcapping=10.0)),
    # 5 local layers then 1 global (HF's default layer_types for 6 layers), two RoPE bases, the
    # global one linearly scaled; window 8.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        head_dim=32, num_hidden_layers=6, query_pre_attn_scalar=24, sliding_window=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
}

ROPE_SCALINGS = {
    # original_max_position_embeddings 64 < max_position_embeddings 256, so the scaling matters
    # at tiny sizes; yarn's factor equals 256 / 64 so transformers does not warn.
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    # Phi-3's su scaling: one factor per rotary frequency (head_dim 16 -> 8), short and long distinct.
    "longrope": dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                     long_factor=[2.0 + 0.5 * i for i in range(8)], original_max_position_embeddings=64),
}


def _rope_kwargs(config_cls: type, rope_theta: float, scaling: dict | None) -> dict:
    """transformers 5.x takes one `rope_parameters` dict; 4.x took rope_theta + rope_scaling."""
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, **(scaling or {})}}
    return {"rope_theta": rope_theta, "rope_scaling": scaling}


@torch.no_grad()
def _redraw_weights(model: PreTrainedModel, generator: torch.Generator) -> None:
    """O(1) activations, visible biases and norm weights, well separated logits (see module doc)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=generator))
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        elif name.endswith("embed_tokens.weight"):  # small, so tied models do not just echo
            p.copy_(torch.randn(p.shape, generator=generator) * 0.25)
        else:  # Linear [out, in]: lm_head gets 2x so logits have std ~2
            scale = (2.0 if name == "lm_head.weight" else 1.0) / math.sqrt(p.shape[1])
            p.copy_(torch.randn(p.shape, generator=generator) * scale)


def _byte_tokenizer(model_max_length: int):
    """A lossless 256-token byte-level tokenizer, so text prompts work on tiny checkpoints.

    Token id == byte value (GPT-2's printable byte->char map); ids 1 and 2 (bytes 0x01/0x02,
    absent from normal text) double as bos/eos so they match the config.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    byte_char = {b: chr(b if b in printable else next(extra)) for b in range(256)}
    vocab = {byte_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=byte_char[1], eos_token=byte_char[2],
                                   pad_token=byte_char[0], model_max_length=model_max_length)


def make_tiny_checkpoint(path: str | Path, family: str, *, tie_word_embeddings: bool = False,
                         rope_scaling: str | dict | None = None, rope_theta: float | None = None,
                         sharded: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0,
                         with_tokenizer: bool = True, **overrides) -> tuple[Path, PreTrainedModel]:
    """Write a tiny random checkpoint of `family` into `path`; return (path, the HF model).

    family: one of FAMILIES. rope_scaling: "llama3", "yarn", or a full scaling dict.
    sharded: max_shard_size 100KB -> several model-0000x-of-0000y.safetensors + index.json.
    dtype: the stored dtype (config.dtype says it too). overrides: any config field.
    The returned model is `from_pretrained(path, dtype=dtype)` in eval mode: the HF reference.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    config_cls, model_cls, family_kwargs = FAMILIES[family]
    if isinstance(rope_scaling, str):
        rope_scaling = ROPE_SCALINGS[rope_scaling]
    theta = rope_theta if rope_theta is not None else (500000.0 if rope_scaling else 10000.0)
    rope = {} if "rope_parameters" in family_kwargs else _rope_kwargs(config_cls, theta, rope_scaling)
    kwargs = {**TINY, **family_kwargs, "tie_word_embeddings": tie_word_embeddings, **rope, **overrides}
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config)
    _redraw_weights(model, torch.Generator().manual_seed(seed))

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.dtype = dtype  # config.json's dtype is what dtype="auto" loads
    save_kwargs = {"max_shard_size": "100KB" if sharded else "10GB"}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:  # 4.x
        save_kwargs["safe_serialization"] = True
    model.to(dtype).save_pretrained(path, **save_kwargs)
    if sharded and not (path / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"expected a sharded checkpoint in {path}")
    if with_tokenizer:
        _byte_tokenizer(config.max_position_embeddings).save_pretrained(path)
    # Reload rather than model.to(dtype): .to() would also cast the fp32 rope inv_freq buffer,
    # so the returned model would differ from what any test loads from `path`.
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def hf_prefill_logits(hf_model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """Logits for every position of one prompt: float32 [len(token_ids), vocab]."""
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=hf_model.device)
    return hf_model(input_ids=input_ids, use_cache=False).logits[0].float().cpu()


@torch.no_grad()
def hf_greedy_generate(hf_model: PreTrainedModel, prompts_token_ids: list[list[int]], max_new_tokens: int,
                       ignore_eos: bool = False) -> list[list[int]]:
    """HF's greedy continuation of each prompt, one prompt at a time (no padding to reason about).

    Returns only the new token ids. Generation stops at the config's eos (included in the
    output, as vLLM reports it) unless ignore_eos, which runs all max_new_tokens steps.
    """
    eos = hf_model.generation_config.eos_token_id
    outputs = []
    for ids in prompts_token_ids:
        input_ids = torch.tensor([ids], dtype=torch.long, device=hf_model.device)
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens, min_new_tokens=0,
                                eos_token_id=None if ignore_eos else eos,
                                pad_token_id=hf_model.generation_config.pad_token_id,
                                temperature=None, top_p=None, top_k=None)
        outputs.append(out[0, len(ids):].tolist())
    return outputs
