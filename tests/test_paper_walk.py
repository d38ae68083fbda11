"""scripts/paper_walk.py's reading of what a page shows: a number as the card writes it against
the JSON's, and the items of the differs line."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from explorer import paper_settings as P

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def walk():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location("paper_walk", ROOT / "scripts" / "paper_walk.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "scripts"))


@pytest.mark.parametrize("shown, value, equal", [
    ("0.479", 0.479017, True),            # three decimals: within 0.0005
    ("0.479", 0.4796, False),
    ("0.000999", 0.000999000999, True),
    ("0.000999", 0.00099, False),
    ("1,221,120", 1221120.0, True),       # thousands separators
    ("1,221,120", 1221121.0, False),
    ("2", 2.0, True),
    ("2", 3.0, False),
    ("1.2e-05", 1.23e-05, True),          # 1.2e-05: one decimal of 1e-05, within 5e-07
    ("1.2e-05", 1.3e-05, False),
    ("−0.25", -0.25, True),               # a typographic minus
    ("n/a", 0.0, False),
])
def test_a_shown_number_equals_the_json_to_the_digits_shown(walk, shown, value, equal):
    assert walk._shown_equals(shown, value) is equal


def test_the_differs_items_are_the_differences_in_words(walk):
    current = {"induction_sequences": 4, "induction_measure": "mul", "exclude_other": True}
    line = P.differs_line("icl-heads", current)
    assert walk._items(line) == ["induction sequences 4 (paper: 1,000)",
                                 "induction measure mul (paper: abs)"]


def test_the_differs_items_of_a_line_with_none_and_of_a_training_page(walk):
    assert walk._items(P.differs_line("icl-heads", P.page_values("icl-heads"))) == []
    line = ("Differs from the paper: the shown run was trained with layers 3 (paper: 12). "
            "Train the paper's setting with `explorer task-emergence train --paper`.")
    assert walk._items(line) == ["the shown run was trained with layers 3 (paper: 12)"]
