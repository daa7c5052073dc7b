"""`graphrunner bench` from a plain `pip install .`: the benchmarks are an installed module, not scripts.

The package is installed into a temporary folder (no scripts/, tests/ or docs/ there) and run
from another temporary working directory, so nothing of the source tree can be imported by
accident: `graphrunner bench --help` lists every benchmark module, each module's `main` imports,
and one benchmark that runs on a CPU in a second writes its raw result under `--out`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IGNORED = shutil.ignore_patterns(".git", "__pycache__", "build", "dist", "*.egg-info", ".whl", "tests", "docs",
                                 "bench-results", ".hypothesis", ".pytest_cache")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """`pip install --no-deps .` of a copy of the tree into a fresh folder; env and cwd to run it from."""
    base = tmp_path_factory.mktemp("installed")
    source, target, cwd = base / "source", base / "site", base / "cwd"
    shutil.copytree(ROOT, source, ignore=IGNORED)
    cwd.mkdir()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-compile", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(target))
    return {"target": target, "cwd": cwd, "env": env}


def run_installed(installed: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=installed["cwd"], env=installed["env"],
                          capture_output=True, text=True, timeout=300)


def test_bench_help_lists_every_benchmark_module(installed):
    from runner.benchmarks import available
    names = available()
    assert {"cpu", "decode", "throughput", "attention", "capture", "addresses"} <= set(names)
    assert "model_shapes" not in names and "results" not in names   # helpers, no main
    done = run_installed(installed, "-m", "runner.cli", "bench", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    listed = {line.split()[0] for line in done.stdout.split("benchmarks (", 1)[1].splitlines()[1:] if line.strip()}
    assert listed == set(names)
    for name, summary in names.items():
        assert summary, f"runner/benchmarks/{name}.py has no docstring to list"


def test_benchmark_entry_points_import_from_the_installed_package(installed):
    from runner.benchmarks import available
    code = ("import importlib, json, runner\n"
            "from runner.benchmarks import available\n"
            "mains = {n: callable(importlib.import_module('runner.benchmarks.' + n).main) for n in available()}\n"
            "print(json.dumps({'runner': runner.__file__, 'mains': mains}))\n")
    done = run_installed(installed, "-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["runner"]).is_relative_to(installed["target"])
    assert result["mains"] == dict.fromkeys(available(), True)


def test_installed_console_script_runs_a_benchmark_into_out(installed, tmp_path):
    """The `graphrunner` console script pip wrote runs `bench addresses` (CPU, about a second) and
    the raw result lands in --out, not in the working directory."""
    script = installed["target"] / "bin" / "graphrunner"
    assert script.is_file()
    out = tmp_path / "results"
    done = run_installed(installed, str(script), "bench", "addresses", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "AddressRecorder.check" in done.stdout
    result = json.loads((out / "addresses.json").read_text())
    assert result["tensors"] == 80 and result["us_per_call"]["AddressRecorder.check"] > 0
    assert list(installed["cwd"].iterdir()) == []


def test_unknown_benchmark_names_the_available_ones(installed):
    done = run_installed(installed, "-m", "runner.cli", "bench", "no_such_bench")
    assert done.returncode != 0
    assert "no benchmark 'no_such_bench'" in done.stderr and "decode" in done.stderr
