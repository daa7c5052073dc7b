"""`LLM(model=...)` takes any os.PathLike, and the NaN/Inf weight check is an engine option."""

from __future__ import annotations

import pathlib
import shutil
import struct

import pytest
from pydantic import ValidationError

from checkpoints import make_tiny_checkpoint
from configs import EngineConfig, SamplingParams
from configs.engine_config import ModelConfig
from models.loader import NonFiniteWeightError
from models.safetensors_file import read_safetensors_header
from runner import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SMALL = dict(dtype="float32", device="cpu", num_kv_blocks=16)
"""A small KV cache: the default sizes one from free memory, which takes seconds to zero."""


class _PathLike:
    """An os.PathLike that is neither str nor pathlib.Path."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __fspath__(self) -> str:
        return self.path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    return path


def test_configs_take_a_path_as_the_model_and_tokenizer(tiny):
    assert EngineConfig.from_kwargs(model=pathlib.Path(tiny)).model.model == str(tiny)
    config = ModelConfig(model=_PathLike(tiny), tokenizer=pathlib.Path(tiny))
    assert (config.model, config.tokenizer) == (str(tiny), str(tiny))
    with pytest.raises(ValidationError, match="model"):
        ModelConfig(model=3)


def test_llm_takes_a_path(tiny):
    with LLM(model=pathlib.Path(tiny), **SMALL) as llm:
        assert llm.engine.config.model.model == str(tiny)
        assert len(llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_check_finite_weights_is_a_validated_engine_option(tiny, tmp_path):
    damaged = shutil.copytree(tiny, tmp_path / "damaged")
    file = damaged / "model.safetensors"
    (header_len,) = struct.unpack("<Q", file.read_bytes()[:8])
    begin = read_safetensors_header(file)["model.norm.weight"]["data_offsets"][0]
    with open(file, "r+b") as handle:
        handle.seek(8 + header_len + begin)
        handle.write(b"\xff" * 4)
    with pytest.raises(NonFiniteWeightError, match=r"'model\.norm\.weight'.*1 NaN"):
        LLM(model=damaged, **SMALL)
    with LLM(model=damaged, check_finite_weights=False, **SMALL) as llm:
        assert llm.engine.config.model.check_finite_weights is False
    with pytest.raises(ValidationError, match="check_finite_weights"):
        EngineConfig.from_kwargs(model="x", check_finite_weights="sometimes")
