"""The benchmarks `graphrunner bench NAME ...` runs: one module per benchmark, each with
`main(argv: list[str]) -> int`.

A module of this package is a benchmark when it defines a top-level `main`; the others
(model_shapes, results) are helpers the benchmarks share. `available()` finds them by reading
the sources (no import: a benchmark may import torch, Triton or transformers), so a module added
here is offered by the CLI without registering it anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def available() -> dict[str, str]:
    """Benchmark name -> the first line of its docstring, for every module here that defines `main`."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            doc = ast.get_docstring(tree) or ""
            found[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found
