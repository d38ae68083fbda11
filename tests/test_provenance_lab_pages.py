"""The shown result's record on the training-lab pages (Unlearning, Shattering, Parity, Linear
ICL, Task emergence), in-process on tiny settings: after a compute, a control changed without
a recompute makes the stale note name that control while the page's words (scope line,
captions, summary, code, export manifest) still name the settings the result was computed
with; a recompute empties the note and the words follow. The expected words are built from
the settings each test passes, not from text the page wrote earlier.

A control changes without a recompute in two ways: on pages with a Compute button (Unlearning)
by setting it and not pressing the button; on pages that recompute on their own (Shattering's
edit, Parity's state counts) by setting it with its watchers held
(`param.parameterized.discard_events`), the moment a served page shows while it recomputes."""
from __future__ import annotations

import io
import json
import zipfile

import pytest
from _views import KM_PARAMS, tiny_facts_file
from param.parameterized import discard_events

from apps._provenance import Provenance

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _manifest(view) -> dict:
    """The manifest of the page's export (what *Export page data* downloads)."""
    with zipfile.ZipFile(io.BytesIO(view.export_bytes())) as zf:
        return json.loads(zf.read("manifest.json"))


def _exports_its_record(view) -> dict:
    """The export's manifest carries the shown record, which reads back from JSON."""
    shown = view.shown_provenance()
    manifest = _manifest(view)
    assert manifest["provenance"] == json.loads(shown.to_json())
    assert Provenance.from_json(shown.to_json()) == shown
    return manifest


def _pane(root, css: str):
    """The one pane with the css class ``css`` in a page's layout ``root``."""
    panes = root.select(lambda o: css in (getattr(o, "css_classes", None) or []))
    assert len(panes) == 1, css
    return panes[0]


# -- Unlearning: Localize and Run unlearning are buttons -------------------------------------

def test_unlearning_words_and_stale_notes_follow_the_shown_localization_and_run(tiny_model,
                                                                                tmp_path):
    from apps.unlearning import UnlearningView

    view = UnlearningView(tiny_model, facts_file=tiny_facts_file(tmp_path), known_only=False,
                          background=False, n_forget=4, n_retain=2, n_layers=1, steps=1,
                          relearn_steps=0, lr=1e-4)
    try:
        assert view.stale_note() == "" and view.shown_provenance() is None
        root = view.__panel__()
        view.localize()
        loc = view.localization_record
        assert dict(loc.request)["n_forget"] == 4 and loc.model == "tiny-llama"
        assert "4 to forget, 2 to retain" in view.scope().on
        caption = _pane(root, "unlearning-localized").object
        assert caption.startswith("Localized on tiny-llama: the facts of facts.json, 4 facts to "
                                  "forget, 2 to retain")
        assert view.localization_stale_note() == ""
        assert not _pane(root, "unlearning-localization-stale").visible
        # more facts to forget, not localized again: the words stay of the 4, the note says so
        view.n_forget = 6
        note = view.localization_stale_note()
        assert note.startswith("Shown: computed on tiny-llama, the facts of facts.json, "
                               "4 facts to forget, 2 to retain at ")
        assert note.endswith("; the facts to forget changed since: press Localize to update.")
        assert "4 to forget, 2 to retain" in view.scope().on
        pane = _pane(root, "unlearning-localization-stale")
        assert pane.visible and pane.object.startswith("**Outdated**. Shown: computed on")
        assert "U.split_facts(facts, 4, 2)" in view.code_snippet()
        view.n_forget = 4
        assert view.stale_note() == ""                       # back to the shown inputs
        # a run: its caption names what it trained, however the controls move after it
        view.method = "causal_tracing"
        view.run()
        ran = dict(view.run_record.request)
        assert ran["methods"] == ("fact_lookup", "causal_tracing") and ran["steps"] == 1
        words = ("fact_lookup and causal_tracing, budget 1 MLP layer, 1 step, learning rate "
                 "0.0001, general-text weight 1, 0 relearning steps, the facts of facts.json, "
                 "4 facts to forget, 2 to retain")
        assert _pane(root, "unlearning-run").object.startswith(
            f"Unlearning run on tiny-llama: {words} (computed ")
        view.param.update(steps=3, lr=3e-4)
        note = view.run_stale_note()
        assert note.startswith(f"Shown: computed on tiny-llama, {words} at ")
        assert note.endswith("; the training steps, the learning rate changed since: press "
                             "Run unlearning to update.")
        assert view.localization_stale_note() == ""         # the localization is current
        assert _pane(root, "unlearning-run-stale").visible
        assert _pane(root, "unlearning-run").object.startswith(
            f"Unlearning run on tiny-llama: {words}")
        code = view.code_snippet()                           # the run shown, not the controls
        assert "'steps': 1" in code or "steps=1" in code
        assert "steps=3" not in code and "'steps': 3" not in code
        manifest = _exports_its_record(view)
        assert manifest["provenance"]["request"]["steps"] == 1
        assert manifest["parameters"]["steps"] == 3          # the controls, apart
        # a recompute: the note goes, the words follow the new run
        view.run()
        assert view.stale_note() == "" and dict(view.run_record.request)["steps"] == 3
        assert not _pane(root, "unlearning-run-stale").visible
        assert "3 steps, learning rate 0.0003" in _pane(root, "unlearning-run").object
        # the run names the localization it trained on: a new Localize makes it outdated
        assert dict(view.run_record.request)["localized_at"] == loc.computed_at
        _exports_its_record(view)
    finally:
        view.close()


