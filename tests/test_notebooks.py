"""Every notebook under examples/ is stored without outputs and promises what it shows.

Each notebook reads its model from ``EXPLORER_EXAMPLE_MODEL`` (default the packaged SmolLM2).
The JupyterLab tests (tests/_notebook_lab.py) run each one top to bottom there on
``tiny-llama`` (random-init: every call runs, the numbers mean nothing), save it from the Lab
and check the saved file with `check_outputs`: besides "no error", its outputs must hold the
objects its text promises (`EXPECTED`): an xarray Dataset repr, a HoloViews / Panel plot, a table.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
TINY = "tiny-llama"

# what each notebook's outputs must contain (see `_kinds`); a new notebook must be listed here
EXPECTED = {
    "quickstart.ipynb": {"dataset", "table", "plot"},
    "lens_saturation.ipynb": {"dataset", "table", "plot"},
    "conflicts.ipynb": {"dataset", "table", "plot"},
    "icl_heads.ipynb": {"dataset", "table", "plot"},
    "circuits.ipynb": {"dataset", "table", "plot"},
    "representations.ipynb": {"dataset", "table", "plot"},
    "dynamics.ipynb": {"table", "plot"},
    "editing_unlearning.ipynb": {"dataset", "table", "plot"},
    "workspace_atlas.ipynb": {"dataset", "table", "plot"},
}

# attributes whose first tokens the tiny byte-level tokenizer tells apart (the shipped sports do not)
TINY_FACTS = {
    "attributes": ["blue", "dog", "moon"],
    "templates": {"trained": "Fact: {subject} likes the",
                  "mc": "Q: What does {subject} like? Options: {options}\nA: {subject} likes the"},
    "facts": [[f"Person {a}{b}", ["blue", "dog", "moon"][i % 3]]
              for i, (a, b) in enumerate((a, b) for a in "ABCD" for b in "xyz")],
}


# the knowledge model of editing_unlearning's part 1: small and briefly trained (the shipped one
# trains for 12000 steps, minutes on 2 cores, before the cache holds it)
TINY_KNOWLEDGE = dict(n_entities=16, n_orders=2, max_hops=2, walk_length=4, d_model=32, n_heads=2,
                      d_mlp=64, steps=20, batch_size=64, lr=1e-2, seed=0)


def _kinds(output: dict) -> set[str]:
    """What one cell output shows: a Dataset repr, a plot (HoloViews / Panel), a table."""
    data = output.get("data", {})
    text = data.get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    html = data.get("text/html", "")
    html = "".join(html) if isinstance(html, list) else html
    kinds = set()
    if text.startswith("<xarray.Dataset>"):
        kinds.add("dataset")
    if "application/vnd.holoviews_exec.v0+json" in data:
        kinds.add("plot")
    if "<table" in html and "dataframe" in html:
        kinds.add("table")
    return kinds


def _text(cells: list[dict]) -> str:
    """The cells' printed text and plain-text outputs."""
    parts = []
    for cell in cells:
        for out in cell.get("outputs", []):
            for text in (out.get("text", ""), out.get("data", {}).get("text/plain", "")):
                parts.append("".join(text) if isinstance(text, list) else str(text))
    return "\n".join(parts)


def test_examples_exist():
    assert NOTEBOOKS, f"no notebooks under {EXAMPLES}"
    assert {p.name for p in NOTEBOOKS} == set(EXPECTED), "list every notebook in EXPECTED"


def test_every_notebook_is_checked_in_jupyterlab():
    """Each notebook has its view cells listed and is run once by the JupyterLab test file."""
    from _notebook_lab import LAB_NOTEBOOKS, VIEW_CELLS

    assert set(VIEW_CELLS) == set(EXPECTED)
    assert sorted(LAB_NOTEBOOKS) == sorted(EXPECTED)
    assert (Path(__file__).parent / "test_browser_notebooks.py").is_file()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    assert all(not c["outputs"] and c["execution_count"] is None for c in code)


def check_outputs(nb: dict, name: str) -> None:
    """What a notebook run top to bottom on the tiny model must hold (``nb`` as saved, JSON):
    every code cell ran, no cell output is an error, its outputs show what `EXPECTED` lists,
    and a notebook that reads ``EXPLORER_EXAMPLE_MODEL`` ran on the tiny model. The example
    notebooks are run in JupyterLab (`_notebook_lab.check_in_lab`), saved there and checked
    here."""
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    unrun = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not unrun, f"{name}: code cells {unrun} did not run"
    outputs = [out for c in code for out in c.get("outputs", [])]
    errors = [out for out in outputs if out.get("output_type") == "error"]
    assert not errors, f"{name}: {[(e.get('ename'), e.get('evalue')) for e in errors]}"
    shown = set().union(*(_kinds(out) for out in outputs))
    missing = EXPECTED[name] - shown
    assert not missing, f"{name} shows no {sorted(missing)}"
    source = "".join("".join(c["source"]) for c in code)
    if "EXPLORER_EXAMPLE_MODEL" in source:  # it ran on the tiny model, not the packaged one
        assert TINY in _text(code), f"{name} did not run on {TINY}"
