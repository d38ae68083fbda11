"""What the Logit lens, Attention and Saturation pages say is their shown result's own.

Each page keeps the record (`apps._provenance.Provenance`) of the inputs its shown result was
computed on; its heading and scope line are written from that record, the export carries it,
and once the workspace moves on (a page not in view, a recompute in flight or failed) a note
says what the shown result was computed on and what changed, until the recompute lands.
In-process, tiny-llama, through the gallery (which recomputes only the page in view).
"""
from __future__ import annotations

import io
import json
import threading
import zipfile

import pytest
import xarray as xr

from apps._page_provenance import auto_stale_text, result_heading, stale_inputs
from apps._provenance import Provenance
from apps._lens_text import lens_heading, lens_params, lens_request
from apps.attention import AttentionView, attention_heading
from apps.gallery import Gallery
from apps.lens import LensView
from apps.saturation import SaturationView
from apps._saturation_prompt import saturation_heading
from explorer.interventions import Ablate
from explorer.workspace import edit_label

pytestmark = pytest.mark.usefixtures("one_torch_thread")

A = "The cat sat on the mat"
B = "Paris is the capital of"
ABLATE = Ablate(layer=0, head=1)


def _lens(model):
    return LensView(model, background=False, k=3)


def _attention(model):
    return AttentionView(model, background=False)


def _saturation(model):
    return SaturationView(model, background=False, store=None, compute_on_open=False)


PAGES = {"lens": ("Logit lens", _lens), "attention": ("Attention", _attention),
         "saturation": ("Saturation", _saturation)}
HEADINGS = {"lens": "Logit lens of", "attention": "Attention patterns of",
            "saturation": "Saturation layers of"}
RESULTS = {"lens": "result", "attention": "result", "saturation": "prompt_result"}


def _gallery(slug: str) -> Gallery:
    """A gallery holding the page ``slug`` and one other page to switch to."""
    other = "attention" if slug != "attention" else "lens"
    views = [(PAGES[s][0], s, PAGES[s][1]) for s in (slug, other)]
    gallery = Gallery("tiny-llama", views=views, view=slug)
    gallery.prompt = A
    return gallery


def _other(gallery: Gallery, slug: str) -> str:
    return next(s for s in gallery.param.view.objects if s != slug)


def _tokens(view, slug: str) -> list[str]:
    ds = getattr(view, RESULTS[slug])
    return [str(t) for t in ds.token.values[0, :int(ds.mask.values[0].sum())]]


# -- pure functions on hand-built records --------------------------------------------------

def _record(**kw) -> Provenance:
    base = dict(page="lens", model="tiny-llama", method="logit lens", prompts=(A,),
                computed_at="2026-01-02T03:04:05Z")
    return Provenance(**{**base, **kw})


def test_stale_text_names_the_shown_inputs_and_what_changed():
    shown = _record(edits=("ablate L0.H1 (zero)",), request=(("top_k", 3),))
    assert auto_stale_text(shown, shown, state="recomputing") == ""
    wanted = _record(prompts=(B,), request=(("top_k", 5),))
    assert stale_inputs(shown, wanted) == ["prompts", "edits", "top_k"]
    assert auto_stale_text(shown, wanted, state="recomputing.") == (
        f"Shown: computed on {A!r} with 1 workspace edit at 03:04 UTC; the prompt, the edits, "
        "the top-k changed since: recomputing.")
    # the time and the settings (how it is drawn) are not inputs
    later = _record(edits=("ablate L0.H1 (zero)",), request=(("top_k", 3),),
                    computed_at="2026-01-02T09:00:00Z", settings=(("preview", True),))
    assert stale_inputs(shown, later) == []


