"""runner/tokenizer.load_tokenizer (AutoTokenizer handed our config) gives what AutoTokenizer alone
gives (class, ids, special tokens, chat template, decoding) for every family, every spelling of the
tokenizer class in tokenizer_config.json, and a tokenizer folder without config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from checkpoints import make_tiny_checkpoint
from runner.tokenizer import load_tokenizer

TEXTS = ["Hello, world!", "  spaces\tand\nlines ", "ünïcødé ✓ 日本語", "def f(x):\n    return x ** 2"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def assert_same(ours, theirs):
    assert type(ours) is type(theirs)
    assert [ours(t).input_ids for t in TEXTS] == [theirs(t).input_ids for t in TEXTS]
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.all_special_ids) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, theirs.all_special_ids)
    assert ours.chat_template == theirs.chat_template
    if theirs.chat_template:
        assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
            theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = theirs(TEXTS[2]).input_ids
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def _rename_class(folder: Path, name: str) -> None:
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = name
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "qwen2", "phi3", "mistral"])
def test_each_family_gets_autotokenizers_tokenizer(tmp_path, family):
    path, _ = make_tiny_checkpoint(tmp_path / family, family)
    assert_same(load_tokenizer(str(path)), AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("name", ["GPT2Tokenizer", "GPT2TokenizerFast", "PreTrainedTokenizerFast", "LlamaTokenizer",
                                  "LlamaTokenizerFast", "TokenizersBackend"])
def test_every_spelling_of_the_class_loads_as_autotokenizer_loads_it(tmp_path, name):
    """The embedded SmolLM2 (model type llama, a GPT-2 BPE tokenizer.json) with tokenizer_config.json
    naming its class each way a hub checkpoint does."""
    from models.embedded import ensure_smollm2
    folder = tmp_path / "smollm2"
    folder.mkdir()
    for file in Path(ensure_smollm2()).iterdir():
        if file.suffix in (".json", ".jinja"):
            shutil.copy(file, folder / file.name)
    _rename_class(folder, name)
    assert_same(load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder))


def test_a_tokenizer_folder_without_config_json(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa")
    alone = tmp_path / "tokenizer-only"   # a --tokenizer folder without config.json
    alone.mkdir()
    for file in path.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, alone / file.name)
    assert_same(load_tokenizer(str(alone)), AutoTokenizer.from_pretrained(alone))
