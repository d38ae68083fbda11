"""The shown result's record on the Logit attribution, Activation patching, Feature dashboards,
Knowledge conflicts and ICL heads pages (in-process, tiny-llama): after a compute, an input
changed without a recompute makes the stale note name that input while the page's words still
name the old one; a recompute empties the note and the words follow; the export's manifest
carries the shown record.

An input changes without a recompute in two ways here: a request the page refuses (a prompt
over its limit, an answer of two tokens: the old result stays), and, on pages with no such
request, the moment between an input's change and its recompute landing (what a served page
shows while it computes), made by setting the input with its watchers held
(`param.parameterized.discard_events`)."""
from __future__ import annotations

import io
import json
import zipfile

import pytest
from param.parameterized import discard_events

from apps._provenance import Provenance, one_line
from explorer.analyses import conflicts as C
from explorer.interventions import Ablate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "When Mary and John went to the store, John gave a drink to"
OTHER = "Ann met Bob and Bob thanked"


def _manifest(view) -> dict:
    """The manifest of the page's export (what *Export page data* downloads)."""
    with zipfile.ZipFile(io.BytesIO(view.export_bytes())) as zf:
        return json.loads(zf.read("manifest.json"))


def _exports_its_record(view) -> None:
    shown = view.shown_provenance()
    assert _manifest(view)["provenance"] == json.loads(shown.to_json())
    assert Provenance.from_json(shown.to_json()) == shown


def _stale_pane(view, css: str):
    """The page's pane of the stale note (its text, whether it shows)."""
    root = view.__panel__()
    panes = root.select(lambda o: css in (getattr(o, "css_classes", None) or []))
    assert len(panes) == 1, css
    return panes[0]


def test_dla_words_and_stale_note_follow_the_shown_attribution(tiny_model):
    from apps.dla import MAX_TOKENS, DLAView, dla_title

    view = DLAView(tiny_model, background=False, prompt=PROMPT)
    try:
        shown = view.shown_provenance()
        assert shown.prompts == (PROMPT,) and shown.model == "tiny-llama"
        assert view.caption().startswith(f"On {one_line(PROMPT)} (tiny-llama).")
        title = dla_title(view.result)
        assert view.stale_note() == "" and not _stale_pane(view, "dla-stale").visible
        _exports_its_record(view)
        # a prompt over the page's limit is refused: the old attribution stays, marked
        long = "line one\nline two " * 40
        assert len(tiny_model.tokenizer(long)["input_ids"]) > MAX_TOKENS
        view.prompt = long
        assert f"at most {MAX_TOKENS}" in view.error
        note = view.stale_note()
        assert note.startswith(f"Shown: computed on {one_line(PROMPT)}")
        assert note.endswith("the prompt changed since: its recompute failed (the message "
                             "above says why); the result shown is the old one.")
        assert view.caption().startswith(f"On {one_line(PROMPT)} (tiny-llama).")
        assert dla_title(view.result) == title
        pane = _stale_pane(view, "dla-stale")
        assert pane.visible and pane.object.startswith("**Outdated**")
        # an answer of two tokens is refused too, and named
        view.prompt = PROMPT
        assert view.stale_note() == ""              # back to the shown inputs
        view.answer = "zz"
        assert view.stale_note().endswith(
            "the answer or alternative changed since: the page refused the new input (the "
            "message above says why); the result shown is the old one.")
        # a recompute: the note goes, the words follow the new result
        view.param.update(answer="", prompt=OTHER)
        assert view.stale_note() == "" and view.shown_provenance().prompts == (OTHER,)
        assert view.caption().startswith(f"On {one_line(OTHER)} (tiny-llama).")
        view.edits = [Ablate(0, 1)]
        assert view.shown_provenance().edits == ("ablate L0.H1 (zero)",)
        assert "ablate L0.H1 (zero)" in view.caption() and view.stale_note() == ""
        _exports_its_record(view)
    finally:
        view.close()


