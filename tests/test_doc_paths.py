"""Every path that docs/ARCHITECTURE.md and README.md name exists in the tree.

A path is a token starting with one of the repository's top-level folders (`runner/engine.py`,
`attention/kernels/`, `scripts/gpu_suite.sh`, `docs/plots/decode_h100.png`); the docs describe
the code as it is, so a file moved or deleted without its description fails here by name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["docs/ARCHITECTURE.md", "README.md"]
TOP_LEVEL = ("configs", "models", "attention", "runner", "launch", "scripts", "tests", "docs")
PATH = re.compile(r"(?<![\w./~$-])((?:%s)/[\w./-]*)" % "|".join(TOP_LEVEL))


def named_paths(text: str) -> set[str]:
    """Paths in `text`, without the punctuation that may close a sentence or a parenthesis."""
    return {match.rstrip(".,;:") for match in PATH.findall(text)}


def test_path_extraction():
    text = ("See runner/engine.py, `attention/kernels/` and (launch/pdl.py). Not ../shared/DESIGN.md, "
            "~/.cache/graphrunner/native, $GRAPHRUNNER_CACHE_DIR/native or myrunner/x.py.")
    assert named_paths(text) == {"runner/engine.py", "attention/kernels/", "launch/pdl.py"}


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_exists(doc):
    paths = named_paths((ROOT / doc).read_text(encoding="utf-8"))
    assert paths, f"{doc} names no paths: the extraction is broken"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"
