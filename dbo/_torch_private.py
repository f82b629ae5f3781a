"""Every private torch binding dbo uses, in one place: what to audit on a torch upgrade.

torch has no public way to do what these do: read the current saved-tensor hooks and
the mode stacks (to replay the caller's settings in a ubatch thread and clear what `fn`
left behind), ask whether the running backward keeps its graph, run a callback at its
end, see a tensor's hooks
(which an overlapped backward would run per ubatch), open a profiler range that another
call closes, and give back a failed CUDA graph capture's memory pool. FSDP2's internals,
which `dbo.fsdp` reads, are named there. Each
is present in every torch release pyproject.toml declares (the test suite checks them on
the torch it runs; released torch 2.11 and 2.13 are checked).

`private.NAME` resolves every binding at its first use and checks, in a thread of its
own, that each behaves as dbo expects (a hook pushed is the one read back, a mode popped
is gone, ...). One missing, or answering otherwise, raises `TorchBindingError` naming it
and the torch release: never a fallback that would change what dbo does.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import torch

BINDINGS: dict[str, tuple[str, str]] = {
    "top_saved_tensors_hooks": ("torch._C._autograd", "_top_saved_tensors_default_hooks"),
    "pop_saved_tensors_hooks": ("torch._C._autograd", "_pop_saved_tensors_default_hooks"),
    "saved_tensors_hooks_disabled_message": (
        "torch._C._autograd", "_saved_tensors_hooks_get_disabled_error_message"),
    "enable_saved_tensors_hooks": ("torch._C._autograd", "_saved_tensors_hooks_enable"),
    "function_mode_depth": ("torch._C", "_len_torch_function_stack"),
    "pop_function_mode": ("torch._C", "_pop_torch_function_stack"),
    "function_modes": ("torch.overrides", "_get_current_function_mode_stack"),
    "DeviceContext": ("torch.utils._device", "DeviceContext"),
    "default_device_context": ("torch", "_GLOBAL_DEVICE_CONTEXT"),
    "dispatch_mode_depth": ("torch._C", "_len_torch_dispatch_stack"),
    "pop_dispatch_mode": ("torch._C", "_pop_torch_dispatch_stack"),
    "disable_current_modes": ("torch.utils._python_dispatch", "_disable_current_modes"),
    "DisableTorchFunction": ("torch._C", "DisableTorchFunction"),
    "transform_on_stack": ("torch._C._functorch", "peek_interpreter_stack"),
    "backward_keeps_graph": ("torch._C._autograd", "_get_current_graph_task_keep_graph"),
    "backward_engine": ("torch.autograd", "Variable._execution_engine"),  # its queue_callback
    "tensor_hooks": ("torch._C", "TensorBase._backward_hooks"),  # `register_hook`'s dict
    "post_accumulate_grad_hooks": ("torch._C", "TensorBase._post_accumulate_grad_hooks"),
    "enter_profiler_range": ("torch", "ops.profiler._record_function_enter_new"),
    "exit_profiler_range": ("torch", "ops.profiler._record_function_exit._RecordFunction"),
    "profiler": ("torch.autograd", "profiler"),  # its `_is_profiler_enabled` flag
    "end_allocate_to_pool": ("torch._C", "_cuda_endAllocateToPool"),  # a failed capture's
    "release_pool": ("torch._C", "_cuda_releasePool"),  # pool given back (CPU builds too)
}
"""dbo's name for each binding: (torch module, attribute path)."""


class TorchBindingError(RuntimeError):
    """A private torch binding dbo uses is missing, or behaves otherwise, in this torch."""


def _missing(name: str | None, why: str) -> TorchBindingError:
    """The error for binding `name`; None: the check raised or hung, naming none."""
    if name is None:
        which = "bindings (dbo._torch_private.BINDINGS), one of which"
    else:
        module, attribute = BINDINGS[name]
        which = f"{module}.{attribute} ({name}), which"
    return TorchBindingError(
        f"dbo uses torch's private {which} {why} in torch {torch.__version__}; install a "
        "torch release dbo supports (the README's supported versions, pyproject.toml's "
        "torch range)"
    )


def _resolve(name: str, module: str, attribute: str) -> Any:
    try:
        found = importlib.import_module(module)
        for part in attribute.split("."):
            found = getattr(found, part)
        return found
    except (ImportError, AttributeError):
        raise _missing(name, "does not exist") from None


def _behaviour(p: Any) -> list[tuple[str, bool]]:
    """(binding, whether it answered as dbo expects) for each, in a fresh thread: torch's
    defaults, then a hook, a mode, a transform and a backward of its own."""
    return [*_at_defaults(p), *_with_saved_tensors_hooks(p), *_with_modes(p),
            *_with_torch_function_and_transform(p), *_with_backward_and_profiler(p)]


def _at_defaults(p: Any) -> list[tuple[str, bool]]:
    """A fresh thread has no hook, mode, transform or disabled hooks."""
    return [("top_saved_tensors_hooks", p.top_saved_tensors_hooks(True) is None),
            ("function_mode_depth", p.function_mode_depth() == 0),
            ("dispatch_mode_depth", p.dispatch_mode_depth() == 0),
            ("transform_on_stack", p.transform_on_stack() is None),
            ("saved_tensors_hooks_disabled_message",
             p.saved_tensors_hooks_disabled_message() is None)]