def test_patching_words_and_stale_note_follow_the_shown_grid(tiny_model):
    from apps.patching import MAX_TOKENS, PatchingView, patching_title

    view = PatchingView(tiny_model, background=False, prompt=PROMPT, cf_position=1,
                        cf_token="K")
    try:
        shown = view.shown_provenance()
        assert shown.prompts == (PROMPT,) and shown.counterfactual.position == 1
        assert shown.counterfactual.new == "K" and shown.positions == (1,)
        old = shown.counterfactual.old
        assert view.caption().startswith(f"On {one_line(PROMPT)} (tiny-llama).")
        assert f"position 1: {old!r} -&gt; 'K'" not in view.caption()   # '->' stays Markdown
        assert f"position 1: {old!r} -> 'K'" in view.caption()
        title = patching_title(view.result)
        assert title == "residual stream (resid_pre), denoising"
        _exports_its_record(view)
        # a prompt over the page's limit is refused: the old grid stays, marked
        long = "line one\nline two " * 12
        assert len(tiny_model.tokenizer(long)["input_ids"]) > MAX_TOKENS
        view.prompt = long
        note = view.stale_note()
        assert f"computed on {one_line(PROMPT)} vs position 1: {old!r} -> 'K'" in note
        assert "the prompt changed since: its recompute failed (the message above" in note
        assert view.caption().startswith(f"On {one_line(PROMPT)} (tiny-llama).")
        assert patching_title(view.result) == title
        pane = _stale_pane(view, "patching-stale")
        assert pane.visible and "resid_pre grid, denoising" in pane.object
        # a grid not yet recomputed, a replacement of two tokens, no token: each named
        view.prompt = PROMPT
        with discard_events(view):                               # not yet recomputed
            view.param.update(kind="mlp_out")
        assert view.stale_note().endswith("the grid changed since: press Enter to update.")
        assert patching_title(view.result) == title                  # the shown grid's words
        view.cf_token = "Ed"
        assert "the grid, the replacement token changed since: the page refused the new " \
               "input (the message above says why)" in view.stale_note()
        view.cf_position = -1                                    # no token to replace
        assert view.stale_note().endswith("click a token of the prompt and type its "
                                          "replacement to update.")
        # a recompute: the note goes, the words follow
        view.param.update(cf_position=1, cf_token="K")
        assert view.stale_note() == ""
        assert patching_title(view.result) == "MLP output, denoising"
        assert dict(view.shown_provenance().request)["grid"] == "mlp_out"
        _exports_its_record(view)
    finally:
        view.close()


@pytest.fixture
def store(tmp_path, monkeypatch):
    from explorer.store import ActivationStore

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))
    return ActivationStore(tmp_path / "cache")


def test_features_words_and_stale_note_follow_the_shown_dashboards(tiny_model, store):
    from apps.features import FeaturesView, dashboard_title

    view = FeaturesView(tiny_model, background=False, store=store, prompt=PROMPT,
                        corpus_tokens=128, layer=1, tau=0.3, n_latents=32)
    try:
        shown = view.shown_provenance()
        assert shown.prompts == (PROMPT,) and shown.edits == ()
        r = dict(shown.request)
        assert r["feature"] == view.feature == 0 and r["dictionary"][:3] == ("itda", 1, 128)
        assert dashboard_title(shown).startswith("**ITDA atom 0** of the ITDA dictionary at "
                                                 "layer 1 (128 corpus tokens)")
        assert one_line(PROMPT) in dashboard_title(shown) and view.stale_note() == ""
        _exports_its_record(view)
        # the prompt and the feature changed, their dashboards not landed yet
        with discard_events(view):
            view.param.update(prompt=OTHER, feature=1)
        note = view.stale_note()
        assert "the prompt, the feature changed since" in note and one_line(PROMPT) in note
        assert note.endswith("changed since: press Enter to update.")   # no Compute button
        view.running = True                     # a recompute in flight (a served page)
        assert view.stale_note().endswith("recomputing; the result shown is the old one "
                                          "until then.")
        view.running = False
        assert one_line(PROMPT) in dashboard_title(view.shown)
        assert "**Outdated**" in view.stale_markdown()
        # a workspace edit is no input: the dictionary reads the clean model
        view.edits = [Ablate(0, 1)]
        assert "edits" not in view.stale_note()
        # the dashboards land: the note goes, the words follow
        view._request_dashboard()
        assert view.stale_note() == ""
        assert dashboard_title(view.shown).startswith("**ITDA atom 1**")
        assert one_line(OTHER) in dashboard_title(view.shown)
        assert view.on_prompt.attrs["prompt"] == OTHER
        _exports_its_record(view)
    finally:
        view.close()


