"""The checkpoint's tokenizer: AutoTokenizer, handed the folder's config as models/config_json.py
reads it, so that it builds no transformers config of its own (a family's configuration module
imports transformers' image and video utilities: torchvision and torch._dynamo where installed).

Not avoided: in transformers 5.x AutoTokenizer's module imports the auto model classes and with them
`transformers.generation` (scikit-learn, scipy, torch._dynamo where installed), seconds of a start
(docs/PERFORMANCE.md, "GPU: LLM to ready"). Loading the class tokenizer_config.json names directly
would skip them, but AutoTokenizer's choice of class depends on tables in that same module and
changes between versions (model types whose hub class it overrides; a LlamaTokenizer entry that
it loads as TokenizersBackend), so the engine leaves the choice to it. tests/test_tokenizer.py
compares the result with AutoTokenizer's own for every family and every spelling of the class.
"""

from __future__ import annotations

import logging
from pathlib import Path

from models.config_json import ConfigFileError, HFConfig, read_config_json

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when it ships none (prompts must then be token ids).
    Looks for the files first: transformers may otherwise build an empty tokenizer from config.json."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        logger.info("no tokenizer files in %s; prompts must be token ids", path)
        return None
    try:
        config = _folder_config(folder)
        from transformers import AutoTokenizer
        if config is not None:
            try:
                return AutoTokenizer.from_pretrained(path, config=config)
            except (AttributeError, KeyError, OSError, TypeError, ValueError) as error:  # the plain call decides
                logger.debug("AutoTokenizer with the folder's config failed (%s); letting it read the config", error)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        logger.info("no tokenizer in %s (%s); prompts must be token ids", path, type(error).__name__)
        return None


def _folder_config(folder: Path) -> HFConfig | None:
    """The folder's config.json as models/config_json.py reads it (AutoTokenizer's `config=`: the
    model type and tokenizer class it picks the tokenizer class by), or None without a readable one."""
    if not (folder / "config.json").is_file():
        return None
    try:
        config = read_config_json(folder / "config.json")
    except ConfigFileError:
        return None
    config._name_or_path = str(folder)   # what AutoConfig records; AutoTokenizer matches hub ids on it
    return config