def _with_saved_tensors_hooks(p: Any) -> list[tuple[str, bool]]:
    """A hook pushed is the one read back and the pop takes it; hooks disabled give their
    message until enabled again."""
    from torch.autograd.graph import disable_saved_tensors_hooks, saved_tensors_hooks

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    saved_tensors_hooks(pack, pack).__enter__()  # left for the pop to take
    found = [("top_saved_tensors_hooks", p.top_saved_tensors_hooks(True)[0] is pack)]
    p.pop_saved_tensors_hooks()
    found.append(("pop_saved_tensors_hooks", p.top_saved_tensors_hooks(True) is None))
    disabled = disable_saved_tensors_hooks("off")  # held: a generator's end would undo it
    disabled.__enter__()
    found.append(("saved_tensors_hooks_disabled_message",
                  p.saved_tensors_hooks_disabled_message() == "off"))
    p.enable_saved_tensors_hooks()
    found.append(("enable_saved_tensors_hooks", p.saved_tensors_hooks_disabled_message() is None))
    return found


def _with_modes(p: Any) -> list[tuple[str, bool]]:
    """The default device's mode is read back; a torch-function mode and a dispatch mode
    entered are counted, popped, and (the dispatch mode) disabled."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.set_default_device("meta")
    found = [("default_device_context",
              getattr(p.default_device_context, "device_context", None) is not None),
             ("function_modes", isinstance(p.function_modes()[-1], p.DeviceContext))]
    torch.set_default_device(None)
    TorchFunctionMode().__enter__()
    found.append(("function_mode_depth", p.function_mode_depth() == 1))
    p.pop_function_mode()
    found.append(("pop_function_mode", p.function_mode_depth() == 0))
    TorchDispatchMode().__enter__()
    with p.disable_current_modes():
        found.append(("disable_current_modes", p.dispatch_mode_depth() == 0))
    found.append(("dispatch_mode_depth", p.dispatch_mode_depth() == 1))
    p.pop_dispatch_mode(None)
    found.append(("pop_dispatch_mode", p.dispatch_mode_depth() == 0))
    return found


def _with_torch_function_and_transform(p: Any) -> list[tuple[str, bool]]:
    """A subclass's `__torch_function__` is skipped under `DisableTorchFunction`; a
    `torch.func` transform is on the stack inside it."""
    calls: list[Any] = []

    class Seen(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    seen_tensor = torch.ones(1).as_subclass(Seen)
    with p.DisableTorchFunction():
        seen_tensor + 1
    transforms: list[Any] = []

    def loss(x: torch.Tensor) -> torch.Tensor:
        transforms.append(p.transform_on_stack())
        return x.sum()

    torch.func.grad(loss)(torch.ones(1))
    return [("DisableTorchFunction", not calls), ("transform_on_stack", transforms[0] is not None)]


def _with_backward_and_profiler(p: Any) -> list[tuple[str, bool]]:
    """A backward says whether it keeps its graph; the profiler has its flag, and a range
    opens and closes."""
    kept: list[bool] = []
    ended: list[str] = []
    for retain in (True, False):
        leaf = torch.ones(1, requires_grad=True)
        out = leaf * 2
        out.register_hook(lambda grad: kept.append(p.backward_keeps_graph()))
        leaf.register_post_accumulate_grad_hook(lambda leaf: ended.append("leaf"))
        out.register_hook(  # the callback runs after the leaf's accumulation, at the end
            lambda grad: p.backward_engine.queue_callback(lambda: ended.append("end")))
        out.backward(retain_graph=retain)
    hooked = torch.ones(1, requires_grad=True)
    hooked.register_hook(torch.neg)
    hooked.register_post_accumulate_grad_hook(torch.abs)
    hooks = [p.tensor_hooks.__get__(tensor) for tensor in (torch.ones(1), hooked)]
    after = [p.post_accumulate_grad_hooks.__get__(tensor) for tensor in (torch.ones(1), hooked)]
    profiler_flag = isinstance(p.profiler._is_profiler_enabled, bool)
    p.exit_profiler_range(p.enter_profiler_range("dbo/check", None))
    return [("backward_keeps_graph", kept == [True, False]), ("profiler", profiler_flag),
            ("backward_engine", ended == ["leaf", "end"] * 2),
            ("tensor_hooks", not hooks[0] and list(hooks[1].values()) == [torch.neg]),
            ("post_accumulate_grad_hooks",
             not after[0] and list(after[1].values()) == [torch.abs])]


class _Private:
    """The bindings by dbo's names: attributes once `_load` has checked them all."""

    def __getattr__(self, name: str) -> Any:  # only while the attributes are not set yet
        if name not in BINDINGS:
            raise AttributeError(name)
        _load(self)
        return self.__dict__[name]


_lock = threading.Lock()


def _load(into: _Private) -> None:
    """Resolve every binding, check them in a thread of their own, then set them on `into`."""
    with _lock:
        if BINDINGS.keys() <= into.__dict__.keys():
            return  # another thread loaded them
        probe = _Private()
        probe.__dict__.update({name: _resolve(name, *where) for name, where in BINDINGS.items()})
        found: list[tuple[str, bool]] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                found.extend(_behaviour(probe))
            except BaseException as error:  # noqa: BLE001 - raised below, in the caller
                errors.append(error)

        thread = threading.Thread(target=run, name="dbo-torch-binding-check", daemon=True)
        thread.start()
        thread.join(timeout=60)
        failed = [name for name, ok in found if not ok]
        if errors or thread.is_alive() or failed or not found:
            detail = f" ({errors[0]!r})" if errors else ""
            raise _missing(failed[0] if failed else None,
                           f"behaves otherwise than dbo expects{detail}")
        into.__dict__.update(probe.__dict__)


private = _Private()
"""`private.top_saved_tensors_hooks(True)`, ...: every binding of `BINDINGS`, checked."""


def profiling() -> bool:
    """Whether a `torch.profiler` profile records (autograd's flag, read at each turn)."""
    return private.profiler._is_profiler_enabled
