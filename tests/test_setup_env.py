"""scripts/python_env.sh: which Python set-up installs into (active venv, the project's .venv, or
the base interpreter with one line saying so), without installing anything.

The fallbacks need an interpreter that cannot make a venv and whose stdlib carries PEP 668's
EXTERNALLY-MANAGED marker (how pip decides it must refuse installs outside a venv): a small
shell script plays that interpreter. The main path runs the real `python -m venv`.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "python_env.sh"


def _select(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON", "GRAPHRUNNER_VENV")}
    return subprocess.run(["bash", str(SCRIPT)], env={**clean, **env}, capture_output=True, text=True, timeout=300)


def _fake_python(folder: Path, externally_managed: bool) -> Path:
    """An interpreter whose `-m venv` fails (no ensurepip, no venv) and whose stdlib folder is
    `folder/stdlib`, with or without the EXTERNALLY-MANAGED marker."""
    stdlib = folder / "stdlib"
    stdlib.mkdir(parents=True)
    if externally_managed:
        (stdlib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=use apt\n")
    python = folder / "python3"
    python.write_text(f"""#!/usr/bin/env bash
if [[ "$1 $2" == "-m venv" ]]; then echo "ensurepip is not available" >&2; exit 1; fi
if [[ "$1" == "-c" && "$2" == *sysconfig* ]]; then echo "{stdlib}"; exit 0; fi
exit 3
""")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python


def test_an_active_virtual_environment_is_used(tmp_path):
    active = tmp_path / "active"
    (active / "bin").mkdir(parents=True)
    (active / "bin" / "python").symlink_to(sys.executable)
    result = _select({"VIRTUAL_ENV": str(active), "GRAPHRUNNER_VENV": str(tmp_path / "project-venv")})
    assert result.returncode == 0 and result.stdout.strip() == str(active / "bin" / "python")
    assert not (tmp_path / "project-venv").exists()


@pytest.mark.parametrize("externally_managed", [True, False], ids=["externally-managed", "plain"])
def test_without_venv_the_base_interpreter_is_used_with_one_line(tmp_path, externally_managed):
    python = _fake_python(tmp_path / "fake", externally_managed)
    venv = tmp_path / "project-venv"
    result = _select({"PYTHON": str(python), "GRAPHRUNNER_VENV": str(venv)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(python)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot create {venv}" in lines[0] and "python3-venv" in lines[0]
    assert ("externally managed, PEP 668" in lines[0]) is externally_managed
    assert not venv.exists()  # no half-made venv left behind


def test_outside_a_venv_the_project_venv_is_made_with_the_system_site_packages(tmp_path):
    venv = tmp_path / ".venv"
    result = _select({"PYTHON": sys.executable, "GRAPHRUNNER_VENV": str(venv)})
    assert result.returncode == 0, result.stderr
    python = venv / "bin" / "python"
    assert result.stdout.strip() == str(python)
    assert f"created {venv}" in result.stderr
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    # the base interpreter's packages are reused (a preinstalled torch): its site-packages folder is on
    # the new venv's path, whatever it holds; installs go into the venv
    probe = subprocess.run([str(python), "-c", "import json, sys; print(json.dumps([sys.prefix, sys.path]))"],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    prefix, path = json.loads(probe.stdout)
    base_site = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"]
    assert Path(prefix) == venv and base_site in path
    again = _select({"PYTHON": sys.executable, "GRAPHRUNNER_VENV": str(venv)})
    assert again.stdout.strip() == str(python) and again.stderr == ""  # reused, silently


def test_a_folder_that_is_not_a_venv_is_left_alone(tmp_path):
    taken = tmp_path / "not-a-venv"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    result = _select({"PYTHON": sys.executable, "GRAPHRUNNER_VENV": str(taken)})
    assert result.stdout.strip() == sys.executable and "is not a virtual environment" in result.stderr
    assert (taken / "keep.txt").read_text() == "mine"


def test_the_project_venv_is_git_ignored():
    ignored = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    assert ".venv/" in ignored
