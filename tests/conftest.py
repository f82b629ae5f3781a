"""Shared test fixtures and the `gpu` marker's skip rule."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import workspace


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked `gpu` when this machine has no CUDA device."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def fresh_workspace_global() -> Iterator[None]:
    """No process-wide workspace manager before the test, and none left behind after it."""
    workspace.reset_workspace_manager()
    yield
    workspace.reset_workspace_manager()
