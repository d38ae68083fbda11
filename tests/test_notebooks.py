"""Every notebook under examples/ runs top to bottom on the tiny model and shows what it promises.

Each notebook reads its model from ``EXPLORER_EXAMPLE_MODEL`` (default the packaged SmolLM2);
here it is ``tiny-llama`` (random-init: every call runs, the numbers mean nothing), executed with
nbclient in a python3 kernel. Besides "no error", each notebook's outputs must hold the objects
its text promises: an xarray Dataset repr, a HoloViews / Panel plot, a table.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
TINY = "tiny-llama"

# what each notebook's outputs must contain (see `_kinds`); a new notebook must be listed here
EXPECTED = {
    "quickstart.ipynb": {"table", "plot"},
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


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(str(out.get("text", "")))
            parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def test_examples_exist():
    assert NOTEBOOKS, f"no notebooks under {EXAMPLES}"
    assert {p.name for p in NOTEBOOKS} == set(EXPECTED), "list every notebook in EXPECTED"


def test_every_notebook_is_checked_in_jupyterlab():
    """Each notebook has its view cells listed and is in exactly one JupyterLab test file."""
    from _notebook_lab import NOTEBOOK_FILES, VIEW_CELLS

    assert set(VIEW_CELLS) == set(EXPECTED)
    shares = [name for names in NOTEBOOK_FILES.values() for name in names]
    assert sorted(shares) == sorted(EXPECTED)
    assert all((Path(__file__).parent / file).is_file() for file in NOTEBOOK_FILES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    assert all(not c["outputs"] and c["execution_count"] is None for c in code)


def _execute(path: Path):
    """Run one notebook in a fresh python3 kernel; (notebook, seconds, exception or None)."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    try:
        client.execute()  # raises CellExecutionError naming the cell on any error
    except Exception as exc:  # reported by the notebook's own test below
        return nb, time.perf_counter() - start, exc
    return nb, time.perf_counter() - start, None


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Every notebook executed on the tiny model, two kernels at a time (their start-up,
    mostly imports, dominates the run time)."""
    pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    facts = tmp_path_factory.mktemp("notebooks") / "facts.json"
    facts.write_text(json.dumps(TINY_FACTS))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXPLORER_EXAMPLE_MODEL", TINY)      # the kernels inherit the environment
        mp.setenv("EXPLORER_EXAMPLE_FACTS", str(facts))
        mp.setenv("EXPLORER_EXAMPLE_KNOWLEDGE", json.dumps(TINY_KNOWLEDGE))
        with ThreadPoolExecutor(max_workers=2) as pool:
            return dict(zip([p.name for p in NOTEBOOKS], pool.map(_execute, NOTEBOOKS)))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, executed):
    nb, seconds, exc = executed[path.name]
    if exc is not None:
        raise exc
    errors = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors
    shown = set().union(*(_kinds(out) for cell in nb.cells if cell.cell_type == "code"
                          for out in cell.get("outputs", [])))
    missing = EXPECTED[path.name] - shown
    assert not missing, f"{path.name} shows no {sorted(missing)}"
    source = "".join(c.source for c in nb.cells if c.cell_type == "code")
    if "EXPLORER_EXAMPLE_MODEL" in source:  # it ran on the tiny model, not the packaged one
        assert TINY in _text(nb)
    print(f"{path.name}: {seconds:.1f} s")
