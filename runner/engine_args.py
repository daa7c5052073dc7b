"""Command-line flags for every engine option, generated from EngineConfig's pydantic fields.

`add_engine_args(parser)` adds `--block-size`, `--max-num-seqs`, `--cudagraph-mode`, ... (one
per field of the sub-configs, plus --device and --seed), each with its type, choices and
description; `engine_kwargs(args)` returns the ones given, as `LLM(**kwargs)` /
`EngineConfig.from_kwargs` take them. Defaults stay in configs/: an option not given is not
passed, so a new config field is a new flag with no edit here."""

from __future__ import annotations

import argparse
import enum
import typing
from typing import Any

from configs import EngineConfig
from configs.engine_config import CacheConfig, CompilationConfig, ModelConfig, ParallelConfig, SchedulerConfig

_SUB_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, CompilationConfig, ParallelConfig)


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _flag_spec(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field's type (Optional unwrapped)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        annotation = args[0]
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return {"type": _bool, "nargs": "?", "const": True, "metavar": "BOOL"}
    if origin is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    if origin is list:
        (item,) = typing.get_args(annotation) or (str,)
        return {"type": item, "nargs": "+"}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"type": str, "metavar": "|".join(m.name for m in annotation)}
    if annotation in (int, float, str):
        return {"type": annotation}
    return {"type": str}


def _fields() -> dict[str, Any]:
    fields = {}
    for sub in _SUB_CONFIGS:
        for name, info in sub.model_fields.items():
            if name != "model":
                fields[name] = info
    for name in ("device", "seed"):
        fields[name] = EngineConfig.model_fields[name]
    return fields


SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp"}
"""vLLM's short forms of the parallel sizes."""


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine options (EngineConfig; defaults as in configs/)")
    for name, info in _fields().items():
        if name in skip:
            continue
        default = info.default if info.default_factory is None else info.default_factory()
        if isinstance(default, enum.Enum):
            default = default.name
        help_text = (info.description or "").replace("%", "%%")
        flags = ["--" + name.replace("_", "-")] + ([SHORT_FLAGS[name]] if name in SHORT_FLAGS else [])
        group.add_argument(*flags, dest=name, default=argparse.SUPPRESS,
                           help=f"{help_text} (default: {default})".strip(), **_flag_spec(info.annotation))


def engine_kwargs(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The engine options given on the command line, by field name (`skip`: as add_engine_args)."""
    return {name: getattr(args, name) for name in _fields() if name not in skip and hasattr(args, name)}
