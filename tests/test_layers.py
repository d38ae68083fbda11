"""The layering rules of DESIGN.md, checked by import-linter and by a scan for dynamic imports.

apps -> commands / bench -> analyses -> core: the core imports no UI library and no analysis,
analyses import neither apps nor the command layer, nothing under explorer/ imports apps
statically, and only the command layer (explorer/cli.py, explorer/commands/) loads apps with
``importlib`` (`explorer serve`, the page benches).
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Files allowed to load a module of apps/ with importlib: the command layer only.
DYNAMIC_APP_IMPORTS_ALLOWED = ("explorer/cli.py", "explorer/commands/")


def _lint_imports() -> str:
    exe = Path(sys.executable).with_name("lint-imports")
    exe = str(exe) if exe.exists() else shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: the test set-up (pip install -e '.[test]') "
                    "installs import-linter")
    return exe


def test_import_contracts_are_kept():
    """Every import-linter contract in pyproject.toml holds on the tree."""
    out = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " 0 broken." in out.stdout.split("Contracts:")[-1]


def test_contracts_catch_a_forbidden_import(tmp_path):
    """The contracts fail on a tree where an analysis imports an app (so they are not vacuous)."""
    for package in ("explorer", "apps"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bad = tmp_path / "explorer" / "analyses" / "_layer_break.py"
    bad.write_text("import apps.theme\n")
    env_path = f"{tmp_path}"
    out = subprocess.run([_lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0
    assert "explorer.analyses._layer_break -> apps.theme" in out.stdout


def test_contracts_catch_an_import_cycle_among_pages(tmp_path):
    """The apps/ cycle contract fails on a tree where a page's part imports its page back
    inside a function (as a timing harness in a page part would)."""
    for package in ("explorer", "apps"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    part = tmp_path / "apps" / "_lens_preview.py"
    part.write_text(part.read_text() + "\n\ndef _back():\n    from apps.lens import LensView\n")
    out = subprocess.run([_lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": f"{tmp_path}", "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "1 broken." in out.stdout
    broken = " ".join(out.stdout.split("Broken contracts")[-1].split())
    assert "No import cycles among the modules of apps/" in broken
    assert ".lens -> ._lens_preview" in broken


def _dynamic_app_imports(path: Path) -> list[int]:
    """Lines of ``importlib.import_module("apps...")`` / ``__import__("apps...")`` calls."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        arg = node.args[0]
        if (name in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str) and arg.value.split(".")[0] == "apps"):
            lines.append(node.lineno)
    return lines


def test_only_the_command_layer_loads_apps_dynamically():
    offenders = []
    for path in sorted((ROOT / "explorer").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(DYNAMIC_APP_IMPORTS_ALLOWED):
            continue
        offenders += [f"{rel}:{line}" for line in _dynamic_app_imports(path)]
    assert offenders == [], f"apps loaded outside the command layer: {offenders}"


def test_dynamic_import_scan_finds_a_call(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(textwrap.dedent("""
        import importlib
        x = importlib.import_module("apps.gallery")
        y = importlib.import_module("explorer.models")
    """))
    assert _dynamic_app_imports(src) == [3]


def test_pages_come_in_parts_a_person_can_hold_in_mind():
    """No file of apps/ over 700 lines and no class over 400 (a page is a composition of
    parts; see docs/architecture.md)."""
    long_files, long_classes = [], []
    for path in sorted((ROOT / "apps").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 700:
            long_files.append((path.name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                long_classes.append((path.name, node.name, node.end_lineno - node.lineno + 1))
    assert not long_files and not long_classes, (long_files, long_classes)


def test_analyses_come_in_modules_of_one_concern():
    """No module of explorer/analyses/ over 600 lines: a method with more concerns is a package
    of one module per concern (circuits/, icl_heads/, saturation/, ...)."""
    lines = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8").count("\n")
             for path in sorted((ROOT / "explorer" / "analyses").rglob("*.py"))}
    assert len(lines) > 50                      # the scan reads the tree, sub-packages included
    long = {name: n for name, n in lines.items() if n > 600}
    assert not long, long


def test_benchmarks_and_scripts_load_the_default_model_by_its_constant():
    """benchmarks/ and scripts/ name the default model as `explorer.defaults.DEFAULT_MODEL`,
    never by its spelling (the scan of `tests/test_public_seams.py`, over these folders)."""
    from explorer.defaults import DEFAULT_MODEL
    from tests.test_public_seams import default_model_spellings

    paths = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")])
    assert len(paths) > 10
    found = [f"{p.relative_to(ROOT).as_posix()}:{line}" for p in paths
             for line in default_model_spellings(p, DEFAULT_MODEL)]
    assert found == [], f"the default model spelled instead of DEFAULT_MODEL: {found}"

