"""dbo reaches torch's private bindings through `dbo._torch_private` alone: each resolves
and behaves as dbo expects on this torch, and one missing or answering otherwise raises
`TorchBindingError` naming it and the torch release, at first use, never a fallback."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dbo import _torch_private
from dbo._torch_private import BINDINGS, TorchBindingError

PACKAGES = Path(__file__).resolve().parents[2]


def test_every_binding_resolves_and_behaves_as_dbo_expects_on_this_torch() -> None:
    fresh = _torch_private._Private()
    for name, (module, attribute) in BINDINGS.items():
        assert getattr(fresh, name) is _torch_private._resolve(name, module, attribute)
    assert fresh.top_saved_tensors_hooks(True) is None
    assert _torch_private.profiling() is False


def test_a_missing_binding_is_refused_naming_it_and_the_torch_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(BINDINGS, "pop_function_mode", ("torch._C", "_no_such_binding"))
    with pytest.raises(TorchBindingError) as raised:
        _torch_private._Private().function_mode_depth  # noqa: B018 - any first use loads all
    message = str(raised.value)
    assert "torch._C._no_such_binding (pop_function_mode)" in message, message
    assert f"does not exist in torch {torch.__version__}" in message, message


def _load_with(monkeypatch: pytest.MonkeyPatch, name: str, binding: object) -> None:
    """Load the bindings afresh, `name` resolving to `binding`."""
    resolve = _torch_private._resolve

    def resolved(each: str, module: str, attribute: str) -> object:
        return binding if each == name else resolve(each, module, attribute)

    monkeypatch.setattr(_torch_private, "_resolve", resolved)
    _torch_private._Private().top_saved_tensors_hooks  # noqa: B018 - any first use loads all


def test_a_binding_that_answers_otherwise_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(TorchBindingError, match=r"_len_torch_dispatch_stack \("
                       r"dispatch_mode_depth\), which behaves otherwise than dbo expects"):
        _load_with(monkeypatch, "dispatch_mode_depth", lambda: 1)


def test_a_binding_that_raises_in_the_check_is_refused_with_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def raising() -> int:
        raise ZeroDivisionError("in the binding")

    with pytest.raises(TorchBindingError, match=r"one of which behaves otherwise than dbo "
                       r"expects \(ZeroDivisionError\('in the binding'\)\)"):
        _load_with(monkeypatch, "function_mode_depth", raising)


def _private_torch_names(path: Path) -> list[str]:
    """The `torch....._x` names a module reaches in code (docstrings aside), other than
    `torch.utils._pytree` (torch's documented way to walk nested structures)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute):
            names = [ast.unparse(node)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "torch" and any(part.startswith("_") and part != "_pytree"
                                           for part in parts[1:]):
                found.append(name)
    return found


def test_no_other_module_of_the_three_packages_reaches_a_private_torch_name() -> None:
    """comm's emulated link (a test and benchmark tool) sleeps on the GPU with
    `torch.cuda._sleep`; a torch without it fails there with torch's AttributeError."""
    reached = {
        str(path.relative_to(PACKAGES)): names
        for package in ("dbo", "comm", "workspace") for path in (PACKAGES / package).rglob("*.py")
        if path.name != "_torch_private.py" and (names := _private_torch_names(path))
    }
    assert reached == {"comm/emulated.py": ["torch.cuda._sleep"] * 3}, reached
