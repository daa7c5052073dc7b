"""Build the embedded default checkpoint (SmolLM2-135M-Instruct) and print its folder.

Usage, from the repo root, installed or not:
    python scripts/prepare_smollm2.py [--force]

The engine calls the same `ensure_smollm2()` lazily; this script exists so CI and users can pay
the ~20 s one-time GGUF -> safetensors conversion up front.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from models.embedded import EmbeddedModelError, ensure_smollm2  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        path = ensure_smollm2(force=args.force)
    except EmbeddedModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