# -- Shattering: the edit recomputes in the background when its controls change -------------

def test_shattering_note_and_code_follow_the_shown_edit_while_the_next_one_computes(monkeypatch):
    import threading

    from apps import shattering as page
    from explorer._checks import InputError
    from explorer.analyses import shattering as sh

    km = sh.train_knowledge_model(**{**KM_PARAMS, "steps": 30})   # trained or not: edits apply
    sweep = sh.edit_sweep(km, n_edits=2, distances=[1], method="finetune")
    gate, real = threading.Event(), page.edit_fact

    def gated(km, e, r, distance, **kw):
        assert gate.wait(60)
        if distance == 3:
            raise InputError("distance 3 is refused here")
        return real(km, e, r, distance, **kw)

    gate.set()
    view = page.ShatteringView(km=km, sweep=sweep, method="finetune", entity="e3",
                               relation="A+1", distance=2, background=True)
    monkeypatch.setattr(page, "edit_fact", gated)
    try:
        view.wait()
        root = view.__panel__()
        model = (f"the knowledge-graph transformer ({km.graph.n_entities} entities, "
                 f"{km.params['n_layers']} blocks, seed 0)")
        shown = view.shown_provenance()
        assert shown.model == model and dict(shown.request) == {
            "method": "finetune", "entity": "e3", "relation": "A+1", "distance": 2, "layer": 0}
        assert view.stale_note() == "" and not _pane(root, "shattering-stale").visible
        on = f"Shown: computed on {model}, finetune edit, entity e3, relation A+1, distance 2, block 0 at "
        # another entity: its edit computes (held at the gate); the old one is shown, marked
        gate.clear()
        view.entity = "e5"
        note = view.stale_note()
        assert note.startswith(on) and note.endswith(
            "; the entity changed since: recomputing; the result shown is the old one until then.")
        pane = _pane(root, "shattering-stale")
        assert pane.visible and pane.object.startswith("**Outdated**. " + on)
        assert "**e3 A+1**" in view.summary()
        code = view.code_snippet()
        assert "index('e3')" in code and "'e5'" not in code
        assert _manifest(view)["provenance"]["request"]["entity"] == "e3"
        gate.set()
        view.wait()
        # landed: the note goes, the words follow the new edit
        assert view.stale_note() == "" and not pane.visible
        assert "**e5 A+1**" in view.summary() and "index('e5')" in view.code_snippet()
        manifest = _exports_its_record(view)
        assert manifest["provenance"]["settings"]["strength"] == 1.0
        # a failed recompute: the old edit stays, and the note says it failed
        view.distance = 3
        view.wait()
        assert "refused" in view.error
        note = view.stale_note()
        assert "entity e5" in note and "the counterfactual distance changed since: its " \
            "recompute failed" in note
        assert "**e5 A+1**" in view.summary() and "distance 2" in view.summary()
        # asked again: while that recompute runs the note says so, though the last one failed
        gate.clear()
        view.distance = 1
        assert view.error and view.stale_note().endswith(
            "; the counterfactual distance changed since: recomputing; the result shown is the "
            "old one until then.")
        gate.set()
        view.wait()
        assert view.stale_note() == "" and not view.error and "distance 1" in view.summary()
    finally:
        gate.set()
        view.close()


# -- Parity: the automaton sizes over training recount in the background ---------------------

