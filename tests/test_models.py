"""Issue 2: our Llama-family module against HF transformers (fp32 prefill logits), and loader errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import hf_prefill_logits, make_tiny_checkpoint
from model_helpers import load_ours, prefill_logits
from models import (CheckpointError, UnsupportedArchitectureError, WeightLoadError, build_model, load_hf_config,
                    model_spec)

CASES = {
    "llama_mha": ("llama", {}),
    "llama_gqa_tied": ("llama_gqa", {"tie_word_embeddings": True}),
    "llama_gqa_untied": ("llama_gqa", {"tie_word_embeddings": False}),
    "mistral": ("mistral", {}),
    "qwen2_bias": ("qwen2", {}),
    "qwen3_qknorm_headdim": ("qwen3", {}),
    "llama3_rope": ("llama_gqa", {"rope_scaling": "llama3"}),
    "yarn_rope": ("llama", {"rope_scaling": "yarn"}),
    "sharded": ("llama_gqa", {"sharded": True}),
    "mistral_window": ("mistral", {"sliding_window": 12}),
    "phi3_fused": ("phi3", {}),
    "phi3_window": ("phi3", {"sliding_window": 12}),
    "gemma2": ("gemma2", {}),
    "gemma2_tied": ("gemma2", {"tie_word_embeddings": True}),
    "gemma3": ("gemma3", {}),
    "gemma3_final_softcap": ("gemma3", {"final_logit_softcapping": 10.0}),
}


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 33, 1, 150)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_logits_match_hf(tmp_path, case):
    family, kwargs = CASES[case]
    path, hf = make_tiny_checkpoint(tmp_path / case, family, **kwargs)
    ours = load_ours(path)
    prompts = _prompts()
    for got, prompt in zip(prefill_logits(ours, prompts), prompts):
        expected = hf_prefill_logits(hf, prompt)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4, case


@pytest.mark.parametrize("max_positions,lengths", [(64, (7, 33, 64)), (256, (65, 150))], ids=["short", "long"])
def test_phi3_longrope_factors_follow_max_model_len(tmp_path, max_positions, lengths):
    """Phi-3's su / longrope scaling: HF rotates with the short factors while the sequence is at most
    original_max_position_embeddings (64 here) and with the long ones beyond. Our table is chosen once
    by max_model_len (models/rotary.py, rope_inverse_frequencies): at 64, short factors, HF's for every
    sequence the engine accepts; at 256, long factors, HF's for prompts past 64 tokens."""
    path, hf = make_tiny_checkpoint(tmp_path / "phi3", "phi3", rope_scaling="longrope")
    spec = model_spec(load_hf_config(path))
    ours = build_model(spec, path, device=torch.device("cpu"), dtype=torch.float32, max_positions=max_positions)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    for got, prompt in zip(prefill_logits(ours, prompts), prompts):
        assert (got - hf_prefill_logits(hf, prompt)).abs().max().item() < 1e-4
    factors = "long_factor" if max_positions > 64 else "short_factor"
    rotary = ours.model.rotary_emb
    params = spec.hf_config.rope_parameters
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16)) / torch.tensor(params[factors])
    assert torch.allclose(rotary.cos_sin_cache[1, :8] / rotary.cos_sin_cache[0, 0], torch.cos(inv_freq), atol=1e-6)


