"""Build the embedded default checkpoint (SmolLM2-135M-Instruct) and print its folder.

Usage, from the repo root, installed or not:
    python scripts/prepare_smollm2.py [--force | --verify]

The same as `python -m models.embedded` (the command errors about the folder name). The
engine calls the same `ensure_smollm2()` lazily; this script exists so CI and users can pay
the ~20 s one-time GGUF -> safetensors conversion up front.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from models.embedded import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
