"""What the ITDA, Neuron explanations, Head atlas and User study pages say is their shown
result's own (in-process, tiny-llama, small settings).

Each page keeps the record (`apps._provenance.Provenance`) of the inputs its shown result was
computed on; its heading, captions, scope line, export manifest and code are written from that
record. After a compute, an input changed without a recompute (its watchers held with
`param.parameterized.discard_events`: what a served page shows while the recompute runs; a
request the page refuses; a gallery page out of view; a source page moving on) leaves the
words naming the old inputs and a note saying what changed; a recompute empties the note and
the words follow. Expected texts are built from the inputs the test passed.
"""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
from param.parameterized import discard_events

from apps._dictionary_record import dictionary_record, dictionary_stale_text
from apps._provenance import Provenance
from explorer.interventions import Ablate
from explorer.trace import trace

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROBES = ["The cat sat on the mat, 12 times.", "Alice met Bob in Paris on Monday.",
          "One, two, three and 4 apples."]
A = "The cat sat on the mat"
B = "Paris is the capital of"
ABLATE = Ablate(layer=0, head=1)


def _manifest(view) -> dict:
    """The manifest of the page's export (what *Export page data* downloads)."""
    with zipfile.ZipFile(io.BytesIO(view.export_bytes())) as zf:
        return json.loads(zf.read("manifest.json"))


def _pane(view, css: str):
    """The page's one pane with the CSS class ``css``."""
    panes = view.__panel__().select(lambda o: css in (getattr(o, "css_classes", None) or []))
    assert len(panes) == 1, css
    return panes[0]


# -- the words on hand-built records -----------------------------------------------------------

def test_the_stale_text_names_the_shown_dictionary_and_what_changed():
    shown = dictionary_record("itda", "tiny-llama", PROBES, method="itda",
                              request={"layer": 1, "tau": 0.3, "l0": 4, "atom": 0},
                              computed_at="2026-01-02T03:04:05Z")
    assert dictionary_stale_text(shown, shown, state="recomputing.") == ""
    wanted = dictionary_record("itda", "tiny-llama", PROBES[:2], method="itda",
                               request={"layer": 2, "tau": 0.3, "l0": 4, "atom": 0})
    assert dictionary_stale_text(shown, wanted, state="recomputing.") == (
        "Shown: computed on the 3 probing prompts at layer 1 (tau 0.30, L0 4; tiny-llama) at "
        "03:04 UTC; the probing prompts, the layer changed since: recomputing.")
    # the time is not an input; the record reads back from JSON as it was written
    later = Provenance.from_json(shown.to_json())
    assert later == shown and dictionary_stale_text(shown, later) == ""


# -- ITDA --------------------------------------------------------------------------------------

