"""dbo's folders are its architecture: each part imports only the parts below it (and
its own modules, with no import cycle), and transformers is imported only under dbo/hf."""

from __future__ import annotations

import ast
from pathlib import Path

DBO = Path(__file__).resolve().parents[2] / "dbo"

PARTS = (  # lowest first; a module belongs to the first part whose prefix it has
    ("leaves", ("dbo._checks", "dbo.errors", "dbo._torch_private")),
    ("device", ("dbo.device",)),
    ("tracing", ("dbo.tracing",)),
    ("split", ("dbo.split",)),
    ("runtime", ("dbo.runtime",)),
    ("ubatch", ("dbo.ubatch",)),
    ("gradient sums", ("dbo.gradient_sums",)),
    ("fsdp", ("dbo.fsdp",)),
    ("call", ("dbo._decide", "dbo.backward")),
    ("overlap", ("dbo.overlap",)),
    ("graphs", ("dbo.graphs",)),
    ("hf", ("dbo.hf",)),
    ("dbo", ("dbo",)),
    ("cli", ("dbo.hf.check",)),  # python -m dbo.hf.check: uses dbo's public names
)


def _name(path: Path) -> str:
    parts = path.relative_to(DBO.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in DBO.rglob("*.py")}


def _part(module: str) -> int:
    """The rank in PARTS of `module`'s part: its longest matching prefix."""
    matches = [(len(prefix), rank) for rank, (_, prefixes) in enumerate(PARTS)
               for prefix in prefixes
               if module == prefix or (prefix != "dbo" and module.startswith(prefix + "."))]
    assert matches, f"{module} is in no part of PARTS"
    return max(matches)[1]


def _imports(path: Path) -> set[str]:
    """The dbo modules `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                whole = f"{node.module}.{alias.name}"
                found.add(whole if whole in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in MODULES and module != _name(path)}


GRAPH = {module: _imports(path) for module, path in MODULES.items()}


def test_every_part_imports_only_the_parts_below_it() -> None:
    upward = [f"{module} ({PARTS[_part(module)][0]}) imports {target} ({PARTS[_part(target)][0]})"
              for module, targets in GRAPH.items() for target in targets
              if _part(target) > _part(module)]
    assert not upward, upward


def test_the_import_graph_of_dbo_has_no_cycle() -> None:
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError(" -> ".join((*path[path.index(module):], module)))
        if module in done:
            return
        for target in sorted(GRAPH[module]):
            if target != "dbo" and not module.startswith(target + "."):  # a parent package
                visit(target, (*path, module))
        done.add(module)

    for module in sorted(GRAPH):
        visit(module, ())


def test_the_parts_are_folders_and_a_few_top_modules() -> None:
    folders = sorted(path.name for path in DBO.iterdir()
                     if path.is_dir() and (path / "__init__.py").exists())
    assert folders == ["device", "hf", "runtime", "split"]
    assert len(list(DBO.glob("*.py"))) <= 12


def test_transformers_is_imported_only_under_dbo_hf_and_not_by_its_init() -> None:
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        reaches = any(name == "transformers" or name.startswith("transformers.") for name in names)
        if not module.startswith("dbo.hf.") or module == "dbo.hf":
            assert not reaches, f"{module} imports transformers"
