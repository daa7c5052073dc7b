"""Where a benchmark writes its raw results: the folder given by `--out DIR`, never the source tree.

Without `--out` a benchmark only prints its figures. `bench-results/` at the repository root is
git-ignored for this use (`graphrunner bench decode --out bench-results/decode`).
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write the raw results (JSON, plots) into this folder (created if missing); "
                             "without it the figures are only printed")


def result_path(out: Path | None, filename: str) -> Path | None:
    """`out/filename` with `out` created, or None when no output folder was given."""
    if out is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    return out / filename


def write_json(out: Path | None, filename: str, data: Any) -> Path | None:
    """Write `data` as JSON to `out/filename`; returns the path, or None when `out` is None."""
    path = result_path(out, filename)
    if path is not None:
        path.write_text(json.dumps(data, indent=1) + "\n")
    return path


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's thread count set to `threads` (None: left as is) for the block, then restored: a
    benchmark run in-process (tests, the CLI) must not change the caller's numerics afterwards."""
    import torch
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