def test_conflicts_words_and_stale_note_follow_the_shown_bars(tiny_model):
    from apps.conflicts import ConflictsView

    facts = C.load_facts(["country_capital"])[:2]
    view = ConflictsView(tiny_model, facts=facts, closed_book=False, background=False, n_new=2)
    try:
        fact = view._fact()
        shown = view.shown_provenance()
        assert shown.prompts == (C.conflict_prompt(fact, "substitution"),)
        assert (shown.answer, shown.wrong) == (fact.memory, fact.context)
        assert "No head selected yet" in view.bars_words() and view.stale_note() == ""
        # the page runs on its own facts: it has no prompt input at all
        assert "prompt" not in view.param
        # a head added and an alpha moved, the bars not recomputed yet
        with discard_events(view):
            view.param.update(heads_plus=["L1.H2"], alpha_l=2.0)
        note = view.stale_note()
        assert "the alphas, the enhanced or suppressed heads changed since" in note
        # every change recomputes at once: no button to press; out of view it waits
        assert note.endswith("the page recomputes when it is opened.")
        view.running = True
        assert view.stale_note().endswith("recomputing; the result shown is the old one until then.")
        view.running = False
        assert "No head selected yet" in view.bars_words()         # the shown bars' words
        assert _manifest(view)["provenance"]["request"]["heads"] == [[], []]
        # the bars land: the note goes, the words follow
        view._request("bars")
        assert view.stale_note() == "" and view.shown_provenance().selection == ("L1.H2",)
        assert "No head selected yet" not in view.bars_words()
        # edits: the edited bars are headed by the edits they were computed with
        view.edits = [Ablate(0, 1)]
        assert view.shown_provenance().edits == ("ablate L0.H1 (zero)",)
        with discard_events(view):
            view.edits = []
        assert "the edits changed since" in view.stale_note()
        edited = view._edited_bars(view.edited_rows)
        assert "ablate L0.H1 (zero)" in edited[0].object             # the shown edits
        _exports_its_record(view)
    finally:
        view.close()


def test_icl_heads_words_and_stale_note_follow_the_shown_scores(tiny_model):
    from apps._icl_record import scores_words
    from apps.icl_heads import ICLHeadsView

    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), eval_tasks=("uppercase",),
                        td_tasks=("antonym", "uppercase"), compute_on_open=True)
    try:
        shown = view.shown_provenance()
        assert shown.task == "antonym" and shown.n_pairs == 2 and shown.prompts == ()
        assert dict(shown.request)["induction"] == (4, 50, "abs")
        words = scores_words(shown)
        assert "FV on antonym (2 prompts x 2 shots each" in words
        assert "4 repeated random sequences of 50 tokens (abs); no edits" in words
        assert view.stale_note() == ""
        # the attention plot is titled by the head its patterns are of
        from apps._icl_scores import pattern_head
        assert pattern_head(view.patterns) == f"L{view.layer}.H{view.head}"
        # an edit, its rescore not landed yet: named, the words still the shown scores'
        with discard_events(view):
            view.edits = [Ablate(0, 1)]
        note = view.stale_note()
        assert note.startswith("Shown: computed on the task 'antonym'")
        assert "the edits changed since" in note
        assert note.endswith("press Compute scores to update.")    # the page's own button
        view.running = True                                        # the rescore in flight
        assert view.stale_note().endswith(
            "recomputing; the result shown is the old one until then.")
        view.running = False
        assert "no edits" in scores_words(view.shown_provenance())
        # the induction rescore lands: the note goes, the words follow
        view._edits_changed()
        assert view.stale_note() == ""
        assert "under the edits `ablate L0.H1 (zero)`" in scores_words(view.shown_provenance())
        view.induction_half_len = 20
        assert dict(view.shown_provenance().request)["induction"] == (4, 20, "abs")
        assert view.stale_note() == ""
        _exports_its_record(view)
    finally:
        view.close()


def test_a_page_without_a_result_says_nothing_stale(tiny_model):
    from apps.patching import PatchingView

    view = PatchingView(tiny_model, background=False, prompt=PROMPT)   # no token clicked yet
    try:
        assert view.result is None and view.shown_provenance() is None
        view.prompt = OTHER
        assert view.stale_note() == "" and "provenance" not in view.export_manifest()
        assert not _stale_pane(view, "patching-stale").visible
    finally:
        view.close()