def test_headings_are_written_from_the_record():
    one = _record(edits=("ablate L0.H1 (zero)",))
    assert lens_heading(one) == f"Logit lens of {A!r} (tiny-llama), clean and with 1 workspace edit"
    assert lens_heading(_record()) == f"Logit lens of {A!r} (tiny-llama)"
    assert attention_heading(_record(edits=("a", "b"))) == (
        f"Attention patterns of {A!r} (tiny-llama), with 2 workspace edits")
    sat = _record(method="saturation layers", request=(("weights", "random init"),))
    assert saturation_heading(sat) == f"Saturation layers of {A!r} (tiny-llama, random init weights)"
    long = "word " * 200
    assert len(result_heading("X", _record(prompts=(long,)))) < 160   # one line


def test_lens_request_ignores_the_contrast_prompts_without_steering():
    p = {"prompt": A, "alpha": 0.0, "steer_layer": 1, "contrast_a": "x", "contrast_b": "y",
         "k": 4}
    assert lens_request(p) == {"alpha": 0.0, "steer_layer": None, "contrast_a": None,
                               "contrast_b": None, "top_k": 4}
    assert lens_request(p) == lens_request({**p, "contrast_a": "z", "steer_layer": 2})
    steered = {**p, "alpha": 2.5}
    assert lens_request(steered) == {"alpha": 2.5, "steer_layer": 1, "contrast_a": "x",
                                     "contrast_b": "y", "top_k": 4}
    # the record gives back the parameters it was made of (through JSON too)
    record = Provenance.from_json(_record(request=tuple(sorted(
        lens_request(steered).items()))).to_json())
    assert lens_params(record, {**p, "steer_layer": 0, "contrast_a": "q"}) == steered
    assert lens_params(_record(request=tuple(sorted(lens_request(p).items()))),
                       {**p, "contrast_a": "q"})["contrast_a"] == "q"


# -- the pages in a gallery --------------------------------------------------------------------

@pytest.mark.parametrize("slug", list(PAGES))
def test_a_page_not_in_view_keeps_its_result_and_says_what_it_was_computed_on(slug):
    gallery = _gallery(slug)
    view = gallery.page(slug)
    shown = view.shown_provenance()
    assert shown.prompts == (A,) and shown.edits == () and shown.model == "tiny-llama"
    assert view.stale_note() == ""
    assert view.heading(shown).startswith(f"{HEADINGS[slug]} {A!r}")
    assert "".join(_tokens(view, slug)) == A      # the record's prompt is the result's

    gallery.view = _other(gallery, slug)          # the page leaves the view
    gallery.prompt = B
    gallery.workspace.push_edit(ABLATE)
    # the hidden page did not recompute: it shows prompt A's result and says so
    assert view.prompt == A and view.shown_provenance().prompts == (A,)
    note = view.stale_note()
    assert note.startswith(f"Shown: computed on {A!r} without edits at ")
    assert "the prompt, the edits changed since" in note and "when it is opened" in note
    assert B not in view.heading(view.shown_record) and repr(A) in view.scope().on
    assert "".join(_tokens(view, slug)) == A
    assert "Outdated." in view.stale_html()
    code = view.code_snippet()                    # the code recomputes what is shown
    assert repr(A) in code and B not in code and '"kind": "ablate"' not in code

    gallery.view = slug                           # back in view: it catches up
    after = view.shown_provenance()
    assert after.prompts == (B,) and after.edits == (edit_label(ABLATE),)
    assert "".join(_tokens(view, slug)) == B
    assert view.stale_note() == "" and view.stale_html() == ""
    assert view.heading(after).startswith(f"{HEADINGS[slug]} {B!r}")
    assert view.heading(after).endswith("with 1 workspace edit")
    assert repr(B) in view.scope().on
    code = view.code_snippet()
    assert repr(B) in code and repr(A) not in code and '"kind": "ablate"' in code


@pytest.mark.parametrize("slug", list(PAGES))
def test_selected_positions_are_drawn_at_once_and_recorded(slug):
    gallery = _gallery(slug)
    view = gallery.page(slug)
    gallery.workspace.selected_positions = [1, 3]
    assert view.selected_positions == [1, 3]
    assert view.shown_provenance().positions == (1, 3)
    assert view.stale_note() == ""   # outlines are redrawn from the selection: nothing to recompute