def test_itda_words_and_stale_note_follow_the_shown_dictionary(tiny_model):
    from apps.itda import ITDAView, atom_examples_html, dictionary_heading, tau_caption

    view = ITDAView(tiny_model, background=False, probe_text="\n".join(PROBES), layer=1,
                    tau=0.3, l0=4)
    try:
        on = "the 3 probing prompts at layer 1 (tau 0.30, L0 4; tiny-llama)"
        shown = view.shown_provenance()
        assert shown.prompts == tuple(PROBES) and shown.model == "tiny-llama"
        assert dict(shown.request) == {"layer": 1, "tau": 0.3, "l0": 4, "atom": 0}
        assert dictionary_heading(shown) == f"**ITDA dictionary of {on}**, atom 0 shown"
        assert "on the 3 probing prompts at layer 1 (L0 4; tiny-llama)" in tau_caption(
            view.sweep_shown)
        assert view.sweep.attrs["layer"] == 1                 # the curves' record is theirs
        assert view.stale_note() == "" and not _pane(view, "itda-stale").visible
        assert "its own probing prompts (3," in view.scope().on
        # the controls move, their recompute not landed yet: the words stay the shown ones
        with discard_events(view):
            view.param.update(layer=2, tau=0.2, atom=2)
        note = view.stale_note()
        assert note.startswith(f"Shown: computed on {on} at ")
        assert "the layer, tau, the atom changed since" in note
        assert dictionary_heading(view.shown) == f"**ITDA dictionary of {on}**, atom 0 shown"
        assert "<b>Atom 0</b>" in atom_examples_html(view.examples, view.activations)
        pane = _pane(view, "itda-stale")
        assert pane.visible and pane.object.startswith("<b>Outdated.</b> Shown: computed on")
        code = view.code_snippet()                            # the code is of the shown one
        assert "ITDA(tau=0.3, l0=4)" in code and "layer=1" in code and "atoms=[0]" in code
        assert _manifest(view)["provenance"] == json.loads(shown.to_json())
        # an empty probing set is refused before computing: the old dictionary stays, marked
        view.probe_text = "   "
        assert "probing set is empty" in view.error and view.refused and not view.running
        note = view.stale_note()
        assert note.endswith("the probing prompts, the layer, tau, the atom changed since: the "
                             "page refused the new input (the message above says why); the "
                             "result shown is the old one.")
        assert view.shown == shown
        # the recompute lands: the note goes, the words follow
        view.probe_text = "\n".join(PROBES[:2])
        assert view.stale_note() == "" and not _pane(view, "itda-stale").visible
        after = view.shown_provenance()
        assert after.prompts == tuple(PROBES[:2])
        assert dict(after.request) == {"layer": 2, "tau": 0.2, "l0": 4, "atom": 2}
        assert dictionary_heading(after) == ("**ITDA dictionary of the 2 probing prompts at "
                                             "layer 2 (tau 0.20, L0 4; tiny-llama)**, atom 2 "
                                             "shown")
        assert "<b>Atom 2</b>" in atom_examples_html(view.examples, view.activations)
        code = view.code_snippet()
        assert "ITDA(tau=0.2, l0=4)" in code and "layer=2" in code and PROBES[2] not in code
        manifest = _manifest(view)
        assert manifest["provenance"]["prompts"] == PROBES[:2]
        assert manifest["provenance"]["request"]["layer"] == 2
        ds = view.export_datasets()["examples"]
        assert Provenance.from_json(ds.attrs["page_provenance"]) == after
    finally:
        view.close()


def test_itda_layer_comparison_keeps_its_own_record(tiny_model):
    from apps.itda import ITDAView, similarity_caption

    view = ITDAView(tiny_model, background=False, probe_text="\n".join(PROBES[:2]), layer=1,
                    tau=0.3, l0=4, method="cka", noise=0.05)
    try:
        view.compare = True
        rec = view.similarity_shown
        assert rec.method == "cka" and rec.prompts == tuple(PROBES[:2])
        assert dict(rec.request) == {"noise": 0.05}
        caption = similarity_caption(view.similarity, rec)
        assert caption.startswith("linear CKA of every layer of `tiny-llama` (rows)")
        assert "on the 2 probing prompts;" in caption and view.similarity_stale_note() == ""
        with discard_events(view):
            view.method = "svcca"
        assert "the similarity measure changed since" in view.similarity_stale_note()
        assert similarity_caption(view.similarity, view.similarity_shown).startswith(
            "linear CKA")
        assert "method='cka'" in view.code_snippet()
        assert _manifest(view)["similarity_provenance"]["method"] == "cka"
        view._request_similarity()                            # the comparison lands
        assert view.similarity_stale_note() == "" and view.similarity_shown.method == "svcca"
        assert similarity_caption(view.similarity, view.similarity_shown).startswith("SVCCA")
    finally:
        view.close()


