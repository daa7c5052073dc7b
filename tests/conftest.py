"""Shared test set-up: the `cuda` marker skips without a GPU, `multigpu` with fewer than two; small logging."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.device_count() < 2:
        skip_multi = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs; torch sees {torch.cuda.device_count()}")
        for item in items:
            if "multigpu" in item.keywords:
                item.add_marker(skip_multi)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (bash scripts/gpu_suite.sh tests runs these on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_kernel_config():
    """Every test leaves the process-wide kernel config (configs/kernel_config.py) as it found it: an
    engine built in a test puts its own config in force."""
    from configs import kernel_config
    previous = kernel_config.active_kernel_config()
    yield
    kernel_config.set_active_kernel_config(previous)


@pytest.fixture
def kernel_switches():
    """`kernel_switches(pdl=False, ...)`: those KernelConfig fields in force for the rest of the test
    (the previous config comes back after it, `_restore_kernel_config`)."""
    from configs import kernel_config

    def switch(**changes):
        kernel_config.set_active_kernel_config(
            kernel_config.KernelConfig(**{**kernel_config.active_kernel_config().model_dump(), **changes}))

    return switch
