"""The one place environment variables are read: each GRAPHRUNNER_* variable is the default of one config
field, read when that config is built (never at import, never again afterwards; the engine never writes
one). A value that does not parse fails with the variable's name and what it accepts.

`ENV_FIELDS` is the table (variable -> the field it sets), for the README and tests/test_config_env.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

ENV_FIELDS: dict[str, str] = {}
"""GRAPHRUNNER_* variable -> 'Config.field' whose default it is."""

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def parse_float(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def parse_path(name: str, raw: str) -> str:
    return str(Path(raw).expanduser())


_PARSERS: dict[type, Callable[[str, str], Any]] = {bool: parse_bool, int: parse_int, float: parse_float,
                                                   str: parse_path}


def env_default(name: str, field: str, default: Any, kind: type | None = None) -> Callable[[], Any]:
    """A `default_factory` for `field`: the parsed value of environment variable `name` when it is set
    (and not empty), else `default` (a callable default is called). `kind`: how to parse it (default:
    the type of `default`)."""
    if not name.startswith("GRAPHRUNNER_"):
        raise ValueError(f"{name}: graphrunner's variables start with GRAPHRUNNER_")
    ENV_FIELDS[name] = field
    parse = _PARSERS[kind or type(default)]

    def factory() -> Any:
        raw = os.environ.get(name, "")
        if raw.strip():
            return parse(name, raw)
        return default() if callable(default) else default

    factory.env_name = name
    return factory


def default_home() -> str:
    """Where graphrunner keeps generated files (the embedded checkpoint, native builds):
    $GRAPHRUNNER_HOME, else ~/.cache/graphrunner. For tools that build files without an EngineConfig."""
    return env_default("GRAPHRUNNER_HOME", "ModelConfig.download_dir", _cache_home, str)()


def _cache_home() -> str:
    return str(Path.home() / ".cache" / "graphrunner")
