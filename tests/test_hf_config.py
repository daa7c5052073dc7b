"""models/config_json.py reads config.json without transformers' config classes: every value the
engine takes from a config (the ModelSpec, each layer's sliding window, the context limit, Gemma's
scalars and soft-caps, the activation, RoPE's inverse frequencies and attention scaling per layer
type) equals what it takes from transformers' own config of the same file, for every family, for
config.json files written whole, written as transformers saves them (only what differs from the
defaults) and written by hand in the legacy form the hub still ships (rope_theta + rope_scaling,
torch_dtype, most fields left to the family's defaults)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from checkpoints import FAMILIES, ROPE_SCALINGS, TINY
from models import load_hf_config, model_spec, resolve_max_model_len
from models.causal_lm import layer_sliding_window
from models.config_json import ConfigFileError, hf_config_from_dict
from models.rope_init import rope_inverse_frequencies

REPO = Path(__file__).resolve().parents[1]

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}

# Hand-written config.json files in the hub's legacy form: only what a model card would set.
LEGACY = {
    "llama-3.2": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                  "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                  "max_position_embeddings": 131072, "eos_token_id": [128001, 128008],
                  "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama-minimal": {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4},
    "llama-linear-type": {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama-yarn": {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                       "original_max_position_embeddings": 1024,
                                                                       "beta_fast": 16, "mscale": 0.7,
                                                                       "mscale_all_dim": 0.5}},
    "mistral-minimal": {"model_type": "mistral", "hidden_size": 256, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "torch_dtype": "float16"},
    "mistral-no-window": {"model_type": "mistral", "hidden_size": 256, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "sliding_window": None, "rope_theta": 1000000.0},
    "qwen2-window-off": {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "sliding_window": 131072, "use_sliding_window": False,
                         "max_window_layers": 2, "rope_theta": 1000000.0},
    "qwen2-window-on": {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                        "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
    "qwen3-minimal": {"model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 128, "tie_word_embeddings": True},
    "phi3-mini-4k": {"model_type": "phi3", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "sliding_window": 2047, "rope_scaling": None, "eos_token_id": 32000},
    "phi3-longrope": {"model_type": "phi3", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                      "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(32)],
                                       "long_factor": [2.0 + 0.5 * i for i in range(32)]}},
    "phi4-partial-rotary": {"model_type": "phi3", "hidden_size": 256, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "partial_rotary_factor": 0.75, "rope_theta": 250000.0},
    "gemma2-minimal": {"model_type": "gemma2", "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "hidden_act": "gelu_pytorch_tanh"},
    "gemma3-minimal": {"model_type": "gemma3_text", "hidden_size": 256, "num_hidden_layers": 7,
                       "num_attention_heads": 4, "num_key_value_heads": 1},
    "gemma3-4b": {"model_type": "gemma3_text", "hidden_size": 256, "num_hidden_layers": 12, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 64, "rope_local_base_freq": 10000.0,
                  "rope_theta": 1000000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                  "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 64},
}


def _transformers_files() -> dict[str, dict]:
    """config.json as transformers writes it (to_dict: whole; to_diff_dict: what save_pretrained
    writes) for every family of tests/checkpoints.py, plus Llama and Phi-3 with each scaled RoPE."""
    from checkpoints import _rope_kwargs
    files = {}
    cases = [(family, None) for family in FAMILIES] + [("llama", s) for s in ("llama3", "yarn")] + [
        ("phi3", "longrope")]
    for family, scaling in cases:
        config_cls, _, family_kwargs = FAMILIES[family]
        rope = {} if "rope_parameters" in family_kwargs else _rope_kwargs(
            config_cls, 500000.0 if scaling else 10000.0, ROPE_SCALINGS.get(scaling))
        config = config_cls(**{**TINY, **family_kwargs, **rope})
        name = family + (f"-{scaling}" if scaling else "")
        files[f"{name}-whole"] = config.to_dict()
        files[f"{name}-saved"] = config.to_diff_dict()
    return files


FILES = {**{f"legacy-{k}": v for k, v in LEGACY.items()}, **_transformers_files()}


def _write(tmp_path: Path, fields: dict) -> Path:
    fields = dict(fields)
    fields["architectures"] = fields.get("architectures") or [ARCHITECTURES[fields["model_type"]]]
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return tmp_path


def _hf_rope(config, layer_type: str | None, max_positions: int) -> tuple[torch.Tensor, float]:
    """transformers' own inverse frequencies: its rope-init function, or its default formula."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=max_positions, **kwargs)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    base = params["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0


