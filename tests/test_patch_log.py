"""`_patch_log`: the tests' record of the document patches a served page sent, read back for
a BokehJS "reference pNNNN isn't known" error."""
from __future__ import annotations

import _patch_log
from bokeh.document import Document
from bokeh.models import Column, Div
from bokeh.protocol import Protocol


def test_a_patch_naming_a_model_is_found_by_its_id():
    _patch_log.install()
    _patch_log.install()                                        # once, however often called
    doc = Document()
    old, new = Div(text="a"), Div(text="b")
    column = Column(children=[old])
    doc.add_root(column)
    events = []
    doc.on_change(lambda event: events.append(event))
    old.text = "changed"
    column.children = [new]
    Protocol().create("PATCH-DOC", events)
    found = _patch_log.mentions(old.id)
    assert len(found) == 1 and f"Div {old.id} .text" in found[0], found
    assert _patch_log.mentions(new.id) and new.id in _patch_log.mentions(new.id)[0]
    report = _patch_log.explain(f"Error: reference {new.id} isn't known")
    assert f"server patches naming {new.id}" in report and f"Column {column.id} .children" in report
    assert _patch_log.explain("TypeError: x is undefined") == ""
    assert "none recorded" in _patch_log.explain("Error: reference p999999999 isn't known")
