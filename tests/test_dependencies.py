"""environment.yml and pyproject.toml list the same dependencies with the same version specs.

pyproject's ``[project] dependencies`` plus every optional group must equal environment.yml's
pip section (plus any conda-level packages other than python and pip); the project itself
(``-e .``) is not a dependency. Names compare after PEP 503 normalisation, specs as sets of
clauses, so ``Scikit_Learn>=1.5,<2`` equals ``scikit-learn<2,>=1.5``. environment.yml's
python pin must satisfy ``requires-python``.
"""
from __future__ import annotations

import re
import textwrap
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[1]

# conda-level entries that are the interpreter and installer, not dependencies
_CONDA_TOOLING = {"python", "pip"}


def _parse(requirement: str) -> tuple[str, str]:
    req = Requirement(requirement)
    spec = ",".join(sorted(str(s) for s in req.specifier))
    if req.marker is not None:
        spec += f"; {req.marker}"
    return canonicalize_name(req.name), spec


def _collect(entries: list[tuple[str, str]], source: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, spec in entries:
        assert name not in out, f"{source} lists {name!r} twice"
        out[name] = spec
    return out


def pyproject_requirements(path: Path) -> tuple[dict[str, str], str]:
    """Normalised name -> spec for every dependency and optional group; and requires-python."""
    project = tomllib.loads(path.read_text())["project"]
    lines = list(project.get("dependencies", []))
    for group in project.get("optional-dependencies", {}).values():
        lines.extend(group)
    return (_collect([_parse(r) for r in lines], path.name),
            project.get("requires-python", ""))


def _is_the_project_itself(entry: str) -> bool:
    return bool(re.match(r"^(-e\s+|--editable\s+)?(\.|\./|/|file:)", entry.strip()))


def environment_requirements(path: Path) -> tuple[dict[str, str], str | None]:
    """Normalised name -> spec from environment.yml; and its python version pin, if any."""
    env = yaml.safe_load(path.read_text())
    entries, python = [], None
    for dep in env.get("dependencies", []):
        if isinstance(dep, dict):
            assert set(dep) == {"pip"}, f"unexpected section in {path.name}: {sorted(dep)}"
            entries += [_parse(r) for r in dep["pip"] if not _is_the_project_itself(r)]
            continue
        # conda match spec: "name", "name=1.2", "name>=1.2"; "=" means ==
        name, op, version = re.match(r"^([A-Za-z0-9_.\-]+)\s*([<>=!~]*)\s*(.*)$", dep).groups()
        if canonicalize_name(name) == "python":
            python = version or None
        if canonicalize_name(name) in _CONDA_TOOLING:
            continue
        op = "==" if op == "=" else op
        entries.append(_parse(f"{name}{op}{version}"))
    return _collect(entries, path.name), python


def dependency_differences(pyproject: Path, environment: Path) -> list[str]:
    """Human-readable differences between the two files; empty when they agree."""
    pp, requires_python = pyproject_requirements(pyproject)
    env, python = environment_requirements(environment)
    problems = []
    for name in sorted(pp.keys() - env.keys()):
        problems.append(f"{name} ({pp[name] or 'any'}) is in pyproject.toml only")
    for name in sorted(env.keys() - pp.keys()):
        problems.append(f"{name} ({env[name] or 'any'}) is in environment.yml only")
    for name in sorted(pp.keys() & env.keys()):
        if pp[name] != env[name]:
            problems.append(f"{name}: pyproject.toml says {pp[name] or 'any'!r}, "
                            f"environment.yml says {env[name] or 'any'!r}")
    if python and requires_python:
        pinned = Version(python.rstrip(".*"))
        if pinned not in SpecifierSet(requires_python):
            problems.append(f"environment.yml pins python {python}, outside requires-python "
                            f"{requires_python!r}")
    return problems


def test_environment_and_pyproject_list_the_same_dependencies():
    assert dependency_differences(REPO_ROOT / "pyproject.toml",
                                  REPO_ROOT / "environment.yml") == []


def test_the_comparison_finds_every_kind_of_difference(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    environment = tmp_path / "environment.yml"
    pyproject.write_text(textwrap.dedent("""
        [project]
        name = "demo"
        requires-python = ">=3.11"
        dependencies = ["numpy>=1.26", "Scikit_Learn>=1.5,<2", "tqdm", "xarray>=2025.1"]
        [project.optional-dependencies]
        test = ["pytest>=8"]
    """))
    environment.write_text(textwrap.dedent("""
        name: demo
        dependencies:
          - python=3.11
          - pip
          - numpy=1.26.4
          - pip:
              - scikit-learn<2,>=1.5
              - TQDM
              - pytest>=8
              - -e .
    """))
    assert dependency_differences(pyproject, environment) == [
        "xarray (>=2025.1) is in pyproject.toml only",
        "numpy: pyproject.toml says '>=1.26', environment.yml says '==1.26.4'",
    ]

    environment.write_text(textwrap.dedent("""
        dependencies:
          - python=3.10
          - pip:
              - numpy>=1.26
              - scikit-learn>=1.5,<2
              - tqdm
              - xarray>=2025.1
              - pytest>=8
              - zarr>=3
    """))
    assert dependency_differences(pyproject, environment) == [
        "zarr (>=3) is in environment.yml only",
        "environment.yml pins python 3.10, outside requires-python '>=3.11'",
    ]

    environment.write_text(environment.read_text().replace("  - zarr>=3\n", "").replace(
        "python=3.10", "python=3.11"))
    assert dependency_differences(pyproject, environment) == []
