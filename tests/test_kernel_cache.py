"""Every kernel cache lives under KernelConfig.cache_dir, and two processes filling it at once both
succeed and both get whole files: the same native library built by two processes together, and the
same Triton cache entry written by two processes together."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs import EngineConfig, KernelConfig
from launch.kernel_cache import triton_dir, use_triton_cache
from launch.native_build import compiler

REPO = Path(__file__).resolve().parents[1]

NATIVE_CHILD = r"""
import ctypes, sys, time
from pathlib import Path
from launch.native_build import compile_shared, compiler
out_dir, start_at = Path(sys.argv[1]), float(sys.argv[2])
source = "int gr_answer(int x) { return 6 * x; }\n"
while time.time() < start_at:   # both processes start the build at the same moment
    time.sleep(0.001)
path = compile_shared("concurrent_probe", source, compiler(), ["-O2"], out_dir=out_dir)
lib = ctypes.CDLL(str(path))
lib.gr_answer.argtypes, lib.gr_answer.restype = [ctypes.c_int], ctypes.c_int
print("ANSWER", lib.gr_answer(7), path.name)
"""

TRITON_CHILD = r"""
import sys, time
from launch.kernel_cache import use_triton_cache
cache_dir, start_at, payload = sys.argv[1], float(sys.argv[2]), sys.argv[3]
use_triton_cache(cache_dir)
from triton.runtime.cache import get_cache_manager
manager = get_cache_manager("ab" * 32)
data = (payload * 4096).encode()
while time.time() < start_at:
    time.sleep(0.001)
for _ in range(50):
    manager.put(data, "kernel.bin")
    got = open(manager.get_file("kernel.bin"), "rb").read()
    assert len(got) == len(data) and got in (b"A" * 4096, b"B" * 4096), len(got)
print("OK", manager.cache_dir)
"""


def _run_together(script: str, argv_each: list[list[str]]) -> list[str]:
    start_at = f"{time.time() + 3.0:.3f}"   # time for both interpreters to import before the common start
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    children = [subprocess.Popen([sys.executable, "-c", script, argv[0], start_at, *argv[1:]], cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in argv_each]
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        outputs.append(out)
    return outputs


@pytest.mark.skipif(compiler() is None, reason="needs a C compiler")
def test_two_processes_building_one_native_library_both_get_it_whole(tmp_path):
    out_dir = tmp_path / "native"
    outputs = _run_together(NATIVE_CHILD, [[str(out_dir)], [str(out_dir)]])
    answers = [line.split() for out in outputs for line in out.splitlines() if line.startswith("ANSWER")]
    assert [a[1] for a in answers] == ["42", "42"]
    assert answers[0][2] == answers[1][2]                    # one library, found by the same hash
    assert [p.name for p in out_dir.iterdir()] == [answers[0][2]]   # no temporary folder left behind


def test_two_processes_writing_one_triton_cache_entry_both_read_it_whole(tmp_path):
    pytest.importorskip("triton")
    outputs = _run_together(TRITON_CHILD, [[str(tmp_path), "A"], [str(tmp_path), "B"]])
    assert all(out.startswith("OK ") for out in outputs)
    assert all(str(triton_dir(tmp_path)) in out for out in outputs)
    leftovers = [p for p in triton_dir(tmp_path).rglob("tmp.*")]
    assert not leftovers


@pytest.mark.skipif("GRAPHRUNNER_CACHE_DIR" in os.environ, reason="the caches were moved on their own")
def test_every_cache_defaults_to_one_folder_the_user_sets(tmp_path):
    """cache_dir (native builds, Triton) is GRAPHRUNNER_HOME's folder unless GRAPHRUNNER_CACHE_DIR moves it alone."""
    config = EngineConfig.from_kwargs(model="m")
    assert config.kernel.cache_dir == config.model.download_dir
    assert KernelConfig(cache_dir=str(tmp_path / "c")).cache_dir == str(tmp_path / "c")


