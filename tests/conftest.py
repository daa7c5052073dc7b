"""Shared test set-up: the `cuda` marker skips without a GPU; small logging."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (bash scripts/gpu_suite.sh tests runs these on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
