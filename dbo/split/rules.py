"""Which leaves a split or merge meets, and how each is handled: split rules for the types
that hold per-row state across calls (a KV cache, `register_split_rule`), the tree walk
that treats such objects and shapes as leaves, and the refusals: an object of a type
without a rule that holds batch-sized tensors (it would reach every ubatch whole and be
written by all), and a container torch's pytree does not know that holds tensors.

Arguments and outputs are walked with `torch.utils._pytree`: its containers (tuple,
list, dict, namedtuple, ...) and the types registered with it (transformers'
`ModelOutput`; a dataclass after `register_dataclass`); anything else, `torch.Size`
included, is a leaf.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

SplitRule = Callable[[Any, list[int]], Sequence[Any]]  # split(obj, rows_per_ubatch) -> parts
MergeRule = Callable[[list[Any]], Any]  # merge([part_0, part_1, ...]) -> obj


@dataclasses.dataclass(frozen=True)
class _Rule:
    split: SplitRule
    merge: MergeRule


_rules: dict[type, _Rule] = {}
_lookup_cache: weakref.WeakKeyDictionary[type, _Rule | None] = weakref.WeakKeyDictionary()
"""The rule of each type met (None: none); weak, so a local class is not kept alive."""
_lock = threading.Lock()


def register_split_rule(cls: type, *, split: SplitRule, merge: MergeRule) -> None:
    """Teach `dbo.overlap`'s default split and merge a type that holds per-row state.

    When an argument (at any depth of the pytree) is an instance of `cls` or a subclass,
    the default split calls `split(obj, rows)` with `rows` the number of batch rows of each
    ubatch, in ubatch order (the rows `torch.tensor_split` gives the tensor arguments:
    `sum(rows)` is the batch size), and hands ubatch i the i-th object it returns; the
    default merge calls `merge([out_0, out_1, ...])` for an output leaf of that type (or a
    subclass: give the parts the rule's type) and returns what it returns. The rule
    decides what persists between calls (a KV cache keeps each ubatch's rows in place).
    `split` runs in the calling thread before the ubatches start, `merge` after they all
    return; an inline call (below the thresholds) passes the object whole and merges
    nothing. Registering a type again replaces its rule. Used by `dbo.overlap` with its
    default split (a custom `split=` cuts such objects itself) and by `dbo.default_merge`.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_split_rule needs a class, got {cls!r}")
    for name, value in (("split", split), ("merge", merge)):
        if not callable(value):
            raise TypeError(f"register_split_rule: {name} must be callable, got {value!r}")
    with _lock:
        _rules[cls] = _Rule(split, merge)
        _lookup_cache.clear()


def rule_for(obj: Any) -> _Rule | None:
    """The split rule of `obj`'s type (its nearest registered base class), or None."""
    kind = type(obj)
    try:
        return _lookup_cache[kind]
    except KeyError:
        pass
    _register_known_libraries(obj)
    with _lock:
        rule = next((_rules[base] for base in kind.__mro__ if base in _rules), None)
        _lookup_cache[kind] = rule
    return rule


_deferred: list[tuple[str, str, Callable[[], None]]] = []
"""(module, class name, register) of rules registered the first time an instance of
`module.class name` is met: the library's module is never imported for it (an instance
means it is imported)."""


def defer_split_rule(module: str, class_name: str, register: Callable[[], None]) -> None:
    """Have `register()` (which calls `register_split_rule`) run the first time an
    instance of `module.class_name` is split or merged (`dbo.hf` does it for
    transformers' caches)."""
    _deferred.append((module, class_name, register))


def _register_known_libraries(obj: Any) -> None:
    for module_name, class_name, register in _deferred:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and isinstance(obj, cls):
            register()


def split_object(obj: Any, rule: _Rule, rows: list[int], path: str) -> list[Any]:
    """`rule.split(obj, rows)`, checked: one part per ubatch."""
    parts = list(rule.split(obj, list(rows)))
    if len(parts) != len(rows):
        raise ValueError(
            f"the split rule registered for {type(obj).__name__} returned {len(parts)} "
            f"parts of {path} for {len(rows)} ubatches; it must return one per ubatch"
        )
    return parts


_PLAIN = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
    torch.layout, torch.memory_format, torch.Size, type,
)
_SCAN_DEPTH = 3  # obj.attr, obj.attr[i].attr: a cache's `layers[i].keys`
_SCAN_BUDGET = 512  # nodes looked at per object, so a large object costs a bounded scan


def hidden_batch_tensor(obj: Any, batch_size: int) -> str | None:
    """Where an object of a type without a split rule holds a tensor with `batch_size`
    rows in its attributes (`.layers[0].keys`), looked for a few levels deep; None if it
    does not, or if it is a tensor (split along dim 0), has a split rule, is a plain
    value, a module (weights are shared) or a callable."""
    skipped = isinstance(obj, (_PLAIN, torch.nn.Module, torch.Tensor)) or callable(obj)
    if skipped or rule_for(obj) is not None:
        return None
    pending: list[tuple[Any, str, int]] = [(obj, "", 0)]
    seen = {id(obj)}
    budget = _SCAN_BUDGET
    while pending and budget > 0:
        node, where, depth = pending.pop()
        budget -= 1
        if isinstance(node, torch.Tensor):
            if node.ndim >= 1 and node.size(0) == batch_size:
                return where
            continue
        if depth >= _SCAN_DEPTH or isinstance(node, (_PLAIN, torch.nn.Module)):
            continue
        if isinstance(node, dict):
            children = [(value, f"{where}[{key!r}]") for key, value in node.items()]
        elif isinstance(node, (list, tuple)):
            children = [(value, f"{where}[{i}]") for i, value in enumerate(node)]
        elif hasattr(node, "__dict__") and not callable(node):
            children = [(value, f"{where}.{name}") for name, value in vars(node).items()]
        else:
            continue
        for child, child_where in children:
            if id(child) not in seen:
                seen.add(id(child))
                pending.append((child, child_where, depth + 1))
    return None


def refusal(path: str, obj: Any, where: str, batch_size: int) -> str:
    """The error message for an object that holds batch rows and has no split rule."""
    name = type(obj).__name__
    return (
        f"dbo.overlap cannot split {path}: it is a {name} holding a tensor of {batch_size} "
        f"rows (the batch size) at {path}{where}, and a type without a split rule reaches "
        "every ubatch whole, where each ubatch would write its rows into the same object; "
        f"register a rule with dbo.register_split_rule({name}, split=..., merge=...), "
        "pass it whole on purpose with no_split=, or pass split="
    )


def is_leaf(node: Any) -> bool:
    """A leaf of dbo's tree walk: a shape (one value, not a container of ints) or an
    object with a split rule (split by its rule even if its type is a pytree node too)."""
    return isinstance(node, torch.Size) or rule_for(node) is not None


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """`tree`'s leaves and spec; shapes and objects with a split rule are leaves."""
    return pytree.tree_flatten(tree, is_leaf=is_leaf)


def leaf_paths(tree: Any, root: str) -> list[str]:
    """The readable path of each leaf of `flatten(tree)` (`args[0]`, `kwargs['mask']`,
    `output.logits`), `root` first."""
    pairs = pytree.tree_leaves_with_path(tree, is_leaf=is_leaf)
    return [root + pytree.keystr(path) for path, _ in pairs]


def splittable(leaf: Any) -> bool:
    """A tensor with a dim 0: split along it, and concatenated along it on merge."""
    return isinstance(leaf, torch.Tensor) and leaf.ndim >= 1


def holds_unregistered_tensors(leaf: Any) -> bool:
    """A leaf that holds batch tensors: a dataclass, mapping, list or tuple whose type
    torch's pytree does not know."""
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        inner: Any = [getattr(leaf, field.name, None) for field in dataclasses.fields(leaf)]
    elif isinstance(leaf, Mapping):
        inner = list(leaf.values())
    elif isinstance(leaf, (list, tuple)) and not isinstance(leaf, torch.Size):
        inner = list(leaf)
    else:
        return False
    return any(splittable(x) for x in pytree.tree_leaves(inner, is_leaf=is_leaf))


def unregistered_refusal(leaf: Any, verb: str) -> str:
    """Why a `holds_unregistered_tensors` leaf cannot be split (`verb` "split") or merged
    ("merge"), and the fix: register its type with torch's pytree, or pass `verb`=."""
    name = type(leaf).__name__
    how = "register_dataclass" if dataclasses.is_dataclass(leaf) else "register_pytree_node"
    effect = "every ubatch would get it whole" if verb == "split" else "it cannot be joined"
    return (
        f"it is a {name} holding tensors, a type torch.utils._pytree does not know, so "
        f"{effect}; register it with torch.utils._pytree.{how}({name}), or pass {verb}="
    )
