"""No module of explorer/ or apps/ reaches into another package's private names.

What one package needs from another is public API (a name without a leading underscore, with
a docstring). The scan walks the syntax tree of every module under explorer/ and apps/ and
reports each ``from X import _name`` and each ``X._name`` where ``X`` is a module of this
project (explorer/ or apps/) in *another package*.

Definitions the scan uses:

* A module's package is the dotted path of the folder that holds it: ``explorer/commands/
  circuits.py`` and ``explorer/commands/__init__.py`` are both in package ``explorer.commands``;
  ``explorer/models.py`` is in ``explorer``. A sub-package is another package: ``explorer``,
  ``explorer.analyses`` and ``explorer.analyses.saturation`` are three.
* A private name starts with one underscore and is not a dunder (``_adapter``, not ``__all__``).
  Private *modules* (``explorer._checks``, ``explorer.commands._common``) may be imported from
  anywhere; their public names are the seam, their private names are not.
* ``X`` is resolved through the module's imports: ``import explorer.analyses.circuits as ca``
  then ``ca._forward``, ``from explorer.analyses import saturation as sat`` then
  ``sat._analyse``, relative imports included.

Third-party modules are outside the scan (their private names are their authors' matter).
Tests are outside it too: a test may check a private helper of the module it tests.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("explorer", "apps")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(root: Path, dotted: str) -> bool:
    return (root.joinpath(*dotted.split(".")) / "__init__.py").is_file()


def _is_module(root: Path, dotted: str) -> bool:
    if not dotted or dotted.split(".")[0] not in PACKAGES:
        return False
    return root.joinpath(*dotted.split(".")).with_suffix(".py").is_file() or _is_package(root, dotted)


def _package_of(root: Path, dotted: str) -> str:
    return dotted if _is_package(root, dotted) else dotted.rpartition(".")[0]


def _import_source(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_reaches(root: Path, path: Path) -> list[str]:
    """``"file:line target"`` for each private name of another package's module used in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _package_of(root, _module_name(root, path))
    rel = path.relative_to(root).as_posix()
    modules: dict[str, str] = {}         # local name -> the first-party module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:
                    modules[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _import_source(node, here)
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if _is_module(root, full):
                    modules[alias.asname or alias.name] = full
                elif (_is_private(alias.name) and _is_module(root, source)
                      and _package_of(root, source) != here):
                    found.append(f"{rel}:{node.lineno} {full}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in modules:
            continue
        target = ".".join([modules[value.id], *reversed(chain)])
        if _is_module(root, target) and _package_of(root, target) != here:
            found.append(f"{rel}:{node.lineno} {target}.{node.attr}")
    return found


@pytest.mark.slow
def test_no_private_names_are_used_across_packages():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += private_reaches(ROOT, path)
    assert found == [], "private names used across packages:\n" + "\n".join(found)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_scan_finds_each_kind_of_reach(tmp_path):
    root = _tree(tmp_path, {
        "explorer/__init__.py": "",
        "explorer/models.py": "def _get(): pass\n",
        "explorer/analyses/__init__.py": "",
        "explorer/analyses/circuits.py": "def _forward(): pass\ndef _adapter(): pass\n",
        "explorer/analyses/saturation/__init__.py": "from explorer.analyses.saturation.a import _x\n",
        "explorer/analyses/saturation/a.py": "def _x(): pass\n",
        "explorer/commands/__init__.py": "",
        "explorer/commands/_common.py": "def json_safe(): pass\ndef _inner(): pass\n",
        "explorer/commands/circuits.py": """
            import explorer.analyses.circuits as ca
            from explorer.analyses import saturation as sat
            from explorer.models import _get
            from . import _common
            from ._common import _inner, json_safe
            from explorer.commands._common import json_safe as js
            import numpy as np
            ca._forward()
            sat.a._x()
            _common._inner()
            np._private()
            def f():
                from ..analyses.circuits import _adapter
        """,
    })
    found = private_reaches(root, root / "explorer/commands/circuits.py")
    assert sorted(line.split(" ", 1)[1] for line in found) == sorted([
        "explorer.models._get",                    # from X import _name, X in another package
        "explorer.analyses.circuits._forward",     # X._name through `import ... as`
        "explorer.analyses.saturation.a._x",       # X.sub._name through a package alias
        "explorer.analyses.circuits._adapter",     # a relative import inside a function
    ])
    # within one package (saturation/__init__ -> saturation/a) private names are fine
    assert private_reaches(root, root / "explorer/analyses/saturation/__init__.py") == []


# -- one default model name -------------------------------------------------------------------

DEFAULT_NAME_HOME = "explorer/defaults.py"


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def default_model_spellings(path: Path, name: str) -> list[int]:
    """Lines of ``path`` that spell the default model: the literal ``name`` in code (docstrings
    aside) or an assignment to a ``DEFAULT_MODEL`` of its own."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstring_nodes(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value == name and id(node) not in docs:
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "DEFAULT_MODEL" for t in targets):
                lines.append(node.lineno)
    return sorted(set(lines))


@pytest.mark.slow
def test_the_default_model_is_named_in_one_place():
    from explorer.defaults import DEFAULT_MODEL
    from explorer.models import known_models

    assert DEFAULT_MODEL in known_models()
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != DEFAULT_NAME_HOME:
                found += [f"{rel}:{line}" for line in default_model_spellings(path, DEFAULT_MODEL)]
    assert found == [], f"the default model spelled outside {DEFAULT_NAME_HOME}: {found}"


def test_default_model_scan_finds_literals_and_constants(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(textwrap.dedent('''
        """Loads smollm2-135m: "smollm2-135m" in a docstring is prose."""
        DEFAULT_MODEL = "other"
        def f(model="smollm2-135m"):
            """default="smollm2-135m"."""
            return model or "smollm2-135m"
    '''))
    assert default_model_spellings(src, "smollm2-135m") == [3, 4, 6]