def test_itda_layer_comparison_note_says_what_the_page_is_doing(tiny_model, monkeypatch):
    """The layer comparison's outdated note ends as every page's does, with what the page
    is doing about the newer controls: recomputing (a comparison held in a worker thread),
    press the button (a change no watcher heard), refused (an empty probing set), failed (the
    comparison raised); its caption, heatmap title, code and export stay the shown record's
    until a comparison lands."""
    import threading

    import apps.itda as itda
    from apps._page_provenance import ShownRecord

    states = ShownRecord.stale_states
    real = itda.layer_similarity
    view = itda.ITDAView(tiny_model, background=True, probe_text="\n".join(PROBES[:2]), layer=1,
                         tau=0.3, l0=4, method="cka", noise=0.05).wait(120)
    try:
        view.compare = True
        view.wait(120)
        shown = view.similarity_shown
        assert shown.method == "cka" and view.similarity_stale_note() == ""
        pane = _pane(view, "itda-similarity-stale")
        assert not pane.visible
        on = "Shown: computed on the 2 probing prompts (tiny-llama) at "

        def words() -> tuple[str, str, str]:
            """The caption, the heatmap's title and the exported record's measure."""
            rec = view.similarity_shown
            heat = itda.plot_similarity(view.similarity, rec=rec).get(0)
            return (itda.similarity_caption(view.similarity, rec),
                    heat.opts.get().kwargs["title"],
                    _manifest(view)["similarity_provenance"]["method"])

        cka = ("linear CKA of every layer of `tiny-llama` (rows) with every layer of a copy of "
               "it with weight noise 0.05 (columns) on the 2 probing prompts;")
        assert words()[0].startswith(cka)
        # recomputing: the comparison held in its worker
        gate = threading.Event()

        def held(*args, **kw):
            assert gate.wait(60)
            return real(*args, **kw)

        monkeypatch.setattr(itda, "layer_similarity", held)
        view.method = "svcca"
        try:
            note = view.similarity_stale_note()
            assert note.startswith(on) and note.endswith(
                "; the similarity measure changed since: " + states["running"])
            assert view.similarity_shown == shown and words()[0].startswith(cka)
            assert words()[1:] == ("Layer similarity (linear CKA)", "cka")
            assert "method='cka'" in view.code_snippet()
            assert pane.visible and pane.object.startswith("<b>Outdated.</b> " + on)
        finally:
            gate.set()
        view.wait(120)
        assert view.similarity_stale_note() == "" and not pane.visible
        assert words()[1:] == ("Layer similarity (SVCCA)", "svcca")
        # a change no recompute followed: pressing the button updates it
        with discard_events(view):
            view.method = "cka"
        assert view.similarity_stale_note().endswith(
            "; the similarity measure changed since: press Compare layers with a second model "
            "to update.")
        view.compare = True
        view.wait(120)
        assert view.similarity_stale_note() == "" and view.similarity_shown.method == "cka"
        # refused: an empty probing set (the dictionary and the comparison stay, marked)
        view.probe_text = " \n "
        view.wait(120)
        assert view.refused and "probing set is empty" in view.error
        assert view.similarity_stale_note().endswith(
            "; the probing prompts changed since: " + states["refused"])
        assert pane.visible and words()[0].startswith(cka)
        view.probe_text = "\n".join(PROBES[:2])                 # the same probes again
        view.wait(120)
        assert not view.refused and view.similarity_stale_note() == ""
        # failed: the comparison of a new weight noise raises
        def broken(*args, **kw):
            raise RuntimeError("no memory left for the comparison")

        monkeypatch.setattr(itda, "layer_similarity", broken)
        view.noise = 0.1
        view.wait(120)
        assert "no memory left" in view.error and not view.similarity_running
        assert view.similarity_stale_note().endswith(
            "; the weight noise changed since: " + states["failed"])
        assert view.similarity_status.startswith("The comparison failed")
        assert words()[0].startswith(cka) and view.similarity_shown.method == "cka"
        assert dict(view.similarity_shown.request) == {"noise": 0.05}
    finally:
        view.close()


# -- Neuron explanations -----------------------------------------------------------------------

