"""A damaged checkpoint fails at load with an error naming the file or tensor and the problem.

Each case damages a tiny checkpoint the way a bad download or disk does (bytes overwritten
with 0xFF, a truncated file, a garbled header) and checks the loader's error instead of the
garbage text such a checkpoint used to produce.
"""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_tiny_checkpoint
from model_helpers import load_ours
from models.loader import NonFiniteWeightError, WeightLoadError
from models.safetensors_file import DamagedCheckpointError, read_safetensors_header

TENSOR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "c", "llama")
    return path


@pytest.fixture
def checkpoint(pristine, tmp_path):
    """A fresh copy of the tiny checkpoint to damage."""
    import shutil
    return shutil.copytree(pristine, tmp_path / "c")


def _data_offset(file, name: str) -> int:
    """Where `name`'s bytes start in the file."""
    (header_len,) = struct.unpack("<Q", file.read_bytes()[:8])
    return 8 + header_len + read_safetensors_header(file)[name]["data_offsets"][0]


def _overwrite(file, offset: int, data: bytes) -> None:
    with open(file, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def test_0xff_bytes_in_the_weights_fail_naming_the_tensor(checkpoint):
    file = checkpoint / "model.safetensors"
    _overwrite(file, _data_offset(file, TENSOR) + 64, b"\xff" * 16)  # four float32 NaNs
    with pytest.raises(NonFiniteWeightError, match=rf"tensor '{re.escape(TENSOR)}' in '.*model\.safetensors' "
                                                   r"holds 4 NaN and 0 Inf values"):
        load_ours(checkpoint)
    model = load_ours_unchecked(checkpoint)  # the flag turns the check off
    assert torch.isnan(dict(model.named_parameters())[TENSOR].data).sum() == 4


def load_ours_unchecked(path):
    from models import build_model, load_hf_config, model_spec
    return build_model(model_spec(load_hf_config(path)), path, device=torch.device("cpu"), dtype=torch.float32,
                       check_finite=False)


def test_inf_in_a_packed_projection_names_the_checkpoint_tensor(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.weight"][3, 5] = float("-inf")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeightError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*0 NaN and 1 Inf"):
        load_ours(checkpoint)


def test_a_sum_that_only_overflows_is_not_an_error(checkpoint):
    """float16 sums of large finite weights overflow to Inf: the element-wise re-check clears them."""
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"].fill_(60000.0)  # finite in float16; 64 of them sum past its max
    save_file(tensors, file, metadata={"format": "pt"})
    model = load_ours(checkpoint, dtype=torch.float16)
    assert torch.isfinite(model.model.norm.weight).all()


def test_truncated_file_names_the_file_and_the_size_mismatch(checkpoint):
    file = checkpoint / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(DamagedCheckpointError, match=r"'.*model\.safetensors'.*truncated: size mismatch, the header's "
                                                     r"offsets need a data section of \d+ bytes, the file holds \d+"):
        load_ours(checkpoint)


def test_truncated_inside_the_header(checkpoint):
    file = checkpoint / "model.safetensors"
    file.write_bytes(file.read_bytes()[:50])
    with pytest.raises(DamagedCheckpointError, match=r"model\.safetensors.*unreadable header: its length field says"):
        load_ours(checkpoint)


def test_garbled_header_names_the_file(checkpoint):
    file = checkpoint / "model.safetensors"
    _overwrite(file, 8, b"\xff" * 24)
    with pytest.raises(DamagedCheckpointError, match=r"model\.safetensors.*unreadable header \(not valid JSON"):
        load_ours(checkpoint)


def test_header_offsets_that_disagree_with_the_shape(checkpoint):
    """A header edited into a consistent length but a wrong byte range for one tensor."""
    file = checkpoint / "model.safetensors"
    raw = file.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    header["model.norm.weight"]["shape"] = [32]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    file.write_bytes(raw[:8] + text + raw[8 + header_len:])
    with pytest.raises(DamagedCheckpointError, match=r"tensor 'model\.norm\.weight' \(F32, shape \[32\]\) needs 128 "
                                                     r"bytes but its data_offsets .* span 256"):
        load_ours(checkpoint)


def test_damaged_shard_of_an_indexed_checkpoint_is_named(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    file = path / index["weight_map"]["model.norm.weight"]
    file.write_bytes(file.read_bytes()[:-8])
    with pytest.raises(DamagedCheckpointError, match=rf"{re.escape(file.name)}.*truncated"):
        load_ours(path)


def test_missing_tensor_names_its_expected_shape(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"missing tensor\(s\) 'model\.layers\.0\.mlp\.gate_proj\.weight' "
                                              r"\(expected shape \(128, 64\), found none\)"):
        load_ours(checkpoint)


def test_wrong_shape_names_expected_and_found(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"shape mismatch for 'model\.layers\.1\.self_attn\.o_proj\.weight'.*"
                                              r"expected \(64, 64\), found \(64, 32\)"):
        load_ours(checkpoint)


def test_damage_in_the_embedded_models_folder_says_how_to_rebuild_it(pristine, tmp_path, monkeypatch):
    """The start-up check hashes only the embedded model's small files; damage inside its weights
    is found by the loader, whose error then gives the rebuild command."""
    import shutil
    import models.embedded as embedded
    monkeypatch.setattr(embedded, "default_home", lambda: str(tmp_path))
    folder = shutil.copytree(pristine, tmp_path / "SmolLM2-135M-Instruct")
    file = folder / "model.safetensors"
    _overwrite(file, _data_offset(file, TENSOR), b"\xff" * 4)
    with pytest.raises(NonFiniteWeightError, match=rf"'{re.escape(TENSOR)}'.*embedded model's folder: rebuild it with: "
                                                   r"python -m models\.embedded --force"):
        load_ours(folder)


@pytest.mark.parametrize("pack", ["mkl", "onednn"])
def test_a_weight_failing_the_pack_check_leaves_packing_on_for_every_other_weight(pack):
    """A NaN weight (loaded with check_finite_weights=False) fails the pack check; that weight
    alone stays unpacked, so engines built later in the same process compute what a fresh process
    computes (packing used to switch off process-wide, changing later engines' last bits)."""
    import torch.nn.functional as F
    from configs import using_kernel_config
    from models import layers
    if not layers.format_available(pack):   # x86-64 torch wheels ship MKL and oneDNN; others may not
        pytest.skip(f"this torch build has no {pack} packed linear")
    damaged = torch.randn(64, 32)
    damaged[3, 5] = float("nan")
    assert layers.build_pack(pack, damaged) is None
    with using_kernel_config(cpu_linear_pack=pack):
        assert layers._packing_format() == layers.pack_format() == pack
        linear = layers.Linear(32, 64, bias=False)
        x = torch.randn(4, 32)
        with layers.decode_step_products(True):
            got = linear(x)
    packed = layers.weight_packs[pack](linear.weight)
    assert packed is not None
    assert torch.equal(got, layers.packed_product(pack, x, packed, linear.weight, None, 4))
    torch.testing.assert_close(got, F.linear(x, linear.weight))