def test_parity_curves_name_the_threshold_they_were_counted_at_and_the_drawn_words_the_controls():
    import numpy as np
    import xarray as xr

    from apps.parity import ParityView
    from explorer.analyses import parity as par

    run = par.train_parity_rnn(hidden_size=12, epochs=4, checkpoint_every=2, max_length=6, seed=0)
    analysis = par.parity_analysis(run, max_length=5, lengths=[10, 100], n_strings=4)   # at 0.01
    phase = xr.Dataset({"long_accuracy": (("gain", "max_length"), [[1.0]]),
                        "transition_epoch": (("gain", "max_length"), [[np.nan]]),
                        "final_n_states_minimal": (("gain", "max_length"), [[5.0]])},
                       coords={"gain": [0.1], "max_length": [6]}, attrs={"params": {"epochs": 20}})
    # a link's threshold, not the analysis's: the counts over training follow it at once
    view = ParityView(run=run, analysis=analysis, phase=phase, max_length=5, threshold=0.03,
                      background=False)
    try:
        root = view.__panel__()
        assert dict(view.curves_record.request) == {"threshold": 0.03, "max_length": 5}
        by_hand = par.parity_automaton_sizes(run, max_length=5, threshold=0.03)
        np.testing.assert_array_equal(view.curves()["n_states"].values, by_hand["n_states"].values)
        merged = "(the states of the strings up to 5 symbols, merged at threshold 0.03)"
        assert merged in view._curves_caption()
        assert view.stale_note() == "" and not _pane(root, "parity-stale").visible
        # a new threshold whose counts have not landed yet: the curves keep their words
        with discard_events(view):
            view.threshold = 0.05
        model = "the parity RNN (12 ReLU units, seed 0)"
        note = view.stale_note()
        assert note.startswith(f"Shown: computed on {model}, merge threshold 0.03, strings up to "
                               "5 symbols at ")
        assert note.endswith("; the merge threshold changed since: recomputing; the result "
                             "shown is the old one until then.")
        assert merged in view._curves_caption()
        assert "threshold=0.03" in view.code_snippet()
        assert _manifest(view)["provenance"]["request"]["threshold"] == 0.03
        # the automaton and its caption are drawn at once: they are of the new threshold
        step = int(view.step)
        auto = par.parity_automaton(run, step, max_length=5, threshold=0.05)
        assert f"{auto.attrs['n_states']} merged states" in view._automaton_caption()
        assert f"{auto.attrs['n_states']} merged" in view.summary()
        # the threshold moves on and its recount lands: the note goes, the words follow
        view.threshold = 0.06
        assert view.stale_note() == "" and dict(view.curves_record.request)["threshold"] == 0.06
        assert "merged at threshold 0.06)" in view._curves_caption()
        assert not _pane(root, "parity-stale").visible
        manifest = _exports_its_record(view)
        assert manifest["provenance"]["settings"]["step"] == step
        assert "threshold=0.06" in view.code_snippet()
    finally:
        view.close()


# -- Linear ICL and Task emergence: every panel is drawn at once from the controls -----------

def test_linear_icl_words_are_of_the_run_and_step_picked():
    from apps.linear_icl import LinearICLView
    from explorer.analyses import linear_icl as icl

    runs = {H: icl.train_linear_icl(n_heads=H, steps=40, checkpoint_every=20, batch_size=16,
                                    n_test=16, test_lengths=[10, 40], seed=0) for H in (1, 2)}
    view = LinearICLView(runs=runs, background=False)
    try:
        view.param.update(n_heads=1, step=20)
        assert view.summary().startswith("**H = 1, step 20**")
        assert view._length_plot().opts.get().kwargs["title"] == "Loss by length, step 20"
        shown = view.shown_provenance()
        assert dict(shown.request) == {"n_heads": 1, "step": 20}
        assert shown.model == "one-layer softmax attention (1 heads, d = 5, seed 0)"
        code = view.code_snippet()
        assert "shown = 1" in code and "step=20" in code
        assert _exports_its_record(view)["provenance"]["request"] == {"n_heads": 1, "step": 20}
        view.param.update(n_heads=2, step=40)
        assert view.summary().startswith("**H = 2, step 40**")
        assert dict(view.shown_provenance().request) == {"n_heads": 2, "step": 40}
        assert "shown = 2" in view.code_snippet() and view.stale_note() == ""
    finally:
        view.close()


def test_task_emergence_words_are_of_the_step_and_layer_picked():
    import numpy as np

    from apps.task_emergence import TaskEmergenceView
    from explorer.analyses import task_emergence as te

    small = dict(n_layers=2, d_model=16, n_heads=2, batch_size=16, steps=20, checkpoint_every=10,
                 warmup=2, d=4, n_tasks=2, rank=2, n_examples=4)
    run = te.train_task_emergence(**small, seed=3)
    analysis = te.task_emergence_analysis(run, n_per_task=6, k=3)
    view = TaskEmergenceView(analysis=analysis, background=False)
    try:
        view.param.update(step=10, layer=0)
        td = analysis["td"].sel(step=10)
        assert view.summary().startswith(f"**Step 10**: TD after layer 0 = "
                                         f"{float(td.sel(layer=0)):.2f} (best layer at this step: "
                                         f"{int(np.argmax(td.values))})")
        assert view._projection_plot().opts.get().kwargs["title"] == \
            "Query residual, layer 0, step 10"
        shown = view.shown_provenance()
        assert dict(shown.request) == {"step": 10, "layer": 0}
        assert shown.model == "the task-mixture transformer (2 blocks, 2 tasks, seed 3)"
        assert "step=10, layer=0" in view.code_snippet()
        assert _exports_its_record(view)["provenance"]["request"] == {"step": 10, "layer": 0}
        view.param.update(step=20, layer=1)
        assert view.summary().startswith("**Step 20**: TD after layer 1 = ")
        assert "step=20, layer=1" in view.code_snippet() and view.stale_note() == ""
    finally:
        view.close()