def test_neuron_eval_words_and_stale_note_follow_the_shown_scores(tiny_model):
    from apps.neuron_eval import NeuronEvalView, unit_heading
    from explorer.analyses.itda import ITDA

    view = NeuronEvalView(tiny_model, background=False, n_seeds=2,
                          probe_text="\n".join(PROBES), layer=1, tau=0.3)
    try:
        on = ("atom 0 of the ITDA dictionary of the 3 probing prompts at layer 1 (tau 0.30; "
              "tiny-llama) · concept 'own_token' · top_quantile (alpha 0.05) · seed 0")
        shown = view.shown_provenance()
        assert shown.prompts == tuple(PROBES)
        assert dict(shown.request) == {"layer": 1, "tau": 0.3, "unit": 0, "concept": "own_token",
                                       "binarize": "top_quantile", "alpha": 0.05, "seed": 0}
        assert unit_heading(shown) == "A" + on[1:]
        assert view.stale_note() == "" and not _pane(view, "neuron-stale").visible
        # the exported unit is the shown one: atom 0's source token labels its concept
        ds = trace(tiny_model, PROBES, sites=("resid_post",), layers=[1], progress=False)
        source = ITDA(tau=0.3, l0=8).fit(ds, layer=1, min_pos=1).atom_token_[0]
        unit = view.export_datasets()["unit"]
        assert unit.attrs["unit"] == 0 and unit.attrs["concept_name"] == "own_token"
        np.testing.assert_array_equal(unit["concept"].values,
                                      (unit["token"].values == str(source)).astype(float))
        # the controls move, their scores not landed yet
        with discard_events(view):
            view.param.update(concept="digit", seed=5)
        note = view.stale_note()
        assert note.startswith(f"Shown: computed on {on} at ")
        assert "the concept, the seed changed since" in note
        assert unit_heading(view.shown) == "A" + on[1:]
        assert _pane(view, "neuron-stale").visible
        code = view.code_snippet()
        assert "'own_token'" in code and "seed=0" in code and "'digit'" not in code
        unit = view.export_datasets()["unit"]
        assert unit.attrs["concept_name"] == "own_token"
        assert Provenance.from_json(unit.attrs["page_provenance"]) == shown
        assert _manifest(view)["provenance"] == json.loads(shown.to_json())
        # an empty probing set is refused: the old scores stay, marked
        view.probe_text = ""
        assert view.error and "its recompute failed" in view.stale_note()
        assert "the probing prompts, the concept, the seed changed since" in view.stale_note()
        # the recompute lands: the note goes, the words follow
        view.probe_text = "\n".join(PROBES)
        assert view.stale_note() == ""
        assert dict(view.shown.request)["concept"] == "digit"
        assert unit_heading(view.shown).endswith("concept 'digit' · top_quantile (alpha 0.05) "
                                                 "· seed 5")
        code = view.code_snippet()
        assert "'digit'" in code and "seed=5" in code
        assert view.export_datasets()["unit"].attrs["concept_name"] == "digit"
    finally:
        view.close()


# -- Head atlas --------------------------------------------------------------------------------

def _first_token_attention(model, prompt, edits=()):
    """[layer, head] mean attention weight on token 0 (queries 1..n-1), from a plain trace."""
    pat = trace(model, [prompt], sites=("attn_pattern",), edits=list(edits),
                progress=False).attn_pattern.values[0]         # [layer, head, dst, src]
    n = pat.shape[-1]
    return pat[:, :, 1:n, 0].mean(axis=-1)


def test_atlas_out_of_view_keeps_its_scores_and_says_what_they_were_computed_on(tiny_model):
    from apps.atlas import atlas_heading
    from apps.gallery import VIEWS, Gallery

    views = [v for v in VIEWS if v[1] in ("attention", "atlas")]
    gallery = Gallery("tiny-llama", views=views, view="atlas")
    try:
        gallery.prompt = A
        view = gallery.page("atlas")
        shown = view.shown_provenance()
        assert shown.prompts == (A,) and shown.edits == () and view.stale_note() == ""
        assert atlas_heading(shown) == ("This page's attention statistics and attribution of "
                                        f"{A!r} (tiny-llama)")
        np.testing.assert_allclose(view.atlas["first_token_attention"].values,
                                   _first_token_attention(tiny_model, A), atol=1e-5)
        # the selection only outlines heads: recorded, never stale
        gallery.workspace.select("L1.H2")
        assert view.shown_provenance().selection == ("L1.H2",) and view.stale_note() == ""

        gallery.view = "attention"                             # the atlas leaves the view
        gallery.prompt = B
        gallery.workspace.push_edit(ABLATE)
        assert view.prompt == A and view.shown_provenance().prompts == (A,)
        note = view.stale_note()
        assert note.startswith(f"Shown: computed on {A!r} without edits at ")
        assert "the prompt, the edits changed since: the page recomputes when it is opened" in note
        assert atlas_heading(view.shown_record).endswith(f"of {A!r} (tiny-llama)")
        assert repr(A) in view.scope().on and "workspace edit" not in view.status
        code = view.code_snippet()
        assert repr(A) in code and B not in code and "edits=" not in code
        manifest = _manifest(view)
        assert manifest["provenance"]["prompts"] == [A] and manifest["provenance"]["edits"] == []
        np.testing.assert_allclose(view.atlas["first_token_attention"].values,
                                   _first_token_attention(tiny_model, A), atol=1e-5)

        gallery.view = "atlas"                                 # back in view: it catches up
        after = view.shown_provenance()
        assert after.prompts == (B,) and after.edits == ("ablate L0.H1 (zero)",)
        assert view.stale_note() == "" and view.stale_html() == ""
        assert atlas_heading(after).endswith(f"of {B!r} (tiny-llama), with 1 workspace edit")
        assert view.status.endswith("this page's scores under 1 workspace edit")
        np.testing.assert_allclose(view.atlas["first_token_attention"].values,
                                   _first_token_attention(tiny_model, B, [ABLATE]), atol=2e-5)
        code = view.code_snippet()
        assert repr(B) in code and repr(A) not in code and '"kind": "ablate"' in code
        assert _manifest(view)["provenance"]["prompts"] == [B]
    finally:
        gallery.close()


