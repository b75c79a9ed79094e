"""The layout rules of the source tree (DESIGN.md §2), checked by reading src/tandem with `ast`,
never importing it:

* engine/ takes from kv/ only the connector's interfaces (`tandem.kv.connector.base`) and its
  factory (`tandem.kv.connector`, which holds `make_connectors`);
* nothing in kv/ imports the scheduler's `Request` (`tandem.engine.request`);
* router/ and pd/ import nothing of torch, the engine, the executor or the models, directly or
  through the tandem modules they import;
* models/ import nothing of scheduling (`tandem.engine.scheduler`, `tandem.engine.request`);
* no module is over 500 lines, and every module that holds anything opens with a docstring of
  at most 25 lines.

Every import counts, wherever it is written (in a function, under `if TYPE_CHECKING:`). Through
other modules, imports are followed as they can run: a function's too (a call loads it), but not
a type-only one, nor a module's `__getattr__` (PEP 562: it runs when a name is looked up, as
`tandem`'s lazy `LLM`, not when a submodule is imported). Each rule also runs over a small
made-up tree that breaks it, so a checker that sees nothing fails. One runtime check joins them:
importing the router's app in a fresh interpreter leaves torch out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_MODULE_LINES = 500
MAX_DOCSTRING_LINES = 25

ENGINE_MAY_IMPORT_FROM_KV = frozenset({"tandem.kv.connector.base", "tandem.kv.connector"})
REQUEST_MODULE = "tandem.engine.request"
TORCH_FREE_PACKAGES = ("tandem.router", "tandem.pd")
NOT_FOR_TORCH_FREE = ("torch", "tandem.engine", "tandem.executor", "tandem.models")
SCHEDULING_MODULES = frozenset({"tandem.engine.scheduler", REQUEST_MODULE})


@dataclass(frozen=True)
class Import:
    target: str  # the module imported, absolute (a `from m import name` of a submodule: m.name)
    names: tuple[str, ...]  # what a `from` import takes from it
    line: int
    followed: bool  # may run (not type-only, not in __getattr__): followed through its module


class SourceTree:
    """The modules under one source root (the folder holding the `tandem` package)."""

    def __init__(self, root: Path) -> None:
        self.paths: dict[str, Path] = {}
        for path in sorted((root / "tandem").rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            self.paths[".".join(parts)] = path
        self._imports: dict[str, list[Import]] = {}

    def modules(self, package: str) -> list[str]:
        return [name for name in self.paths if in_package(name, package)]

    def imports(self, module: str) -> list[Import]:
        if module not in self._imports:
            path = self.paths[module]
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            tree = ast.parse(path.read_text(), str(path))
            self._imports[module] = list(self._walk(tree, package, True))
        return self._imports[module]

    def _walk(self, node: ast.AST, package: str, followed: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child.test):
                for statement in child.body:
                    yield from self._walk_one(statement, package, False)
                for statement in child.orelse:
                    yield from self._walk_one(statement, package, followed)
            else:
                yield from self._walk_one(child, package, followed)

    def _walk_one(self, node: ast.AST, package: str, followed: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, (), node.lineno, followed)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = tuple(alias.name for alias in node.names)
            yield Import(base, names, node.lineno, followed)
            for name in names:
                if f"{base}.{name}" in self.paths:
                    yield Import(f"{base}.{name}", (), node.lineno, followed)
        else:
            lazy_attribute = isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
            yield from self._walk(node, package, followed and not lazy_attribute)

    def loaded_by(self, module: str) -> dict[str, str]:
        """Every module importing `module` loads (packages above each one included), each with
        the tandem module whose import brought it in."""
        loaded: dict[str, str] = {}
        todo = [module]
        while todo:
            importer = todo.pop()
            for found in self.imports(importer):
                if importer != module and not found.followed:
                    continue
                for name in with_parents(found.target):
                    if name not in loaded:
                        loaded[name] = importer
                        if name in self.paths:
                            todo.append(name)
        return loaded


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


# -- the rules: each gives its violations as sentences -------------------------------------------


def engine_imports_from_kv(tree: SourceTree) -> list[str]:
    return [
        f"{module}:{found.line} imports {found.target}"
        for module in tree.modules("tandem.engine")
        for found in tree.imports(module)
        if in_package(found.target, "tandem.kv") and found.target not in ENGINE_MAY_IMPORT_FROM_KV
    ]


def kv_imports_request(tree: SourceTree) -> list[str]:
    return [
        f"{module}:{found.line} imports {found.target} {', '.join(found.names)}".rstrip()
        for module in tree.modules("tandem.kv")
        for found in tree.imports(module)
        if found.target == REQUEST_MODULE
        or (in_package(found.target, "tandem.engine") and "Request" in found.names)
    ]


def torch_free_imports(tree: SourceTree) -> list[str]:
    violations = []
    for package in TORCH_FREE_PACKAGES:
        for module in tree.modules(package):
            for name, importer in tree.loaded_by(module).items():
                if any(in_package(name, banned) for banned in NOT_FOR_TORCH_FREE):
                    violations.append(f"{module} loads {name} (imported by {importer})")
    return violations


def models_import_scheduling(tree: SourceTree) -> list[str]:
    return [
        f"{module}:{found.line} imports {found.target}"
        for module in tree.modules("tandem.models")
        for found in tree.imports(module)
        if found.target in SCHEDULING_MODULES
    ]


def long_modules(tree: SourceTree) -> list[str]:
    return [
        f"{module}: {count} lines"
        for module, path in tree.paths.items()
        if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]


def missing_or_long_docstrings(tree: SourceTree) -> list[str]:
    violations = []
    for module, path in tree.paths.items():
        body = ast.parse(path.read_text(), str(path)).body
        if not body:
            continue  # an empty __init__
        first = body[0]
        if not (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            violations.append(f"{module}: opens with no docstring")
        elif (count := first.end_lineno - first.lineno + 1) > MAX_DOCSTRING_LINES:
            violations.append(f"{module}: a docstring of {count} lines")
    return violations


RULES = [
    engine_imports_from_kv,
    kv_imports_request,
    torch_free_imports,
    models_import_scheduling,
    long_modules,
    missing_or_long_docstrings,
]


@pytest.fixture(scope="module")
def source_tree() -> SourceTree:
    return SourceTree(SRC)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_the_tree_keeps_the_rule(source_tree, rule):
    assert rule(source_tree) == []


def test_the_reader_sees_the_imports_it_checks(source_tree):
    """The rules read real imports: the scheduler's of the connector, the router's of pd."""
    assert "tandem.kv.connector.base" in {
        found.target for found in source_tree.imports("tandem.engine.scheduler")
    }
    assert "tandem.pd.handoff" in source_tree.loaded_by("tandem.router.flows")
    assert len(source_tree.modules("tandem.router")) > 5


# -- a made-up tree that breaks every rule -------------------------------------------------------

DOC = '"""A module."""\n'
BROKEN_TREE = {
    "tandem/__init__.py": DOC
    + "def __getattr__(name):\n    from tandem.engine.llm import LLM\n    return LLM\n",
    "tandem/engine/__init__.py": "",
    "tandem/engine/llm.py": DOC + "import torch\n",
    "tandem/engine/request.py": DOC + "class Request: ...\n",
    "tandem/engine/scheduler.py": DOC
    + "from tandem.kv.connector.base import X\nfrom ..kv.control import plane\n",
    "tandem/kv/__init__.py": "",
    "tandem/kv/connector/__init__.py": DOC,
    "tandem/kv/connector/base.py": DOC
    + "from typing import TYPE_CHECKING\n"
    + "if TYPE_CHECKING:\n    from tandem.engine import request\n",
    "tandem/kv/control/__init__.py": DOC,
    "tandem/kv/control/plane.py": DOC + "def f():\n    from tandem.engine.outputs import Request\n",
    "tandem/router/__init__.py": DOC,
    "tandem/router/app.py": DOC + "from tandem.router import flows\nimport tandem\n",
    "tandem/router/flows.py": DOC + "from tandem.server import helper\n",
    "tandem/server/__init__.py": DOC,
    "tandem/server/helper.py": DOC + "import torch.nn\nimport tandem.models.x\n",
    "tandem/models/__init__.py": DOC,
    "tandem/models/x.py": DOC + "from tandem.engine.scheduler import Scheduler\n",
    "tandem/pd/__init__.py": '"""A docstring\n' + "of many lines\n" * 30 + '"""\n',
    "tandem/pd/long.py": "x = 1\n" * (MAX_MODULE_LINES + 1),
}

EXPECTED_VIOLATIONS = {
    "engine_imports_from_kv": [
        "tandem.engine.scheduler:3 imports tandem.kv.control",
        "tandem.engine.scheduler:3 imports tandem.kv.control.plane",
    ],
    "kv_imports_request": [
        "tandem.kv.connector.base:4 imports tandem.engine.request",
        "tandem.kv.control.plane:3 imports tandem.engine.outputs Request",
    ],
    "torch_free_imports": [
        f"{module} loads {name} (imported by {importer})"
        for module in ("tandem.router.app", "tandem.router.flows")
        for name, importer in [
            ("torch", "tandem.server.helper"),
            ("torch.nn", "tandem.server.helper"),
            ("tandem.models", "tandem.server.helper"),
            ("tandem.models.x", "tandem.server.helper"),
            ("tandem.engine", "tandem.models.x"),
            ("tandem.engine.scheduler", "tandem.models.x"),
            ("tandem.engine.outputs", "tandem.kv.control.plane"),  # a function's import
        ]
    ],
    "models_import_scheduling": ["tandem.models.x:2 imports tandem.engine.scheduler"],
    "long_modules": [f"tandem.pd.long: {MAX_MODULE_LINES + 1} lines"],
    "missing_or_long_docstrings": [
        "tandem.pd: a docstring of 32 lines",
        "tandem.pd.long: opens with no docstring",
    ],
}


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_a_broken_tree_breaks_the_rule(tmp_path, rule):
    for relative, text in BROKEN_TREE.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = rule(SourceTree(tmp_path))
    assert sorted(found) == sorted(EXPECTED_VIOLATIONS[rule.__name__])


def test_the_router_app_loads_without_torch():
    """The import itself, in a fresh interpreter: third-party modules count here too."""
    check = "import sys, tandem.router.app; print(sorted(m for m in sys.modules if m == 'torch'))"
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"
