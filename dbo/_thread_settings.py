"""The caller's thread-local torch settings, replayed in the ubatch worker threads.

Replayed (all per thread in PyTorch): the intra-op thread count, grad mode, inference
mode, enabled autocasts (cpu, cuda, xpu, mps, hpu, the privateuse1 backend), the default
device (`with torch.device(...)`, `torch.set_default_device`), the current CUDA device
and the innermost saved-tensor hooks (`save_on_cpu`, non-reentrant checkpointing), or
their being disabled. CPU affinity is per thread too, but is set once per worker
(`dbo._affinity`).

Not replayed: other torch-function and dispatch modes (FakeTensorMode, a FLOP counter,
`allow_mutation_on_saved_tensors`) and `torch.func` transforms: entering one mode object
from several threads breaks modes that keep per-entry state, so `dbo.overlap` runs
inline under them (`unreplayed_mode_active`). Nor an autocast dtype set while autocast
is off. The profiler records the caller's thread only, unless started with
`experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`.
What `fn` leaves switched on in a worker (autocast, saved-tensor hooks, modes) is
switched off when its job ends: workers are pooled across unrelated calls.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from threading import local
from typing import Any, NamedTuple

import torch


class _AutocastQuery(NamedTuple):
    device_types: tuple[str, ...]
    """The device types whose autocast is replayed (those this torch knows)."""
    any_enabled: Callable[[], bool] | None
    """`torch._C._is_any_autocast_enabled`, and the device types it misses (asked one
    by one); None: ask every type."""
    missed: tuple[str, ...]


_autocast_query: _AutocastQuery | None = None


def _known(device_type: str) -> bool:
    try:
        torch.is_autocast_enabled(device_type)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def _autocast() -> _AutocastQuery:
    """Which autocasts to look at, and how; probed on first use, in the calling thread,
    by turning each type's autocast on and off again. The probe cannot learn anything
    while an autocast is on: then every type is asked, and it runs again next time."""
    global _autocast_query
    if _autocast_query is not None:
        return _autocast_query
    wanted = ("cpu", "cuda", "xpu", "mps", "hpu", torch._C._get_privateuse1_backend_name())
    types = tuple(kind for kind in dict.fromkeys(wanted) if _known(kind))
    any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)
    if any_enabled is None or any_enabled():
        query = _AutocastQuery(types, None, types)
        if any_enabled is None:
            _autocast_query = query
        return query
    missed = []
    for device_type in types:
        before = torch.is_autocast_enabled(device_type)  # on, if the query misses it
        torch.set_autocast_enabled(device_type, True)
        try:
            if not any_enabled():
                missed.append(device_type)
        finally:
            torch.set_autocast_enabled(device_type, before)
    _autocast_query = _AutocastQuery(types, any_enabled, tuple(missed))
    return _autocast_query


def _enabled_autocasts() -> tuple[tuple[str, torch.dtype], ...]:
    """(device_type, dtype) of each autocast enabled in the calling thread; one query
    answers the usual case (none enabled)."""
    query = _autocast()
    if (query.any_enabled is None or not query.any_enabled()) and not any(
        torch.is_autocast_enabled(device_type) for device_type in query.missed
    ):
        return ()
    return tuple(
        (device_type, torch.get_autocast_dtype(device_type))
        for device_type in query.device_types
        if torch.is_autocast_enabled(device_type)
    )


class _Applied(local):
    num_threads: int | None = None


_applied = _Applied()


class ThreadSettings(NamedTuple):
    """The caller's settings, captured once per overlap call."""

    num_threads: int
    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype], ...]
    """(device_type, dtype) of each enabled autocast."""
    autocast_cache_enabled: bool
    default_device: torch.device
    cuda_device: int | None
    saved_tensors_hooks: tuple[Any, Any] | None = None
    """The innermost (pack, unpack) pair of `torch.autograd.graph.saved_tensors_hooks`."""
    saved_tensors_hooks_disabled: str | None = None
    """The error message of `disable_saved_tensors_hooks`, if they are disabled."""


def capture() -> ThreadSettings:
    """The calling thread's settings."""
    autocast = _enabled_autocasts()
    cuda_device = None
    if torch.cuda.is_initialized():  # a flag read; implies available
        cuda_device = torch.cuda.current_device()
    return ThreadSettings(
        num_threads=torch.get_num_threads(),
        grad_enabled=torch.is_grad_enabled(),
        inference_mode=torch.is_inference_mode_enabled(),
        autocast=autocast,
        autocast_cache_enabled=torch.is_autocast_cache_enabled(),
        default_device=default_device(),
        cuda_device=cuda_device,
        saved_tensors_hooks=_top_saved_tensors_hooks(True),
        saved_tensors_hooks_disabled=_saved_tensors_hooks_disabled(),
    )


