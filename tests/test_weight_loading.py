"""Weight loading makes one copy: mapped file -> parameter (models/loader.py,
models/param_arena.py, models/weight_copy.py), and `graphrunner bench load` reports it against cat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import make_tiny_checkpoint
from models import load_hf_config, model_spec
from models import weight_copy
from models.loader import allocate_model, build_model, load_safetensors
from models.param_arena import ALIGNMENT, place_parameters_in_arena
from models.weight_copy import PinnedStager, staged_copies


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path`."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            begin, end = (int(v, 16) for v in fields[0].split("-"))
            ranges.append((begin, end))
    return ranges


def test_load_copies_each_tensor_once_straight_from_the_mapping(tmp_path, monkeypatch):
    """Every tensor a weight_loader copies from is a view of the mapped checkpoint file (no
    intermediate copy), and it is copied exactly once, into the model's parameters."""
    path, hf = make_tiny_checkpoint(tmp_path / "ckpt", "llama_gqa", with_tokenizer=False)
    spec = model_spec(load_hf_config(path))
    model = allocate_model(spec, device=torch.device("cpu"), dtype=torch.float32)
    file = (path / "model.safetensors").resolve()
    copies = []
    real = weight_copy.copy_weight

    def recording(dest, src):
        mapped = any(b <= src.data_ptr() < e for b, e in _file_mappings(file))   # while the file is mapped
        copies.append((dest.data_ptr(), mapped))
        real(dest, src)

    monkeypatch.setattr("models.layers.copy_weight", recording)
    before = set(_file_mappings(file))   # the HF reference model maps the file too
    load_safetensors(model, path)
    assert set(_file_mappings(file)) <= before, "the checkpoint stays mapped (resident) after the load"
    stored = load_file(str(file))
    assert len(copies) == len(stored)
    assert all(mapped for _, mapped in copies)
    arena = next(model.parameters()).untyped_storage()
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.nbytes()
    assert all(lo <= dest < hi for dest, _ in copies)
    hf_state = hf.state_dict()
    assert torch.equal(model.get_parameter("model.layers.0.mlp.down_proj.weight"),
                       hf_state["model.layers.0.mlp.down_proj.weight"])


def test_cpu_parameters_share_one_aligned_mapping_and_load_right(tmp_path):
    path, hf = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", with_tokenizer=False, tie_word_embeddings=True)
    spec = model_spec(load_hf_config(path))
    model = build_model(spec, path, device=torch.device("cpu"), dtype=torch.float32)
    params = list(model.parameters())
    storage = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in params)
    assert all(p.data_ptr() % ALIGNMENT == 0 for p in params)
    ends = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:])), "parameters overlap"
    hf_state = hf.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_norm.weight", "model.norm.weight"):
        assert torch.equal(model.get_parameter(name), hf_state[name])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()   # still tied


def test_arena_of_a_model_without_parameters_is_empty():
    assert place_parameters_in_arena(torch.nn.Module()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_stager_chunks_copy_exactly(dtype):
    """Buffers smaller than the tensors: chunk boundaries fall inside elements' rows and the
    buffers are reused round-robin; the result is bit-identical."""
    stager = PinnedStager(torch.device("cpu"), buffer_bytes=1000, buffers=2, pin=False)
    sources = [torch.randn(37, 29).to(dtype), torch.randn(5).to(dtype), torch.randn(3001).to(dtype)]
    dests = [torch.empty_like(s) for s in sources]
    with staged_copies(stager):
        for d, s in zip(dests, sources):
            weight_copy.copy_weight(d, s)
    assert all(torch.equal(d, s) for d, s in zip(dests, sources))
    assert stager.staged_bytes == sum(s.numel() * s.element_size() for s in sources)


def test_stager_takes_the_plain_copy_for_conversions_and_strided_slices():
    stager = PinnedStager(torch.device("cpu"), buffer_bytes=64, buffers=2, pin=False)
    src = torch.randn(8, 6)
    converted, column = torch.empty(8, 6, dtype=torch.bfloat16), torch.empty(8, 3)
    with staged_copies(stager):
        weight_copy.copy_weight(converted, src)
        weight_copy.copy_weight(column, src[:, 3:])
    assert torch.equal(converted, src.to(torch.bfloat16)) and torch.equal(column, src[:, 3:])
    assert stager.staged_bytes == 0


def test_copy_weight_outside_staging_is_a_plain_copy():
    dest, src = torch.empty(4), torch.arange(4.0)
    weight_copy.copy_weight(dest, src)
    assert torch.equal(dest, src)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pinned_staging_loads_the_same_weights_as_plain_copies(tmp_path, dtype):
    path, _ = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", with_tokenizer=False, dtype=dtype)
    spec = model_spec(load_hf_config(path))
    device = torch.device("cuda")
    staged = build_model(spec, path, device=device, dtype=dtype, pinned_staging=True)
    plain = build_model(spec, path, device=device, dtype=dtype, pinned_staging=False)
    stored = load_file(str(path / "model.safetensors"))
    for (name, a), (_, b) in zip(staged.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(staged.get_parameter("model.norm.weight").cpu(), stored["model.norm.weight"])


def test_bench_load_reports_load_beside_cat(tmp_path, capsys):
    from runner.benchmarks import load
    assert load.main(["--synthetic", "smollm2-135m", "--num-layers", "1", "--no-embedded", "--repeats", "1",
                      "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "warm page cache" in printed and "cat > /dev/null" in printed and "% of cat" in printed
    result = json.loads((tmp_path / "out" / "load.json").read_text())["results"][0]
    assert result["dtype"] == "bfloat16" and result["bytes"] > 20e6
    for key in ("cat", "load", "load_unchecked", "load_small_pages"):
        assert result[key]["best_gb_s"] > 0 and result[key]["best_s"] > 0
    assert result["load"]["fraction_of_cat"] == pytest.approx(result["load"]["best_gb_s"] / result["cat"]["best_gb_s"])