def _engine_view(config) -> dict:
    """Every value the engine reads from a config, as the engine reads it."""
    spec = model_spec(config)
    fields = {name: getattr(spec, name) for name in spec.__dataclass_fields__ if name != "hf_config"}
    fields["windows"] = [layer_sliding_window(spec, i) for i in range(spec.num_layers)]
    fields["layer_types"] = getattr(config, "layer_types", None)
    fields["max_model_len"] = resolve_max_model_len(spec, None)
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        fields[name] = getattr(config, name, None)
    fields["activation"] = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return fields


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_engine_value_equals_transformers_config(tmp_path, name):
    folder = _write(tmp_path, FILES[name])
    ours, theirs = load_hf_config(folder), AutoConfig.from_pretrained(folder)
    if not hasattr(theirs, "rope_parameters"):
        pytest.skip("transformers before 5.0 keeps rope_scaling: the RoPE comparison needs rope_parameters")
    assert _engine_view(ours) == _engine_view(theirs)
    kinds = sorted(set(ours.layer_types)) if ours.model_type == "gemma3_text" else [None]
    for kind in kinds:
        for max_positions in (64, ours.max_position_embeddings):
            inv, scale = rope_inverse_frequencies(ours, kind, max_positions)
            ref_inv, ref_scale = _hf_rope(theirs, kind, max_positions)
            assert torch.equal(inv, ref_inv.float()), (kind, max_positions)
            assert scale == pytest.approx(ref_scale, rel=1e-12), (kind, max_positions)


def test_the_legacy_files_cover_every_family():
    assert {fields["model_type"] for fields in LEGACY.values()} == set(ARCHITECTURES)


def test_dynamic_rope_is_refused_and_an_unknown_type_named():
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="dynamic"):
        rope_inverse_frequencies(hf_config_from_dict({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    with pytest.raises(ValueError, match="'spiral'"):
        rope_inverse_frequencies(hf_config_from_dict({**base, "rope_scaling": {"rope_type": "spiral"}}))


def test_a_broken_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigFileError, match="config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigFileError, match="JSON object"):
        load_hf_config(tmp_path)


def test_reading_a_config_imports_no_transformers_model_module(tmp_path):
    """The point of the reader: transformers' family config modules import its image/video and
    generation utilities (torchvision, torch._dynamo, scikit-learn where installed)."""
    folder = _write(tmp_path, LEGACY["llama-3.2"])
    script = ("import sys\nfrom models import load_hf_config, model_spec\n"
              f"model_spec(load_hf_config({str(folder)!r}))\n"
              "print(sorted(m for m in sys.modules if m.startswith(('transformers', 'torch._dynamo'))))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"



@pytest.mark.parametrize("generation", [{"eos_token_id": [128001, 128009]}, {"eos_token_id": 7}, {"eos_token_id": None},
                                        {"bos_token_id": 1}, None])
def test_eos_ids_come_from_generation_config_json_as_transformers_reads_it(tmp_path, generation):
    """runner.engine.eos_token_ids reads generation_config.json itself (no transformers import);
    what it takes from the file is GenerationConfig's eos_token_id, and without one the config's."""
    from transformers import GenerationConfig
    from runner.engine import eos_token_ids
    folder = _write(tmp_path, LEGACY["llama-3.2"])
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    spec = model_spec(load_hf_config(folder))
    try:
        theirs = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:   # no generation_config.json
        theirs = None
    if theirs is None:
        theirs = list(spec.eos_token_ids)
    assert eos_token_ids(str(folder), spec, None) == (set(theirs) if isinstance(theirs, list) else {theirs})
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigFileError, match="generation_config.json"):
        eos_token_ids(str(folder), spec, None)
