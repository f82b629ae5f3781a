"""The caller's thread-local torch settings, replayed in the ubatch worker threads.

Replayed: the intra-op thread count, grad and inference mode, the cpu and cuda autocasts,
the default device, the current CUDA device, the innermost saved-tensor hooks (so that
checkpointing or `save_on_cpu` around the call keep their memory saving in the ubatches)
or their being disabled. CPU affinity is set once per worker (`dbo._affinity`). Under any
other torch-function or dispatch mode, or a `torch.func` transform, `dbo.overlap` runs
inline: a mode entered from several threads breaks modes that keep per-entry state.
Workers serve unrelated calls: what `fn` leaves switched on is switched off after its job.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Any, NamedTuple

import torch

_AUTOCAST_TYPES = ("cpu", "cuda")
_CPU = torch.device("cpu")
# torch has no public reader of the current saved-tensor hooks; these are autograd's own.
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_hooks_disabled = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
_function_mode_depth = torch._C._len_torch_function_stack
_dispatch_mode_depth = torch._C._len_torch_dispatch_stack
_applied = threading.local()  # .num_threads: what this worker set; torch may report the
# caller's count in a thread whose OpenMP pool was never sized


class ThreadSettings(NamedTuple):
    """The caller's settings, captured once per overlap call."""

    num_threads: int
    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype, bool], ...]
    """(device_type, dtype, cache_enabled) of each enabled autocast."""
    default_device: torch.device
    cuda_device: int | None
    saved_tensors_hooks: tuple[Any, Any] | None
    hooks_disabled: str | None
    """The message of `disable_saved_tensors_hooks`, if the caller disabled them."""


def capture() -> ThreadSettings:
    """The calling thread's settings."""
    cuda_initialized = torch.cuda.is_initialized()  # a flag read; implies available
    return ThreadSettings(
        torch.get_num_threads(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        tuple(  # cuda's only where CUDA runs: torch.autocast refuses it elsewhere
            (kind, torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
            for kind in (_AUTOCAST_TYPES if cuda_initialized else _AUTOCAST_TYPES[:1])
            if torch.is_autocast_enabled(kind)
        ),
        default_device(),
        torch.cuda.current_device() if cuda_initialized else None,
        _top_hooks(True),
        _hooks_disabled(),
    )


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are on in this thread (checkpointing, `save_on_cpu`)."""
    return _top_hooks(True) is not None


def default_device() -> torch.device:
    """`torch.get_default_device()`, without its ~2 us when no torch-function mode is on
    (a default device is one: `DeviceContext`)."""
    return _CPU if _function_mode_depth() == 0 else torch.get_default_device()


def unreplayed_mode_active() -> bool:
    """Whether a dispatch mode or a torch-function mode other than the default device's
    is on in this thread: `dbo.overlap` then runs inline."""
    if _dispatch_mode_depth() > 0:
        return True
    if _function_mode_depth() == 0:
        return False
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return not all(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


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
        # A guard `fn` keeps alive leaves inference mode on: inference_mode(False) wins.
        inference = settings.inference_mode or torch.is_inference_mode_enabled()
        if (
            settings.grad_enabled and not inference and not settings.autocast
            and settings.default_device == _CPU and settings.saved_tensors_hooks is None
            and settings.hooks_disabled is None
        ):
            return  # the usual case: the thread's defaults are the caller's settings
        with ExitStack() as stack:  # unwinds what was entered if an enter fails
            if inference:
                stack.enter_context(torch.inference_mode(settings.inference_mode))
            stack.enter_context(torch.set_grad_enabled(settings.grad_enabled))
            for kind, dtype, cache in settings.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
            if settings.default_device != _CPU:
                stack.enter_context(settings.default_device)
            if settings.saved_tensors_hooks is not None:
                pack, unpack = settings.saved_tensors_hooks
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            if settings.hooks_disabled is not None:
                message = settings.hooks_disabled
                stack.enter_context(torch.autograd.graph.disable_saved_tensors_hooks(message))
            self._stack = stack.pop_all()

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._stack is not None:
                self._stack.close()
                self._stack = None
        finally:
            if torch.get_num_threads() != getattr(_applied, "num_threads", None):
                _applied.num_threads = None  # `fn` changed it: the next job sets it again
            torch.set_grad_enabled(True)
            for kind in _AUTOCAST_TYPES:
                torch.set_autocast_enabled(kind, False)
            while _top_hooks(True) is not None:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            if _hooks_disabled() is not None:
                torch._C._autograd._saved_tensors_hooks_enable()
            if getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None) is not None:
                torch.set_default_device(None)
            while _function_mode_depth() > 0:  # entered by `fn`, never exited
                torch._C._pop_torch_function_stack()
            while _dispatch_mode_depth() > 0:
                torch._C._pop_torch_dispatch_stack(None)
