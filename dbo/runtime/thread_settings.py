"""The caller's thread-local torch settings, replayed in the ubatch worker threads.

Replayed: the intra-op thread count, the current CUDA device, inference and grad mode, the
cpu and cuda autocasts, the default device, the innermost saved-tensor hooks (checkpointing
or `save_on_cpu` around the call keep their memory saving) or their being disabled; each
job also runs in a copy of the caller's context variables (`worker.UBatchJob`: dynamo's
configuration lives in one from torch 2.12), so what `fn` sets there stays in its job. Under
any other torch-function or dispatch mode, or a `torch.func` transform, `dbo.overlap` runs
inline: a mode entered from several threads breaks modes that keep per-entry state.
Workers serve unrelated calls: what `fn` leaves switched on is switched off after its job.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from functools import partial
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import disable_saved_tensors_hooks, saved_tensors_hooks

from dbo._torch_private import private  # torch has no public reader of the hooks and modes

_AUTOCAST_TYPES = ("cpu", "cuda")
_applied = threading.local()  # .num_threads: what this worker set; torch may report the
# caller's count in a thread whose OpenMP pool was never sized


class ThreadSettings(NamedTuple):
    """The caller's settings, captured once per overlap call: what a worker always sets,
    and the contexts it enters for what differs from a new thread's defaults."""

    num_threads: int
    cuda_device: int | None
    inference_mode: bool
    contexts: tuple[Callable[[], AbstractContextManager[Any]], ...]


def capture() -> ThreadSettings:
    """The calling thread's settings."""
    cuda_initialized = torch.cuda.is_initialized()  # a flag read; implies available
    inference = torch.is_inference_mode_enabled()
    contexts: list[Callable[[], AbstractContextManager[Any]]] = []
    if not torch.is_grad_enabled():
        contexts.append(partial(torch.set_grad_enabled, False))
    for kind in _AUTOCAST_TYPES if cuda_initialized else _AUTOCAST_TYPES[:1]:
        if torch.is_autocast_enabled(kind):  # cuda's only where CUDA runs: autocast refuses it
            dtype, cache = torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled()
            contexts.append(partial(torch.autocast, kind, dtype=dtype, cache_enabled=cache))
    # A default device is a torch-function mode: with none on, there is no device to read.
    if private.function_mode_depth() > 0 and (device := torch.get_default_device()).type != "cpu":
        contexts.append(lambda: device)  # a torch.device is a context manager
    if (hooks := private.top_saved_tensors_hooks(True)) is not None:
        contexts.append(partial(saved_tensors_hooks, *hooks))
    if (message := private.saved_tensors_hooks_disabled_message()) is not None:
        contexts.append(partial(disable_saved_tensors_hooks, message))
    return ThreadSettings(
        torch.get_num_threads(), torch.cuda.current_device() if cuda_initialized else None,
        inference, tuple(contexts),
    )


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are on in this thread (checkpointing, `save_on_cpu`)."""
    return private.top_saved_tensors_hooks(True) is not None


def unreplayed_mode_active() -> bool:
    """Whether a dispatch mode or a torch-function mode other than the default device's
    is on in this thread: `dbo.overlap` then runs inline."""
    if private.dispatch_mode_depth() > 0:
        return True
    if private.function_mode_depth() == 0:
        return False
    return not all(isinstance(mode, private.DeviceContext) for mode in private.function_modes())


class applied:  # noqa: N801 - a class, not a generator: every ubatch of every call enters it
    """`with applied(settings):` runs a job with `settings` in this worker thread, then
    puts the thread back at torch's defaults, whatever `fn` left switched on."""

    __slots__ = ("_settings", "_stack")

    def __init__(self, settings: ThreadSettings) -> None:
        self._settings = settings
        self._stack: ExitStack | None = None

    def __enter__(self) -> None:
        settings = self._settings
        if getattr(_applied, "num_threads", None) != settings.num_threads:
            torch.set_num_threads(settings.num_threads)
            _applied.num_threads = settings.num_threads
        if settings.cuda_device is not None:
            torch.cuda.set_device(settings.cuda_device)
        # A guard `fn` kept alive leaves inference mode on: inference_mode(False) wins.
        inference = settings.inference_mode or torch.is_inference_mode_enabled()
        if not (inference or settings.contexts):
            return  # the usual case: the thread's defaults are the caller's settings
        with ExitStack() as stack:  # unwinds what was entered if an enter fails
            if inference:
                stack.enter_context(torch.inference_mode(settings.inference_mode))
            for context in settings.contexts:
                stack.enter_context(context())
            self._stack = stack.pop_all()

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._stack is not None:
                self._stack.close()
        finally:
            if torch.get_num_threads() != getattr(_applied, "num_threads", None):
                _applied.num_threads = None  # `fn` changed it: the next job sets it again
            torch.set_grad_enabled(True)
            for kind in _AUTOCAST_TYPES:
                torch.set_autocast_enabled(kind, False)
            while private.top_saved_tensors_hooks(True) is not None:
                private.pop_saved_tensors_hooks()
            if private.saved_tensors_hooks_disabled_message() is not None:
                private.enable_saved_tensors_hooks()
            if getattr(private.default_device_context, "device_context", None) is not None:
                torch.set_default_device(None)
            while private.function_mode_depth() > 0:  # entered by `fn`, never exited
                private.pop_function_mode()
            while private.dispatch_mode_depth() > 0:
                private.pop_dispatch_mode(None)
