"""A small pytree: tuples and lists (and their subclasses), dicts (and dict subclasses,
`UserDict`s), namedtuples, struct sequences and dataclasses, with readable paths.

The runtime needs four things from a nested argument structure: its leaves with a path
for error messages ("args[0]", "kwargs['mask']", "out.logits"), a structure that can be
compared between ubatches, and a way to rebuild it from new leaves. `torch.Size` and
strings are leaves.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import dis
import functools
import inspect
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch


class TreeSpec:
    """The structure of a pytree; `==` compares structure, not leaf values."""

    __slots__ = ("kind", "node_type", "keys", "children", "template")

    def __init__(
        self,
        kind: str,
        node_type: type | None = None,
        keys: tuple[Any, ...] = (),
        children: tuple[TreeSpec, ...] = (),
        template: Any = None,
    ) -> None:
        self.kind = kind
        self.node_type = node_type
        self.keys = keys
        self.children = children
        self.template = template
        """The instance a rebuild starts from: dict and list subclasses, `UserDict`s and
        dataclasses (their extra state, or what tells derived fields apart)."""

    def _key(self) -> tuple[Any, ...]:
        return (self.kind, self.node_type, self.keys, self.children)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TreeSpec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        if self.kind == "leaf":
            return "*"
        name = self.node_type.__name__ if self.node_type is not None else self.kind
        if self.kind == "dict":
            items = [f"{key!r}: {child!r}" for key, child in zip(self.keys, self.children)]
        elif self.kind in ("dataclass", "namedtuple"):
            items = [f"{key}={child!r}" for key, child in zip(self.keys, self.children)]
        else:
            items = [repr(child) for child in self.children]
        return f"{name}({', '.join(items)})"


_LEAF = TreeSpec("leaf")


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _is_structseq(value: Any) -> bool:
    """torch.return_types (e.g. the result of `x.max(dim=1)`) and other struct sequences."""
    return isinstance(value, tuple) and hasattr(type(value), "n_fields")


# Per dataclass, computed once. Weak keys: a class defined per call (in a function)
# must not be kept alive here, with everything it closes over.
_init_fields: weakref.WeakKeyDictionary[type, frozenset[str] | None] = (
    weakref.WeakKeyDictionary()
)
_exposed_fields: weakref.WeakKeyDictionary[type, frozenset[str] | None] = (
    weakref.WeakKeyDictionary()
)


def _constructor_fields(cls: type) -> frozenset[str] | None:
    """The `init=True` field names of a dataclass whose constructor takes exactly them
    (no `InitVar`, no custom parameters); None when the constructor cannot rebuild it."""
    if cls not in _init_fields:
        names = frozenset(field.name for field in dataclasses.fields(cls) if field.init)
        try:
            parameters = frozenset(inspect.signature(cls).parameters)
        except (TypeError, ValueError):
            parameters = None
        _init_fields[cls] = names if parameters == names else None
    return _init_fields[cls]


def _derived_by_post_init(cls: type) -> frozenset[str] | None:
    """The fields to expose when some `init=False` fields are derived in `__post_init__`
    (a row count, a scale vector of another length): those are neither split nor merged
    but derived again by the constructor. None: every field is exposed.

    A field counts as derived when the constructor rebuilds `cls` and the code that
    `__post_init__` runs names it (`self.n = ...` or `object.__setattr__(self, "n",
    ...)`): the `__post_init__` of `cls` and of its bases (`super().__post_init__()`),
    and the methods of the class they call on `self` (`self._derive()`). An
    `init=False` field none of them names is data set after construction, exposed like
    the others.
    """
    if cls not in _exposed_fields:
        exposed = None
        named = _names_in_post_init(cls)
        if _constructor_fields(cls) is not None and named is not None:
            fields = dataclasses.fields(cls)
            derived = {f.name for f in fields if not f.init and f.name in named}
            if derived:
                exposed = frozenset(f.name for f in fields if f.name not in derived)
        _exposed_fields[cls] = exposed
    return _exposed_fields[cls]


def _names_in_post_init(cls: type) -> set[str] | None:
    """The attribute names and string constants in the code `__post_init__` runs (see
    `_derived_by_post_init`), or None when `cls` has no `__post_init__`.

    From the `__post_init__` that `cls` resolves to, following what it calls through
    `super()` (looked up after the class that defines the calling code), on `self`
    (looked up from `cls`), and the plain functions of the calling code's own module
    that it names (a module-level `_derive(self)` helper)."""
    mro = cls.__mro__

    def defined_after(position: int, name: str) -> tuple[types.FunctionType, int] | None:
        for index in range(position, len(mro)):
            function = _function_of(mro[index].__dict__.get(name))
            if function is not None:
                return function, index
        return None

    start = defined_after(0, "__post_init__")
    if start is None:
        return None
    first, owner = start
    pending = [(first.__code__, owner, first.__globals__)]
    named: set[str] = set()
    seen: set[types.CodeType] = set()
    while pending:
        code, owner, module_globals = pending.pop()
        if code in seen:
            continue
        seen.add(code)
        named.update(code.co_names)
        for constant in code.co_consts:
            if isinstance(constant, str):
                named.add(constant)
            elif isinstance(constant, types.CodeType):  # a nested function, a lambda
                pending.append((constant, owner, module_globals))
        for name, on_super in _methods_called_on_self(code):
            # `super().name(...)` resolves after the owner; `self.name(...)` from the top.
            candidate = defined_after(owner + 1 if on_super else 0, name)
            if candidate is not None:
                function, index = candidate
                pending.append((function.__code__, index, function.__globals__))
        for name in _globals_loaded(code):
            helper = module_globals.get(name)
            if isinstance(helper, types.FunctionType) and helper.__globals__ is module_globals:
                pending.append((helper.__code__, owner, module_globals))
    return named


def _globals_loaded(code: types.CodeType) -> Iterator[str]:
    """The global names `code` loads (candidates for module-level helper functions)."""
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL" and isinstance(instruction.argval, str):
            yield instruction.argval


_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _methods_called_on_self(code: types.CodeType) -> Iterator[tuple[str, bool]]:
    """(name, through super()) of each `self.name` / `super().name` the code loads,
    `self` being its first argument; only those can run the class's own methods (a
    `to()` called on a tensor field is not the class's `to()`). Bytecode that does not
    match these shapes (another Python's) yields nothing more: then fewer fields count
    as derived, the rule's cautious side."""
    self_name = code.co_varnames[0] if code.co_argcount else None
    previous: Any = None
    super_called = False
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL" and instruction.argval == "super":
            super_called = True
        elif instruction.opname == "LOAD_SUPER_ATTR":  # Python 3.12+: super().name
            yield str(instruction.argval), True
        elif instruction.opname in _ATTRIBUTE_LOADS and isinstance(instruction.argval, str):
            if previous is not None and previous.opname == "CALL" and super_called:
                yield instruction.argval, True
                super_called = False
            elif (
                previous is not None
                and previous.opname.startswith("LOAD_FAST")
                and previous.argval == self_name
            ):
                yield instruction.argval, False
        previous = instruction


def _function_of(attribute: Any) -> types.FunctionType | None:
    """The function of a plain, static or class method defined in a class body."""
    function = getattr(attribute, "__func__", attribute)
    return function if isinstance(function, types.FunctionType) else None


def _rebuild_dataclass(
    node_type: type, keys: tuple[Any, ...], values: list[Any], template: Any
) -> Any:
    """Call the constructor with the init fields, so that `__post_init__` derives fields
    from the new contents; then set the exposed `init=False` fields, and the fields
    that hold tensors only (`_holds_tensors`) again: they are already what a
    `__post_init__` made of them once, and one that transforms a field (`self.pixels =
    self.pixels / 255`, an `unsqueeze`) must not apply twice, while the values it
    derives (a row count) must follow the part. A
    dataclass whose constructor takes other parameters (an `InitVar`) is copied and its
    fields set."""
    init_names = _constructor_fields(node_type)
    if init_names is None:
        rebuilt = copy.copy(template)
        for key, value in zip(keys, values):
            object.__setattr__(rebuilt, key, value)  # frozen dataclasses too
        return rebuilt
    items = dict(zip(keys, values))
    rebuilt = node_type(**{key: items[key] for key in init_names if key in items})
    post_init = hasattr(node_type, "__post_init__")
    for key, value in items.items():
        if key not in init_names or (post_init and _holds_tensors(value)):
            object.__setattr__(rebuilt, key, value)
    return rebuilt


def _holds_tensors(value: Any) -> bool:
    """A tensor, or a non-empty list / tuple / dict of tensors only: a value the split
    cut (or the merge joined), to be kept exactly as it is. A container that also holds
    other values (a row count `__post_init__` derives next to a tensor) keeps what the
    constructor made of it."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    items = list(value)
    return bool(items) and all(isinstance(item, torch.Tensor) for item in items)


def _rebuild_namedtuple(node_type: type, values: list[Any], template: Any) -> Any:
    """A namedtuple holding `values`, without running its type's `__new__` (as
    namedtuple's `_make`): the values already are what it made of them once, and user
    code that transforms, derives or counts must not run again on them. Attributes its
    `__new__` set on the instance come from the template."""
    rebuilt: Any = tuple.__new__(node_type, values)
    state = getattr(template, "__dict__", None)
    if state:
        rebuilt.__dict__.update(state)
    return rebuilt


def _shell_of(template: Any) -> Any:
    """A container of `template`'s type and attributes, without its items.

    What `copy.copy` does minus replaying the items: that replay goes through the
    type's own `__setitem__` / `append`, which may refuse (read-only types) or have side
    effects, and `rebuild` fills the items itself. A type with its own `__copy__`
    (`UserDict`) is copied with it (the caller empties the items). Attributes that the
    pickle state leaves out (`__getstate__` keeping only some) are copied over too.
    """
    reduced: Any = None
    if getattr(type(template), "__copy__", None) is None:
        # A type that refuses pickling may still copy.
        with contextlib.suppress(Exception):
            reduced = template.__reduce_ex__(4)
    if not isinstance(reduced, tuple):
        return copy.copy(template)
    function, arguments, *rest = reduced
    try:
        shell = function(*arguments)
    except TypeError:
        # A constructor that needs arguments its pickle form does not give (a dict
        # subclass whose __init__ takes a name): an instance made without __init__,
        # with the template's attributes (copied over below).
        cls: Any = type(template)
        shell = cls.__new__(cls)
    state = rest[0] if rest else None
    if state is not None:
        set_state = getattr(shell, "__setstate__", None)
        if set_state is not None:
            set_state(state)
        else:
            slot_state = None
            if isinstance(state, tuple) and len(state) == 2:
                state, slot_state = state
            if state:
                shell.__dict__.update(state)
            for name, value in (slot_state or {}).items():
                setattr(shell, name, value)
    own, copied = getattr(template, "__dict__", None), getattr(shell, "__dict__", None)
    if own and copied is not None:
        for name, value in own.items():
            copied.setdefault(name, value)
    return shell


_leaf_types: dict[int, weakref.ref[type]] = {}
"""Types seen to be leaves (tensors, numbers, strings, modules), by `id`: every test in
`children` depends on the type alone, so a type seen once as a leaf is answered by one
dict lookup after. Weak references, so that a class defined in a function (and what its
methods close over) is not kept alive; its entry goes when it does. A type made a
container after it was first seen (`UserDict.register(T)`, `dataclass(T)` applied
later) stays a leaf."""
_MAX_LEAF_TYPES = 4096


def _forget_leaf_type(key: int, ref: weakref.ref[type]) -> None:
    if _leaf_types.get(key) is ref:
        del _leaf_types[key]


def _remember_leaf_type(value_type: type) -> None:
    if len(_leaf_types) < _MAX_LEAF_TYPES:
        key = id(value_type)
        _leaf_types[key] = weakref.ref(value_type, functools.partial(_forget_leaf_type, key))


def children(value: Any) -> tuple[str, type, tuple[Any, ...], list[Any]] | None:
    """(kind, type, keys, child values) of a container node, or None for a leaf.

    Dataclasses expose all their fields, except those `__post_init__` derives (see
    `_derived_by_post_init` and `_rebuild_dataclass`).
    """
    value_type = type(value)
    known = _leaf_types.get(id(value_type))
    if known is not None and known() is value_type:  # not a new type at a reused id
        return None
    if value_type is tuple or value_type is list:
        return value_type.__name__, value_type, tuple(range(len(value))), list(value)
    if value_type is dict:
        keys = tuple(value.keys())
        return "dict", dict, keys, [value[key] for key in keys]
    described = _described_container(value)
    if described is None:
        _remember_leaf_type(value_type)
    return described


def _described_container(value: Any) -> tuple[str, type, tuple[Any, ...], list[Any]] | None:
    """`children` for the types its fast paths do not cover."""
    if _is_namedtuple(value):
        return "namedtuple", type(value), tuple(type(value)._fields), list(value)
    if _is_structseq(value):
        return "structseq", type(value), tuple(range(len(value))), list(value)
    if type(value) in (tuple, list):
        return type(value).__name__, type(value), tuple(range(len(value))), list(value)
    if isinstance(value, list):  # a subclass: rebuilt from a copy (its constructor may differ)
        return "list subclass", type(value), tuple(range(len(value))), list(value)
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        # A subclass (a shape is a leaf): rebuilt without its constructor, which may differ.
        return "tuple subclass", type(value), tuple(range(len(value))), list(value)
    if isinstance(value, dict):
        keys = tuple(value.keys())
        return "dict", type(value), keys, [value[key] for key in keys]
    if isinstance(value, collections.UserDict):  # e.g. transformers' BatchEncoding
        keys = tuple(value.data.keys())
        return "dict", type(value), keys, [value.data[key] for key in keys]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        exposed = _derived_by_post_init(type(value))
        names = tuple(
            field.name
            for field in dataclasses.fields(value)
            if (exposed is None or field.name in exposed)
            and hasattr(value, field.name)  # an init=False field may never be set
        )
        return "dataclass", type(value), names, [getattr(value, name) for name in names]
    return None


def rebuild(
    kind: str, node_type: type, keys: tuple[Any, ...], values: list[Any], template: Any
) -> Any:
    """A container like `template` (of `kind`, as `children` described it) holding `values`."""
    if kind in ("tuple", "list", "structseq"):
        return node_type(values)
    if kind == "namedtuple":
        return _rebuild_namedtuple(node_type, values, template)
    if kind == "tuple subclass":
        # Without the constructor: a subclass's own `__new__` may differ.
        rebuilt: Any = tuple.__new__(node_type, values)
        state = getattr(template, "__dict__", None)
        if state:
            rebuilt.__dict__.update(state)
        return rebuilt
    if kind == "list subclass":
        rebuilt = _shell_of(template)
        list.clear(rebuilt)  # a custom __reduce__ may pass the items to the constructor
        list.extend(rebuilt, values)  # bypass overridden methods, like dict's below
        return rebuilt
    if kind == "dict":
        if node_type is dict:
            return dict(zip(keys, values))
        # A subclass (defaultdict, OrderedDict, UserDict, ...): keep its type and extra
        # state, and bypass overridden update() methods (Counter.update adds counts).
        # Items go in through the type's own __setitem__, which may keep attributes in
        # step with them (transformers' ModelOutput); one that refuses falls back to the
        # base type's.
        rebuilt = _shell_of(template)
        if isinstance(rebuilt, collections.UserDict):
            rebuilt.data = {}  # the shell's state holds the template's own dict
            store = rebuilt.data.__setitem__
        elif isinstance(rebuilt, collections.OrderedDict):
            collections.OrderedDict.clear(rebuilt)  # dict.clear would skip its key order
            store = functools.partial(collections.OrderedDict.__setitem__, rebuilt)
        else:
            dict.clear(rebuilt)
            store = functools.partial(dict.__setitem__, rebuilt)
        for key, value in zip(keys, values):
            try:
                rebuilt[key] = value
            except Exception:  # noqa: BLE001 - a read-only mapping type
                store(key, value)
        return rebuilt
    return _rebuild_dataclass(node_type, keys, values, template)


def _child_path(path: str, kind: str, key: Any) -> str:
    if kind in ("dataclass", "namedtuple"):
        return f"{path}.{key}"
    return f"{path}[{key!r}]"


def flatten(tree: Any, path: str = "") -> tuple[list[Any], list[str], TreeSpec]:
    """Leaves in depth-first order, their paths (rooted at `path`), and the structure."""
    leaves: list[Any] = []
    paths: list[str] = []
    spec = _visit(tree, path, leaves, paths)
    return leaves, paths, spec


# Module-level recursion, not a closure calling itself: such a closure is a reference
# cycle that would keep the leaves (activations) alive until the garbage collector runs.
def _visit(node: Any, node_path: str, leaves: list[Any], paths: list[str]) -> TreeSpec:
    described = children(node)
    if described is None:
        leaves.append(node)
        paths.append(node_path)
        return _LEAF
    kind, node_type, keys, values = described
    child_specs = tuple(
        _visit(child, _child_path(node_path, kind, key), leaves, paths)
        for key, child in zip(keys, values)
    )
    template = None
    if kind in ("dataclass", "namedtuple", "list subclass", "tuple subclass") or (
        kind == "dict" and node_type is not dict
    ):
        template = node
    return TreeSpec(kind, node_type, keys, child_specs, template)


def unflatten(spec: TreeSpec, leaves: list[Any]) -> Any:
    """Rebuild a tree of structure `spec` from `leaves` (depth-first order)."""
    return _build(spec, iter(leaves))


def _build(node: TreeSpec, leaves: Iterator[Any]) -> Any:
    if node.kind == "leaf":
        return next(leaves)
    values = [_build(child, leaves) for child in node.children]
    assert node.node_type is not None, "container specs always record their type"
    return rebuild(node.kind, node.node_type, node.keys, values, node.template)
