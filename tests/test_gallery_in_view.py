"""Only what the person asked for runs, headless on tiny-llama: a workspace change (prompt,
selection, edits, a pasted item, an imported state) recomputes the page in view; a page
built earlier and not in view keeps its result and catches up when it is opened; a prompt the
pages refuse gets one message, from the page in view."""
from __future__ import annotations

import json

import pytest

from apps._view import View
from apps.attention import AttentionView
from apps.gallery import Gallery
from apps.lens import LensView
from explorer import Ablate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def jobs(monkeypatch):
    """Every job the pages submit: (page class, runner name, the page's prompt then)."""
    sent: list[tuple[str, str, str]] = []
    submit = View.submit

    def counted(self, name, job):
        sent.append((type(self).__name__, name, getattr(self, "prompt", "")))
        return submit(self, name, job)

    monkeypatch.setattr(View, "submit", counted)
    return sent


@pytest.fixture
def gallery(tiny_model):
    views = [("Logit lens", "lens", LensView), ("Attention", "attention", AttentionView)]
    g = Gallery("tiny-llama", views=views, view="attention")
    g.view = "lens"                 # both built; the attention page is now out of view
    yield g
    g.close()


def _ran(jobs, page):
    return [j for j in jobs if j[0] == page]


def test_a_new_prompt_runs_the_page_in_view_and_the_other_when_opened(gallery, jobs):
    attention = gallery.page("attention")
    old = attention.prompt
    gallery.prompt = "Alice met Bob at the market"
    assert _ran(jobs, "LensView") and not _ran(jobs, "AttentionView")
    assert gallery.page("lens").result.attrs["params"]["prompts"] == [gallery.prompt]
    assert attention.prompt == old          # it still shows (and says) what it computed
    gallery.view = "attention"
    ran = _ran(jobs, "AttentionView")
    assert ran and all(p == gallery.prompt for _, _, p in ran)
    assert attention.prompt == gallery.prompt
    n = len(jobs)
    gallery.view = "lens"                   # up to date: opening it again runs nothing
    assert len(jobs) == n


def test_edits_and_selection_reach_a_hidden_page_when_it_is_opened(gallery, jobs):
    attention = gallery.page("attention")
    gallery.workspace.select("L1.H2", "P1")
    gallery.workspace.push_edit(Ablate(0, 1))
    assert _ran(jobs, "LensView") and not _ran(jobs, "AttentionView")
    assert gallery.page("lens").edits == [Ablate(0, 1)]
    assert attention.edits == [] and attention.selected_positions == []
    gallery.view = "attention"
    assert _ran(jobs, "AttentionView")
    assert attention.edits == [Ablate(0, 1)]
    assert attention.selected_positions == [1] and attention.highlighted == ["L1.H2"]
    assert attention.selected == "L1.H2"


def test_an_imported_state_sets_a_hidden_page_when_it_is_opened(gallery, jobs):
    attention = gallery.page("attention")
    state = json.loads(gallery.export_state())
    state["prompts"] = ["The cat sat on the mat"]
    state["settings"] = {"attention": {"layer": 1, "head": 2}}
    gallery.import_state(json.dumps(state))
    assert _ran(jobs, "LensView") and not _ran(jobs, "AttentionView")
    assert (attention.layer, attention.head) != (1, 2) or attention.prompt != state["prompts"][0]
    gallery.view = "attention"
    assert attention.prompt == "The cat sat on the mat"
    assert (attention.layer, attention.head) == (1, 2)
    assert _ran(jobs, "AttentionView")


def test_a_prompt_the_page_in_view_refuses_gets_one_message_and_no_hidden_run(gallery, jobs,
                                                                              notes):
    gallery.view = "attention"
    jobs.clear()
    text = " ".join(["word"] * 40)
    n = gallery.count_tokens(text)
    assert 128 < n <= gallery.prompt_limit   # over the attention page's 128, within the sidebar's
    gallery.prompt = text
    errors = [m for kind, m in notes if kind == "error"]
    assert len(errors) == 1 and errors[0].startswith("Attention:")
    assert f"{n} tokens" in errors[0] and "128" in errors[0]
    assert not _ran(jobs, "LensView")
    gallery.view = "lens"                    # opened: it takes the prompt (its limit is 256)
    assert _ran(jobs, "LensView") and len([k for k, _ in notes if k == "error"]) == 1
    assert gallery.page("lens").result.attrs["params"]["prompts"] == [text]
