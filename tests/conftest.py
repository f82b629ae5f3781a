"""Shared test fixtures and the `gpu` marker's skip rule."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

import comm
import dbo.runtime.exit
import workspace
from comm.distributed import TORCHRUN_ENV_VARS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked `gpu` when this machine has no CUDA device."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def nothing_left_running() -> Iterator[None]:
    """Every test ends with no ubatch or collective of an aborted run still running: the
    exit wait would otherwise end the pytest process with status 1, blaming no test."""
    yield
    deadline = time.monotonic() + 10.0
    while any(still_running(0) for still_running in dbo.runtime.exit._left_running):
        if time.monotonic() > deadline:
            pytest.fail("an aborted run's ubatch or collective still runs 10 s after the test")
        time.sleep(0.01)


@pytest.fixture
def fresh_workspace_global() -> Iterator[None]:
    """No process-wide workspace manager before the test, and none left behind after it."""
    workspace.reset_workspace_manager()
    yield
    workspace.reset_workspace_manager()


@pytest.fixture
def cpu_machine_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """`comm.init_distributed`'s defaults of a CPU machine (gloo, CPU) for one test: the
    CPU tiers pass CPU tensors, and on a machine with a GPU the defaults would be NCCL
    on cuda:LOCAL_RANK, which refuses them. (The `gpu` tests use CUDA.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch, cpu_machine_defaults: None) -> Iterator[None]:
    """A torch.distributed world of one rank (no torchrun environment, gloo on CPU even
    on a machine with a GPU), torn down after."""
    for name in TORCHRUN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    comm.destroy_distributed()
    comm.init_distributed(allow_single_process=True)
    yield
    comm.destroy_distributed()