# -- User study --------------------------------------------------------------------------------

def test_a_study_keeps_naming_the_explanation_it_was_built_from(tiny_model, tmp_path,
                                                               monkeypatch):
    from apps.gallery import VIEWS, Gallery
    from apps.study_builder import study_heading

    monkeypatch.setenv("EXPLORER_STUDIES", str(tmp_path))
    views = [v for v in VIEWS if v[1] in ("lens", "dla", "study")]
    gallery = Gallery("tiny-llama", views=views, view="lens")
    try:
        gallery.prompt = A
        lens = gallery.page("lens")
        lens.k = 4
        page = gallery.page("study")
        page.param.update(participants=3, items="One, two, three,\nMonday, Tuesday,")
        page.build()
        page.wait()
        assert page.error == ""
        shown = page.shown_provenance()
        assert (shown.task, shown.method) == ("lens", "logit_lens")
        assert shown.prompts == (A, "One, two, three,", "Monday, Tuesday,")
        assert dict(shown.request)["explanation"] == (("k", 4),)
        assert shown.setting("source_result")[:3] == ("lens", (A,), "logit lens")
        heading = study_heading(shown)
        assert heading.startswith("Study of the Logit lens page's explanation (logit lens, k=4)")
        assert f"on {A!r} and 2 more items (tiny-llama)" in heading
        assert page.stale_note() == ""
        # the source page and the settings move on: the study keeps naming its explanation
        lens.k = 6
        gallery.prompt = B
        page.source = "dla"
        assert page.prompt == A                               # not in view: not synced yet
        assert study_heading(page.shown) == heading
        assert "the Logit lens page's explanation" in page._preview.objects[0].object
        note = page.stale_note()
        assert note.startswith("Shown: built at ") and f"(logit lens, k=4) of {A!r};" in note
        assert "the source page, the explanation, the explanation's settings changed since: " \
               "press Build study to update." in note
        manifest = _manifest(page)
        assert manifest["provenance"]["task"] == "lens"
        assert manifest["provenance"]["prompts"][0] == A
        code = page.code_snippet()
        assert "{'kind': 'logit_lens', 'k': 4}" in code and repr(A) in code and B not in code
        gallery.view = "study"                                # the sidebar's prompt arrives
        assert page.prompt == B and "the items" in page.stale_note()
        assert _pane(page, "study-stale").visible
        # a rebuild: the note goes, the words follow
        page.build()
        page.wait()
        assert page.stale_note() == "" and not _pane(page, "study-stale").visible
        assert study_heading(page.shown).startswith("Study of the Logit attribution page's "
                                                    "explanation (head attribution, top=3)")
        assert f"on {B!r} and 2 more items" in study_heading(page.shown)
        assert "the Logit attribution page's explanation" in page._preview.objects[0].object
    finally:
        gallery.close()
