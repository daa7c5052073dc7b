"""Where compiled kernels are kept: every cache under one folder, KernelConfig.cache_dir.

    <cache_dir>/native   C libraries built by launch/native_build.py (CPU kernels, the step graph's driver calls)
    <cache_dir>/triton   Triton's compiled kernels (what compile-ahead fills at start-up), its driver stubs,
                         and Triton's own cache key by the installed Triton's fingerprint (triton-key.json)

cache_dir defaults to $GRAPHRUNNER_HOME (else ~/.cache/graphrunner), where the embedded checkpoint is
built too, so one variable moves, or empties, everything graphrunner writes; GRAPHRUNNER_CACHE_DIR
moves the caches alone.

Two processes may fill one folder at once (two engines starting on one machine, a test suite run in
parallel): every file appears whole or not at all. A native build compiles in a private temporary
folder and renames the finished library into place (`compile_shared`; os.replace is atomic, and a
process that already loaded the other copy keeps its mapping); Triton's FileCacheManager writes each
file the same way. tests/test_kernel_cache.py starts two processes on one empty folder at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_triton_key_thread: threading.Thread | None = None


def triton_dir(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "triton"


def use_triton_cache(cache_dir: str | Path) -> Path | None:
    """Point Triton's kernel cache of this process at <cache_dir>/triton (through triton.knobs, which
    takes precedence over Triton's own TRITON_CACHE_DIR); None where Triton is not installed or has
    no knobs (then its default, ~/.triton/cache, stays)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    path = triton_dir(cache_dir)
    if knobs.cache.dir != str(path):
        knobs.cache.dir = str(path)
        logger.info("Triton's kernel cache: %s", path)
    return path


TRITON_KEY_FILE = "triton-key.json"
"""In <cache_dir>/triton: Triton's own cache key, by the fingerprint of the installed Triton."""


def triton_fingerprint(root: str | None = None, version: str | None = None) -> str | None:
    """The installed Triton's version and the path, size and modification time of every file of its
    package (`root`, `version`: another folder's, for tests): what changes when any file
    `triton.runtime.cache.triton_key()` hashes changes (its sources, libtriton), read in
    milliseconds (about 750 files) where that key reads and hashes hundreds of MB (0.6 s). None
    without Triton."""
    if root is None:
        try:
            import triton
        except ImportError:
            return None
        root, version = os.path.dirname(triton.__file__), triton.__version__
    digest = hashlib.sha256(f"{version}\0{root}".encode())
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()
        for name in sorted(files):
            stat = os.stat(os.path.join(folder, name))
            digest.update(f"{folder}/{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def recalled_triton_key(cache_dir: str | Path, fingerprint: str) -> str | None:
    """Triton's key that an earlier process computed for this fingerprint (`remember_triton_key`)."""
    try:
        recorded = json.loads((triton_dir(cache_dir) / TRITON_KEY_FILE).read_text())
    except (OSError, ValueError):
        return None
    key = recorded.get("key") if isinstance(recorded, dict) and recorded.get("fingerprint") == fingerprint else None
    return key if isinstance(key, str) else None


def remember_triton_key(cache_dir: str | Path, fingerprint: str, key: str) -> None:
    """Write the key for `recalled_triton_key`: whole or not at all (a private file renamed into
    place), so two processes starting at once both leave a readable record."""
    folder = triton_dir(cache_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        private = folder / f".{TRITON_KEY_FILE}.{os.getpid()}.{threading.get_ident()}"
        private.write_text(json.dumps({"fingerprint": fingerprint, "key": key}))
        os.replace(private, folder / TRITON_KEY_FILE)
    except OSError as error:   # a read-only cache folder: the next process hashes Triton again
        logger.debug("could not record Triton's key: %s", error)


def install_triton_key(key: str) -> None:
    """Make `triton_key()` return `key` in this process, as Triton's own compile workers do
    (`triton.runtime.cache.triton_key = lambda: key`), in every loaded Triton module that holds the
    function (a module that imported it by name keeps its own reference)."""
    import triton.runtime.cache as cache
    original = cache.triton_key

    def recalled() -> str:
        return key

    for name, module in list(sys.modules.items()):
        if (name == "triton" or name.startswith("triton.")) and getattr(module, "triton_key", None) is original:
            module.triton_key = recalled


def hash_triton_ahead(cache_dir: str | Path | None = None) -> None:
    """Start Triton's two first-kernel costs on a daemon thread (once per process): its own cache
    key, `triton.runtime.cache.triton_key()` (a hash of its sources and of libtriton, hundreds of
    MB: 0.6 s), and its GPU driver object, whose creation builds Triton's C helper module with the
    host's C compiler when the cache folder is empty (about half a second: docs/PERFORMANCE.md, "GPU:
    LLM to ready"). Triton meets both at the first kernel it launches or looks up, which in a
    start-up is inside the profile run, on the main thread; begun here, when the engine is set up,
    they overlap the set-up and the weight load (file reads, hashing and the compiler release the
    GIL). With `cache_dir` the key is also kept there for the installed Triton's fingerprint
    (`triton_fingerprint`), so a later process reads it instead of hashing: a warm Qwen3-0.6B-shape
    start-up (weights loaded in 0.1 s) then took 3.37-3.55 s against 3.44-3.68 s and 3.5-4.0 s of
    CPU against 4.3-4.7 s (`LLM(...)` alone, three alternating rounds, H100).
    `wait_triton_key` joins the thread before the first lookup; both are memoised by Triton, so a
    failure here only means the first kernel pays for them as before."""
    global _triton_key_thread
    if _triton_key_thread is not None:
        return
    try:
        from triton.runtime import driver
        from triton.runtime import cache as triton_cache
    except ImportError:
        return

    def compute() -> None:
        try:
            fingerprint = triton_fingerprint() if cache_dir is not None else None
            key = recalled_triton_key(cache_dir, fingerprint) if fingerprint is not None else None
            if key is not None:
                install_triton_key(key)
            else:
                key = triton_cache.triton_key()
                if fingerprint is not None:
                    remember_triton_key(cache_dir, fingerprint, key)
            driver.active   # noqa: B018 - the property creates (and keeps) the driver
        except Exception as error:  # noqa: BLE001 - the first kernel computes them and reports
            logger.debug("preparing Triton ahead failed: %s", error)

    _triton_key_thread = threading.Thread(target=compute, name="triton-key", daemon=True)
    _triton_key_thread.start()


def wait_triton_key() -> None:
    """Wait for `hash_triton_ahead`'s thread, if one runs (rather than hash Triton, or build its
    driver, a second time)."""
    if _triton_key_thread is not None:
        _triton_key_thread.join()