@pytest.mark.parametrize("slug", list(PAGES))
def test_the_export_carries_the_shown_record(slug):
    gallery = _gallery(slug)
    view = gallery.page(slug)
    gallery.view = _other(gallery, slug)
    gallery.prompt = B                            # the export is of the shown result (prompt A)
    shown = view.shown_provenance()
    manifest = view.export_manifest()
    assert manifest["provenance"] == shown.to_dict() and tuple(manifest["provenance"]["prompts"]) == (A,)
    datasets = view.export_datasets()
    assert json.loads(datasets[RESULTS[slug]].attrs["page_provenance"]) == \
        json.loads(shown.to_json())
    assert Provenance.from_json(datasets[RESULTS[slug]].attrs["page_provenance"]) == shown
    with zipfile.ZipFile(io.BytesIO(view.export_bytes())) as zf:
        name = f"{RESULTS[slug]}.nc"
        ds = xr.open_dataset(io.BytesIO(zf.read(name)), engine="scipy")
        assert Provenance.from_json(ds.attrs["page_provenance"]) == shown


@pytest.mark.parametrize("slug", list(PAGES))
def test_a_failed_recompute_in_view_leaves_the_old_result_marked(slug, tiny_model):
    """A prompt the page refuses (too long; empty for the saturation page) keeps the last
    result, which is then marked as computed on the old prompt."""
    view = PAGES[slug][1](tiny_model)
    view.prompt = A
    limit = {"lens": 256, "attention": 128}.get(slug)
    bad = "" if limit is None else "word " * (limit + 10)
    view.prompt = bad
    assert view.error
    assert view.shown_provenance().prompts == (A,)
    note = view.stale_note()
    assert note.startswith(f"Shown: computed on {A!r}") and "the prompt changed since" in note
    assert "its recompute failed" in note
    assert view.heading(view.shown_record).startswith(f"{HEADINGS[slug]} {A!r}")


def test_the_note_says_recomputing_while_the_recompute_runs(tiny_model, monkeypatch):
    """In the page in view the new inputs start a recompute at once; until it lands the
    shown patterns are marked as the old prompt's."""
    import apps.attention as attention

    gate = threading.Event()
    real = attention.trace_patterns

    def slow(*args, **kw):
        assert gate.wait(60)
        return real(*args, **kw)

    view = AttentionView(tiny_model, background=True, prompt=A).wait(60)   # a worker thread
    assert view.shown_provenance().prompts == (A,)
    monkeypatch.setattr(attention, "trace_patterns", slow)
    view.prompt = B
    try:
        assert view.running and view.shown_provenance().prompts == (A,)
        note = view.stale_note()
        assert "the prompt changed since: recomputing" in note and repr(A) in note
    finally:
        gate.set()
    view.wait(60)
    assert view.shown_provenance().prompts == (B,) and view.stale_note() == ""
    view.close()


def test_a_lens_preview_is_not_marked_stale(tiny_model):
    """While the steering slider moves, the preview drawn is of the hand's strength: the
    page says nothing is outdated, and its heading stays the prompt's."""
    view = LensView(tiny_model, background=False, prompt=A, k=3)
    heading = view.heading(view.shown_record)
    view.request_preview(2.0)
    assert view.preview is not None and view.alpha == 0.0
    shown = view.shown_provenance()
    assert shown.setting("preview") is True and dict(shown.request)["alpha"] == 2.0
    assert view.stale_note() == "" and view.heading(shown) == heading
    view.alpha = 2.0                              # the release: the exact lens replaces it
    assert view.preview is None and view.shown_provenance().setting("preview") is None
    assert dict(view.shown_provenance().request)["alpha"] == 2.0
    assert view.stale_note() == ""
