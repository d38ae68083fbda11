"""`apps.notebook.extension`: what a widget's change sends to a notebook links nothing outside it.

A Panel layout is rendered as in a notebook (a comm, `config.inline`), then changed the way a
widget's callback changes it (a pane's new text, a new child). The update Panel sends over the
comm (`panel.io.model.diff`) must link no style sheet on Panel's CDN and carry the installed
copy of the one it would have linked (`panel/dist/css/loading.css`), read here from the file.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pn = pytest.importorskip("panel")


@pytest.fixture
def notebook_extension(monkeypatch):
    """`extension()` for this test; Panel's and HoloViews' hooks it sets are put back after."""
    import holoviews as hv
    from holoviews.core.dimension import LabelledData
    from panel.io import model as panel_model

    from apps import notebook

    monkeypatch.setattr(panel_model, "monkeypatch_events", panel_model.monkeypatch_events)
    monkeypatch.setattr(pn.config, "inline", pn.config.inline)
    monkeypatch.setitem(hv.Store._display_hooks["html+js"], LabelledData,
                        hv.Store._display_hooks["html+js"].get(LabelledData))
    notebook.extension()


@pytest.fixture(autouse=True)
def loaded(monkeypatch):
    """Panel renders a notebook output only once its extension ran in a notebook (this test
    runs in no kernel: the flag is set as the kernel's extension call sets it)."""
    from panel.config import panel_extension

    monkeypatch.setattr(panel_extension, "_loaded", True)


def _rendered_in_notebook(layout):
    """The layout's root model and document as a notebook output holds them."""
    from panel.io.state import state

    layout._repr_mimebundle_()
    # keyed by the root's id; with a design set (the gallery's theme) the root is the design's
    # wrapper around ``layout``, so the layout is found by the root it has a model under
    ref = next(ref for ref in state._views if ref in layout._models)
    _, root, doc, comm = state._views[ref]
    return root, doc, comm


def _update_sent(layout, change) -> tuple[str, list[dict]]:
    """The JSON patch Panel sends over the comm for ``change()`` on a rendered ``layout``,
    and the style sheet models in it (name and attributes)."""
    from panel.io import notebook as panel_notebook

    sent = []
    original = panel_notebook.send
    panel_notebook.send = lambda comm, msg: sent.append(msg.content_json)
    try:
        _, _, comm = _rendered_in_notebook(layout)
        comm._comm = comm  # as if the notebook had opened it: Panel sends at once (to `sent`)
        change()
    finally:
        panel_notebook.send = original
    sheets: list[dict] = []

    def walk(value):
        if isinstance(value, dict):
            if value.get("type") == "object" and str(value.get("name", "")).endswith("StyleSheet"):
                sheets.append({"name": value["name"], **value.get("attributes", {})})
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for content in sent:
        walk(json.loads(content))
    return "".join(sent), sheets


def _change(layout, text):
    """What a widget's callback does to a view: a pane's new text, a new child."""
    def change():
        text.object = "after"
        layout.append(pn.pane.HTML("<b>new child</b>"))
    return change


def test_an_update_links_no_style_sheet_on_panels_cdn(notebook_extension):
    from panel.io.resources import CDN_DIST, DIST_DIR

    loading_css = (Path(DIST_DIR) / "css" / "loading.css").read_text(encoding="utf-8")
    text = pn.pane.Markdown("before")
    layout = pn.Column(text)
    sent, sheets = _update_sent(layout, _change(layout, text))
    assert "new child" in sent and "after" in sent, "the change was not sent"
    assert CDN_DIST not in sent, f"the update links Panel's CDN: {sent[sent.index(CDN_DIST) - 80:][:240]}"
    assert not [s for s in sheets if s["name"] == "ImportedStyleSheet"
                and str(s.get("url", "")).startswith("http")], sheets
    # the style sheet the new child would have linked travels inline, as the file has it
    assert loading_css in [s.get("css") for s in sheets if s["name"] == "InlineStyleSheet"]


def test_without_the_extension_the_same_update_links_the_cdn():
    """The case the extension exists for: Panel alone links its CDN in that update."""
    from panel.io import model as panel_model
    from panel.io.resources import CDN_DIST

    assert not getattr(panel_model.monkeypatch_events, "_inlines_style_sheets", False)
    inline = pn.config.inline
    pn.config.inline = True
    try:
        text = pn.pane.Markdown("before")
        layout = pn.Column(text)
        sent, sheets = _update_sent(layout, _change(layout, text))
    finally:
        pn.config.inline = inline
    assert "new child" in sent
    assert f"{CDN_DIST}css/loading.css" in [str(s.get("url", "")).split("?")[0] for s in sheets]


@pytest.mark.slow
def test_a_page_imported_after_the_extension_displays_no_second_bokehjs(tmp_path):
    """In a kernel: `extension()` loads BokehJS once; importing a page module afterwards (it
    calls ``hv.extension("bokeh")``) displays nothing, where HoloViews alone would display
    the inline BokehJS again (megabytes per page)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    root = Path(__file__).resolve().parents[1]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"import sys; sys.path.insert(0, {str(root)!r})\n"
                                          "from apps import notebook\nnotebook.extension()"),
                nbformat.v4.new_code_cell("import apps.lens"),
                nbformat.v4.new_code_cell("import holoviews as hv\n"
                                          "hv.extension._inner('bokeh', logo=False)")]
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    size = [len(json.dumps(cell.get("outputs", []))) for cell in nb.cells]
    assert size[0] > 1_000_000          # the extension: BokehJS and Panel's scripts inline
    assert size[1] < 10_000             # the page import: nothing displayed again
    assert size[2] > 1_000_000          # HoloViews' own call would display it again
