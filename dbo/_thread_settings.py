"""The caller's thread-local torch settings, replayed in the ubatch worker threads.

Intra-op thread count, grad mode, inference mode, autocast (cpu, cuda, xpu, mps, hpu
and the privateuse1 backend), the default device (`with torch.device(...)`,
`torch.set_default_device`), the current CUDA device and the saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`: `save_on_cpu`, non-reentrant checkpointing
around the overlapped call; the innermost pair, and whether they are disabled) are all
per thread in PyTorch. CPU affinity is per thread too, but is not replayed per call (see
`dbo._affinity`). Not replayed: other torch-function and dispatch modes (FakeTensorMode,
a FLOP counter, `allow_mutation_on_saved_tensors`'s): `dbo.overlap` runs inline under
one (entering one mode object from several threads breaks modes that keep per-entry
state), and modes `fn` leaves entered are popped when its job ends. Nor is an autocast
dtype set with `torch.set_autocast_dtype` while autocast is off (only enabled autocasts
are captured, to keep the per-call cost down). `torch.func` transforms (grad, vmap)
cannot cross threads: `dbo.overlap` runs inline under one. The profiler records the
caller's thread only, unless started with
`experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`.

A worker that did not copy the settings would, for example, build autograd graphs
under the caller's `torch.no_grad()`, or run matmuls with the default thread count
(measured: about 2x slower than the caller on a 2-core machine).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack
from threading import local
from typing import Any, NamedTuple

import torch


def _autocast_device_types() -> tuple[str, ...]:
    """Device types whose autocast state is replayed; those this torch does not know
    are skipped (asking about them raises)."""
    wanted = ("cpu", "cuda", "xpu", "mps", "hpu", torch._C._get_privateuse1_backend_name())
    known = []
    for device_type in dict.fromkeys(wanted):
        try:
            torch.is_autocast_enabled(device_type)
        except (RuntimeError, ValueError, TypeError):
            continue
        known.append(device_type)
    return tuple(known)


_AUTOCAST_DEVICE_TYPES = _autocast_device_types()
_AnyQuery = Callable[[], bool]


def _probe_any_autocast_query(
    query: _AnyQuery | None,
) -> tuple[_AnyQuery | None, tuple[str, ...]]:
    """(`query`, the device types whose autocast it does not report), `query` being
    `torch._C._is_any_autocast_enabled` (it misses mps in the torch of this writing).
    Found by enabling each type in a new thread, where autocast starts off everywhere
    (the flags are per thread). (None, every type) when the query is missing or cannot
    be trusted: the probe could not run, failed, or found autocast already on (a green
    thread sharing the importer's OS thread); then each type is asked on every call."""
    unusable = (None, _AUTOCAST_DEVICE_TYPES)
    if query is None:
        return unusable
    missed: list[str] = []
    failed: list[BaseException | None] = []

    def probe() -> None:
        try:
            if query():
                failed.append(None)  # not a fresh thread's flags: nothing to learn
                return
            for device_type in _AUTOCAST_DEVICE_TYPES:
                before = torch.is_autocast_enabled(device_type)
                torch.set_autocast_enabled(device_type, True)
                try:
                    if not query():
                        missed.append(device_type)
                finally:
                    torch.set_autocast_enabled(device_type, before)
        except BaseException as error:  # noqa: BLE001 - any failure: ask every type
            failed.append(error)

    try:
        thread = threading.Thread(target=probe, name="dbo-autocast-probe", daemon=True)
        thread.start()
        thread.join(10.0)
    except Exception:  # noqa: BLE001 - no thread to probe in (a restricted runtime)
        return unusable
    if failed or thread.is_alive():
        return unusable
    return query, tuple(missed)


_is_any_autocast_enabled, _AUTOCAST_MISSED_BY_ANY = _probe_any_autocast_query(
    getattr(torch._C, "_is_any_autocast_enabled", None)
)


def _enabled_autocasts() -> tuple[tuple[str, torch.dtype], ...]:
    """(device_type, dtype) of each autocast enabled in the calling thread. One query
    answers the usual case (none enabled) for all but the types it misses; asking each
    of the six types costs ~3 us, on every overlap call."""
    if (_is_any_autocast_enabled is None or not _is_any_autocast_enabled()) and not any(
        torch.is_autocast_enabled(device_type) for device_type in _AUTOCAST_MISSED_BY_ANY
    ):
        return ()
    return tuple(
        (device_type, torch.get_autocast_dtype(device_type))
        for device_type in _AUTOCAST_DEVICE_TYPES
        if torch.is_autocast_enabled(device_type)
    )


class _Applied(local):
    num_threads: int | None = None


_applied = _Applied()


class ThreadSettings(NamedTuple):
    """The caller's settings, captured once per overlap call (a named tuple: built in
    a fraction of a frozen dataclass's time, on every call)."""

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
    # Initialized implies available; asked first because it is a flag read, where
    # is_available() costs ~1 us (more on a machine with GPUs) on every call.
    if torch.cuda.is_initialized():
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
_function_mode_depth = getattr(torch._C, "_len_torch_function_stack", None)
_dispatch_mode_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
_device_context_holder = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)


