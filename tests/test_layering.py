"""Imports go one way: runner -> models -> attention -> launch -> configs.

Every module of the product's packages is parsed (ast, so imports inside functions count too, and
nothing is executed); an import of a package above the importer's own fails the test, naming the
module, the line and the import. Third-party and standard-library imports are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["configs", "launch", "attention", "models", "runner"]
"""Lowest first: a package may import itself and the packages before it, never those after it."""
RANK = {name: rank for rank, name in enumerate(LAYERS)}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative imports resolved."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
    return found


def upward_imports(root: Path = ROOT) -> list[str]:
    """'module:line imports name (layer above its own)' for each upward import under `root`."""
    problems = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            module = _module_name(path, root)
            for line, name in imported_modules(path, root):
                top = name.split(".")[0]
                if top in RANK and RANK[top] > RANK[layer]:
                    problems.append(f"{module}:{line} imports {name} ({top} is above {layer})")
    return problems


def test_every_package_exists_and_has_modules():
    for layer in LAYERS:
        assert list((ROOT / layer).rglob("*.py")), f"no modules under {layer}/"


def test_no_module_imports_a_package_above_its_own():
    problems = upward_imports()
    assert not problems, "imports that run up the layers (runner -> models -> attention -> launch -> configs):\n" \
        + "\n".join(problems)


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The checker itself: an upward import hidden in a function, and a relative one, are both reported."""
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text("")
    (tmp_path / "attention" / "bad.py").write_text("import torch\n\n\ndef f():\n    from runner.engine import LLMEngine\n")
    (tmp_path / "configs" / "worse.py").write_text("from configs import graph_mode\nimport models.layers\n")
    (tmp_path / "launch" / "fine.py").write_text("from . import other\nfrom configs import EngineConfig\n")
    (tmp_path / "models" / "sub").mkdir()
    (tmp_path / "models" / "sub" / "rel.py").write_text("from ...runner import x\nfrom .. import layers\n")
    assert upward_imports(tmp_path) == [
        "configs.worse:2 imports models.layers (models is above configs)",
        "attention.bad:5 imports runner.engine (runner is above attention)",
        "models.sub.rel:1 imports runner (runner is above models)",
    ]