def test_phi3_loads_fused_tensors_as_stored(tmp_path):
    """Phi-3's checkpoint holds qkv_proj and gate_up_proj already fused: they load whole (shard id
    None) through the same weight_loader that packs Llama's q/k/v and gate/up shards."""
    path, hf = make_tiny_checkpoint(tmp_path / "phi3", "phi3")
    stored = load_file(path / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in stored and "model.layers.0.mlp.gate_up_proj.weight" in stored
    ours = load_ours(path)
    assert torch.equal(ours.model.layers["0"].self_attn.qkv_proj.weight, stored["model.layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(ours.model.layers["1"].mlp.gate_up_proj.weight, stored["model.layers.1.mlp.gate_up_proj.weight"])
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.qkv_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensor.*model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_ours(path)


def test_weight_loader_places_shards():
    """QKVLinear / MergedLinear: each shard id lands in its rows; a whole tensor fills all of them;
    a wrong shape names expected and found."""
    from models.layers import MergedLinear, QKVLinear
    qkv = QKVLinear(8, num_heads=4, num_kv_heads=2, head_dim=2, bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard, tensor in (("q", q), ("k", k), ("v", v)):
        qkv.weight_loader(qkv.weight, tensor, shard)
    assert torch.equal(qkv.weight.data, torch.cat([q, k, v]))
    qkv.weight_loader(qkv.bias, torch.arange(16.0), None)
    assert torch.equal(qkv.bias.data, torch.arange(16.0))
    gate_up = MergedLinear(8, [3, 3], bias=False)
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    gate_up.weight_loader(gate_up.weight, up, 1)
    gate_up.weight_loader(gate_up.weight, gate, 0)
    assert torch.equal(gate_up.weight.data, torch.cat([gate, up]))
    with pytest.raises(WeightLoadError, match=r"expected \(4, 8\), found \(5, 8\)"):
        qkv.weight_loader(qkv.weight, torch.zeros(5, 8), "k")


def test_weight_loader_takes_unread_safetensors_slices(tmp_path):
    """The loader hands each weight_loader a safetensors slice (`get_slice`), which it reads itself:
    the place a tensor-parallel rank would read only its rows."""
    from safetensors import safe_open

    from models.layers import QKVLinear
    k = torch.randn(4, 8)
    save_file({"k": k, "wrong": torch.zeros(5, 8)}, tmp_path / "t.safetensors")
    qkv = QKVLinear(8, num_heads=4, num_kv_heads=2, head_dim=2, bias=False)
    with safe_open(tmp_path / "t.safetensors", framework="pt") as handle:
        qkv.weight_loader(qkv.weight, handle.get_slice("k"), "k")
        with pytest.raises(WeightLoadError, match=r"expected \(4, 8\), found \(5, 8\)"):
            qkv.weight_loader(qkv.weight, handle.get_slice("wrong"), "v")
    assert torch.equal(qkv.weight.data[8:12], k)


def test_registry_builds_each_family_from_its_module():
    from models.registry import ARCHITECTURES, model_class
    for arch, family in ARCHITECTURES.items():
        cls = model_class(arch)
        assert cls.__module__ == family.module and cls.__name__ == family.class_name


def test_gemma_layers_carry_window_soft_cap_and_scale(tmp_path):
    gemma2 = load_ours(make_tiny_checkpoint(tmp_path / "g2", "gemma2")[0])
    attn = [gemma2.model.layers[str(i)].self_attn.attn for i in range(3)]
    assert [a.sliding_window for a in attn] == [8, None, 8]
    assert all(a.logits_soft_cap == 3.0 and a.scale == 24 ** -0.5 for a in attn)
    assert gemma2.final_logit_softcapping == 10.0
    gemma3 = load_ours(make_tiny_checkpoint(tmp_path / "g3", "gemma3")[0])
    layers = [gemma3.model.layers[str(i)].self_attn for i in range(6)]
    assert [l.attn.sliding_window for l in layers] == [8] * 5 + [None]
    local, glob = layers[0].attn.rotary, layers[5].attn.rotary
    assert local is layers[4].attn.rotary and local is not glob
    assert not torch.allclose(local.cos_sin_cache, glob.cos_sin_cache)
    assert hasattr(layers[0], "q_norm") and gemma3.final_logit_softcapping is None


@pytest.mark.parametrize("family,chosen", [("qwen3", ["0", "1"]), ("gemma2", ["0", "1", "2"]),
                                           ("gemma3", ["0", "1", "5"]), ("phi3", ["0", "1"])])
def test_kinds_only_forwards_one_layer_of_each_kind(tmp_path, family, chosen):
    """The compile-ahead pass's forward (`DecoderModel.kinds_only`): the first layer (its input norm
    starts the residual stream), then the first of each kind (layer_types entry, sliding window):
    Gemma 2 alternates sliding / global, so its third layer is the first sliding one with a
    residual; Gemma 3 is five local, one global. Only those layers run inside the block, every
    layer after it."""
    model = load_ours(make_tiny_checkpoint(tmp_path / family, family)[0])
    ran = []
    for name, layer in model.model.layers.items():
        layer.register_forward_hook(lambda module, args, out, name=name: ran.append(name))
    with model.model.kinds_only():
        kinds_only = prefill_logits(model, _prompts())
    assert ran == chosen
    ran.clear()
    every = prefill_logits(model, _prompts())
    assert ran == list(model.model.layers)
    assert [t.shape for t in kinds_only] == [t.shape for t in every]


def test_a_later_pipeline_slice_has_no_first_layer_kind(tmp_path):
    """On a later pipeline rank the slice's first layer gets the previous rank's residual: it is of
    its kind like any other, so a slice of one kind forwards one layer."""
    path, _ = make_tiny_checkpoint(tmp_path / "c", "qwen3")
    spec = model_spec(load_hf_config(path))
    last = build_model(spec, path, device=torch.device("cpu"), dtype=torch.float32, layer_range=range(1, 3))
    assert last.model.one_layer_of_each_kind() == [last.model.layers["1"]]


def test_family_flags_reach_the_module(tmp_path):
    qwen2 = load_ours(make_tiny_checkpoint(tmp_path / "q2", "qwen2")[0])
    qwen3 = load_ours(make_tiny_checkpoint(tmp_path / "q3", "qwen3")[0])
    assert qwen2.model.layers["0"].self_attn.qkv_proj.bias is not None
    assert qwen3.spec.head_dim == 32 and qwen3.spec.hidden_size // qwen3.spec.num_heads == 16
    assert hasattr(qwen3.model.layers["0"].self_attn, "q_norm")


def test_tied_embeddings_share_storage(tmp_path):
    model = load_ours(make_tiny_checkpoint(tmp_path / "tied", "llama_gqa", tie_word_embeddings=True)[0])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bfloat16_conversion_on_load(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama_gqa")
    model = load_ours(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.layers["0"].self_attn.attn.rotary.cos_sin_cache.dtype == torch.float32


def test_dummy_load_needs_no_weights(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "qwen3")
    for file in path.glob("*.safetensors"):
        file.unlink()
    model = load_ours(path, load_format="dummy")
    spec = model.spec
    qkv = model.model.layers["1"].self_attn.qkv_proj.weight
    assert qkv.shape == ((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, spec.hidden_size)
    assert model.lm_head.weight.shape == (spec.vocab_size, spec.hidden_size)
    assert torch.isfinite(prefill_logits(model, [[5, 6, 7]])[0]).all()


def test_pipeline_slice_loads_only_its_layers(tmp_path):
    path, hf = make_tiny_checkpoint(tmp_path / "c", "llama_gqa", tie_word_embeddings=True)
    spec = model_spec(load_hf_config(path))
    last = build_model(spec, path, device=torch.device("cpu"), dtype=torch.float32, layer_range=range(1, 2))
    assert list(last.model.layers) == ["1"] and not hasattr(last.model, "embed_tokens")
    # Tied head on a rank without the embedding: loaded from the embedding tensor.
    assert torch.equal(last.lm_head.weight, hf.model.embed_tokens.weight)


# ---- errors ---------------------------------------------------------------------------------

def test_unknown_architecture_lists_supported(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        model_spec(load_hf_config(path))


def test_missing_folder_and_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_config(tmp_path / "empty")
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama")
    for file in path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_ours(path)


def _rewrite(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama")
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_proj\.weight.*model\.safetensors"):
        load_ours(path)


def test_missing_tensor_in_sharded_file(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name, file = "model.norm.weight", path / index["weight_map"]["model.norm.weight"]
    tensors = load_file(file)
    tensors.pop(name)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=rf"missing tensor 'model\.norm\.weight'.*{file.name}"):
        load_ours(path)


def test_shape_mismatch_names_expected_and_found(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama")
    _rewrite(path, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 64)))
    with pytest.raises(WeightLoadError, match=r"shape mismatch for 'model\.layers\.0\.mlp\.up_proj\.weight'.*"
                                              r"expected \(128, 64\), found \(3, 64\)"):
        load_ours(path)


def test_unexpected_tensor_is_named(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama")
    _rewrite(path, lambda t: t.__setitem__("model.layers.0.self_attn.mystery.weight", torch.zeros(2)))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.mystery\.weight'"):
        load_ours(path)


def test_bad_config_values_name_the_field():
    from pydantic import ValidationError

    from configs import EngineConfig, SamplingParams
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValidationError, match="block_size"):
        EngineConfig.from_kwargs(model="x", block_size=24)
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        EngineConfig.from_kwargs(model="x", gpu_memory_utilization=1.5)
    with pytest.raises(ValidationError, match="cudagraph_mode"):
        EngineConfig.from_kwargs(model="x", cudagraph_mode="SOMETIMES")
    with pytest.raises(TypeError, match="unknown engine option 'blocksize'"):
        EngineConfig.from_kwargs(model="x", blocksize=16)


def test_decode_rope_signed_tables_match_rotate_bit_for_bit():
    """A decode step's RoPE (`_rotate_signed`, 4 kernels) gives `_rotate`'s bits (HF's rounding)."""
    from models.rotary import _rotate, _rotate_signed
    g = torch.Generator().manual_seed(0)
    for rows in (1, 7, 32, 64):
        qkv = torch.randn(rows, 15 * 64, generator=g) * 4
        x = qkv[:, :12 * 64].view(rows, 12, 64)              # q and k heads of one projection row
        angles = torch.rand(rows, 1, 32, generator=g) * 1000
        cos, sin = angles.cos(), angles.sin()
        signed = (torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1))
        assert torch.equal(_rotate_signed(x, *signed), _rotate(x, cos, sin, 64))