def test_triton_compiles_into_the_cache_dir(tmp_path):
    knobs = pytest.importorskip("triton").knobs
    previous = knobs.cache.dir
    try:
        assert use_triton_cache(tmp_path) == tmp_path / "triton"
        assert knobs.cache.dir == str(tmp_path / "triton")
    finally:
        knobs.cache.dir = previous


def test_triton_is_hashed_and_its_driver_made_once_on_a_thread_and_waited_for(monkeypatch):
    """`hash_triton_ahead` computes Triton's own cache key and creates its GPU driver off the main
    thread, once per process; `wait_triton_key` joins it, and does nothing when none was started."""
    import threading
    import triton.runtime.cache
    from triton.runtime import driver
    from launch import kernel_cache
    calls = []
    monkeypatch.setattr(kernel_cache, "_triton_key_thread", None)
    kernel_cache.wait_triton_key()   # none started: returns
    def record(what):
        return lambda *args: calls.append((what, threading.current_thread().name))
    monkeypatch.setattr(triton.runtime.cache, "triton_key", record("key"))
    monkeypatch.setattr(type(driver), "active", property(record("driver")))
    kernel_cache.hash_triton_ahead()
    kernel_cache.hash_triton_ahead()
    kernel_cache.wait_triton_key()
    assert calls == [("key", "triton-key"), ("driver", "triton-key")]


def test_triton_key_is_kept_by_fingerprint_and_read_back_by_the_next_process(monkeypatch, tmp_path):
    """With a cache folder the first start-up hashes Triton and keeps the key under the installed
    Triton's fingerprint; the next reads it back and installs it (no hash), so `triton_key()`
    returns it; another fingerprint (Triton changed) hashes again."""
    import triton.runtime.cache
    from triton.runtime import driver
    from launch import kernel_cache
    hashed = []

    def start(key):   # one process's start-up: a fresh thread and a fresh Triton
        monkeypatch.setattr(kernel_cache, "_triton_key_thread", None)
        monkeypatch.setattr(triton.runtime.cache, "triton_key", lambda: hashed.append(key) or key)
        kernel_cache.hash_triton_ahead(tmp_path)
        kernel_cache.wait_triton_key()
        hashes = list(hashed)
        return triton.runtime.cache.triton_key(), hashes

    monkeypatch.setattr(type(driver), "active", property(lambda self: None))
    monkeypatch.setattr(kernel_cache, "triton_fingerprint", lambda: "fingerprint-1")
    assert start("key-1") == ("key-1", ["key-1"])
    assert (tmp_path / "triton" / kernel_cache.TRITON_KEY_FILE).exists()
    hashed.clear()
    assert start("key-2") == ("key-1", [])                            # read back, not hashed
    monkeypatch.setattr(kernel_cache, "triton_fingerprint", lambda: "fingerprint-2")
    hashed.clear()
    assert start("key-3") == ("key-3", ["key-3"])                     # Triton changed: hashed again
    assert kernel_cache.recalled_triton_key(tmp_path, "fingerprint-2") == "key-3"
    assert kernel_cache.recalled_triton_key(tmp_path, "fingerprint-1") is None
    assert not [p for p in (tmp_path / "triton").iterdir() if p.name.startswith(".")]   # no private file left


def test_the_fingerprint_follows_every_file_of_the_package(tmp_path):
    package = tmp_path / "triton"
    (package / "_C").mkdir(parents=True)
    (package / "language.py").write_text("x = 1\n")
    (package / "_C" / "libtriton.so").write_bytes(b"\0" * 64)
    first = kernel_cache_fingerprint(package)
    assert kernel_cache_fingerprint(package) == first
    assert kernel_cache_fingerprint(package, version="3.7.0") != first
    (package / "language.py").write_text("x = 22\n")                  # another size
    second = kernel_cache_fingerprint(package)
    assert second != first
    os.utime(package / "_C" / "libtriton.so", ns=(1, 1))              # another modification time
    assert kernel_cache_fingerprint(package) != second


def kernel_cache_fingerprint(package, version="3.6.0"):
    from launch.kernel_cache import triton_fingerprint
    return triton_fingerprint(str(package), version)