_autograd = torch._C._autograd
_top_saved_tensors_hooks = getattr(
    _autograd, "_top_saved_tensors_default_hooks", lambda ignore_is_tracing: None
)
_saved_tensors_hooks_disabled = getattr(
    _autograd, "_saved_tensors_hooks_get_disabled_error_message", lambda: None
)
_CPU = torch.device("cpu")


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are on in this thread (`torch.utils.checkpoint`,
    `save_on_cpu`)."""
    return _top_saved_tensors_hooks(True) is not None
_function_mode_depth = getattr(torch._C, "_len_torch_function_stack", None)
_dispatch_mode_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
_device_context_holder = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)


def default_device() -> torch.device:
    """`torch.get_default_device()` of the calling thread, answered from two flag reads
    in the usual case (no torch-function mode, no `set_default_device`: CPU)."""
    if (
        _function_mode_depth is not None
        and _device_context_holder is not None
        and _function_mode_depth() == 0
        and getattr(_device_context_holder, "device_context", None) is None
    ):
        return _CPU
    return torch.get_default_device()


def unreplayed_mode_active() -> bool:
    """Whether a torch-function mode other than the default device's (which `applied`
    replays) or a dispatch mode is active in the calling thread; `dbo.overlap` runs
    inline under one."""
    if _dispatch_mode_depth is not None and _dispatch_mode_depth() > 0:
        return True
    if _function_mode_depth is None or _function_mode_depth() == 0:
        return False
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return not all(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


class applied:  # noqa: N801 - used like the function-style context managers
    """`with applied(settings):` runs the body with `settings` in the calling (worker)
    thread, and restores what it entered afterwards.

    When the thread already has the caller's grad mode and default device and no
    autocast or inference mode is wanted (the usual case), nothing is entered. A class,
    not a generator: it runs in every ubatch thread of every overlap call.
    """

    __slots__ = ("_settings", "_stack")

    def __init__(self, settings: ThreadSettings) -> None:
        self._settings = settings
        self._stack: ExitStack | None = None

    def __enter__(self) -> None:
        settings = self._settings
        # `torch.get_num_threads()` can report the caller's count in a thread whose
        # OpenMP pool was never sized, so remember what this thread applied instead.
        if _applied.num_threads != settings.num_threads:
            torch.set_num_threads(settings.num_threads)
            _applied.num_threads = settings.num_threads
        if settings.cuda_device is not None:
            torch.cuda.set_device(settings.cuda_device)
        if (
            not settings.inference_mode
            and not torch.is_inference_mode_enabled()
            and not settings.autocast
            and torch.is_grad_enabled() == settings.grad_enabled
            and settings.default_device == default_device()
            and settings.saved_tensors_hooks is None
            and settings.saved_tensors_hooks_disabled is None
        ):
            return
        with ExitStack() as stack:  # unwinds what was entered if an enter fails
            if settings.inference_mode or torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode(settings.inference_mode))
            stack.enter_context(torch.set_grad_enabled(settings.grad_enabled))
            for device_type, dtype in settings.autocast:
                stack.enter_context(
                    torch.autocast(
                        device_type, dtype=dtype, cache_enabled=settings.autocast_cache_enabled
                    )
                )
            if settings.default_device != default_device():
                stack.enter_context(settings.default_device)
            if settings.saved_tensors_hooks is not None:
                stack.enter_context(
                    torch.autograd.graph.saved_tensors_hooks(*settings.saved_tensors_hooks)
                )
            if settings.saved_tensors_hooks_disabled is not None:
                stack.enter_context(
                    torch.autograd.graph.disable_saved_tensors_hooks(
                        settings.saved_tensors_hooks_disabled
                    )
                )
            self._stack = stack.pop_all()

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._stack is not None:
                self._stack.close()
                self._stack = None
        finally:
            # `fn` may have changed the count: the next run sets the caller's again.
            if torch.get_num_threads() != _applied.num_threads:
                _applied.num_threads = None
            _clear_leftovers()


_pop_saved_tensors_hooks = getattr(_autograd, "_pop_saved_tensors_default_hooks", None)
_enable_saved_tensors_hooks = getattr(_autograd, "_saved_tensors_hooks_enable", None)


def _clear_leftovers() -> None:
    """Turn off what `fn` switched on in this worker thread and left on (an autocast,
    saved-tensor hooks, modes): a later, unrelated call would run under it. Grad mode
    and the default device need nothing here: the next call compares and sets them.
    Autocast is asked through the any-autocast query only, so an autocast it misses
    (`_autocast().missed`) that `fn` leaves on stays on in the worker."""
    query = _autocast()
    if query.any_enabled is None or query.any_enabled():
        for device_type in query.device_types:
            if torch.is_autocast_enabled(device_type):
                torch.set_autocast_enabled(device_type, False)
    if _pop_saved_tensors_hooks is not None:
        while _top_saved_tensors_hooks(True) is not None:
            _pop_saved_tensors_hooks()
    if _enable_saved_tensors_hooks is not None and _saved_tensors_hooks_disabled() is not None:
        _enable_saved_tensors_hooks()
    # Modes `fn` entered and never exited: a default device through torch's own call,
    # anything else popped without its __exit__.
    if _function_mode_depth is not None and _function_mode_depth() > 0:
        if getattr(_device_context_holder, "device_context", None) is not None:
            torch.set_default_device(None)
        while _function_mode_depth() > 0:
            torch._C._pop_torch_function_stack()
    if _dispatch_mode_depth is not None:
        while _dispatch_mode_depth() > 0:
            torch._C._pop_torch_dispatch_stack(None)