def default_device() -> torch.device:
    """`torch.get_default_device()` of the calling thread, without its cost (~5 us) in
    the usual case: no torch-function mode active and no `set_default_device` in this
    thread means CPU, which is what it would answer."""
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
    replays) or a dispatch mode is active in the calling thread (FakeTensorMode, a FLOP
    counter, `allow_mutation_on_saved_tensors`'s clone-before-mutate). Modes are per
    thread, and entering one mode object from two threads breaks those that keep
    per-entry state, so they are not replayed: `dbo.overlap` runs inline under them."""
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
    autocast or inference mode is wanted (the usual case), nothing is entered: a few C
    calls, in every ubatch thread of every overlap call (hence a class, not a
    generator).
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
            # `fn` (or a library it calls) may have changed the count: forget what this
            # thread applied so that the next run sets the caller's count again.
            if torch.get_num_threads() != _applied.num_threads:
                _applied.num_threads = None
            _clear_leftovers()


_pop_saved_tensors_hooks = getattr(_autograd, "_pop_saved_tensors_default_hooks", None)
_enable_saved_tensors_hooks = getattr(_autograd, "_saved_tensors_hooks_enable", None)


def _clear_leftovers() -> None:
    """Turn off what `fn` switched on in this worker thread and left on (an autocast
    set with `torch.set_autocast_enabled`, saved-tensor hooks entered and never exited):
    workers are pooled, and a later, unrelated overlap call would run under it. The
    caller's own settings are entered per call and unwound before this. Grad mode and
    the default device need nothing here: the next call compares and sets them.

    Autocast is asked through torch's any-autocast query only (~0.3 us; asking the
    types it misses one by one, mps in the torch of this writing, costs ~1 us each, on
    every job of every call): an mps autocast left on stays on in the worker."""
    if _is_any_autocast_enabled is None or _is_any_autocast_enabled():
        for device_type in _AUTOCAST_DEVICE_TYPES:
            if torch.is_autocast_enabled(device_type):
                torch.set_autocast_enabled(device_type, False)
    if _pop_saved_tensors_hooks is not None:
        while _top_saved_tensors_hooks(True) is not None:
            _pop_saved_tensors_hooks()
    if _enable_saved_tensors_hooks is not None and _saved_tensors_hooks_disabled() is not None:
        _enable_saved_tensors_hooks()
    # Modes `fn` entered and never exited (the caller's are never replayed: a call under
    # one runs inline). A default device `fn` set goes through torch's own call, which
    # also forgets it; anything left is popped without its __exit__.
    if _function_mode_depth is not None and _function_mode_depth() > 0:
        if getattr(_device_context_holder, "device_context", None) is not None:
            torch.set_default_device(None)
        while _function_mode_depth() > 0:
            torch._C._pop_torch_function_stack()
    if _dispatch_mode_depth is not None:
        while _dispatch_mode_depth() > 0:
            torch._C._pop_torch_dispatch_stack(None)
