"""Docs and tests speak of the software: no tracker issue numbers, no account of how the work went.

What the software does and what was measured belongs in the docs (with the date and the
command); the history of the work belongs in commit messages. This scans every Markdown file
the project ships and every test module.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\s*\d+|\(#\d+\)", re.IGNORECASE)
"""A reference to a tracker issue by number (the word, a number after it, or "(#" and a number)."""

HISTORY = re.compile(r"\b(first version|earlier default|before the default changed|"
                     r"(this|last|previous|earlier) (development )?session|the issue asks)\b",
                     re.IGNORECASE)
"""Phrases that tell how the work went rather than what the software does."""


def _markdown_files() -> list[Path]:
    """The project's Markdown files: not those in folders that tools write (the ones
    .gitignore names, e.g. pytest's cache with its README), so a fresh clone and a worked-in
    checkout check the same files."""
    skip = {".venv", ".git", "node_modules", ".pytest_cache", "test-artifacts", "build", "dist",
            ".ipynb_checkpoints", ".whl", ".gl", "__pycache__"}
    return sorted(p for p in ROOT.rglob("*.md")
                  if not skip.intersection(p.relative_to(ROOT).parts)
                  and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts))


def _test_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name)


def _hits(path: Path, pattern: re.Pattern[str]) -> list[str]:
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in pattern.finditer(line):
            out.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    return out


def test_the_patterns_catch_what_they_are_for() -> None:
    word = "issue"                       # spelled apart so this file holds no such reference
    for text in (f"see {word} 21.", f"{word.title()} 21's story", f"({word} 25)",
                 f"{word}s 5 and 6", "fixed (" + "#12)"):
        assert ISSUE_NUMBER.search(text), text
    for text in ("an issue with the tokenizer", "github.com/org/repo/issues", "tissue 4"):
        assert not ISSUE_NUMBER.search(text), text
    for text in ("The first version reached", "The earlier default memorised",
                 "measured with EAP, before the default changed", "on this session's machine",
                 "The issue asks for a slider"):
        assert HISTORY.search(text), text
    assert not HISTORY.search("the server keeps one workspace per browser session")


@pytest.mark.parametrize("path", _markdown_files() + _test_modules(),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_numbers(path: Path) -> None:
    assert _hits(path, ISSUE_NUMBER) == []


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_state_what_is_not_how_it_went(path: Path) -> None:
    assert _hits(path, HISTORY) == []
