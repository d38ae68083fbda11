"""What a person set on a page that lives beyond its controls travels in the gallery's link
(tiny-llama, no browser): the text the "Your own" boxes took in (the ICL heads page's pairs,
`own_pairs`; the Knowledge conflicts page's examples, `own_examples`; the Unlearning page's
fact, `own_fact`), the ITDA page's layer comparison (`comparing`) and the Head atlas page's own
induction scores (`own_induction`). A fresh gallery opening the link shows the same: the text in
the box, taken in as the page's parser reads it, the same choice selected, the same comparison
and scores; text a page refuses leaves what it took in before, with the parser's message."""
from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from _views import small_galleries

from explorer.analyses import user_items as ui

pytestmark = pytest.mark.usefixtures("one_torch_thread", "empty_cache")


@pytest.fixture
def gallery(tiny_model):
    with small_galleries(icl_compute_on_open=False) as make:
        yield make


def reopened(g, gallery):
    """The page ``g`` shows, as a fresh gallery opens it from ``g``'s link."""
    query, _ = g.link()
    assert query.startswith(f"?view={g.view}&s=1.")
    fresh = gallery()
    assert fresh.open_link(g.view, query.split("&s=")[1]), fresh.link_message
    return fresh.page(g.view)


def test_a_link_carries_the_icl_pairs_taken_in(gallery):
    from apps.icl_heads import OWN_TASK

    g = gallery("icl-heads")
    page = g.page("icl-heads")
    page._own.area.value = ui.ICL_FORMAT
    page._own.button.clicks += 1                         # Use
    assert page.task == OWN_TASK and page.own_pairs == ui.ICL_FORMAT
    assert page.link_params.index("own_pairs") < page.link_params.index("task")
    want = ui.parse_icl_pairs(ui.ICL_FORMAT, name=OWN_TASK, min_pairs=3)

    other = reopened(g, gallery)
    assert other.task == OWN_TASK and other.error == ""
    assert other._own.area.value == ui.ICL_FORMAT and other._own_task.pairs == want.pairs
    assert repr(ui.ICL_FORMAT) in other.code_snippet()   # the snippet parses the same pairs

    page.task = "antonym"                                # back to a shipped task: the link keeps
    other = reopened(g, gallery)                         # the pairs offered, the task picked
    assert other.task == "antonym" and OWN_TASK in other.param.task.objects
    assert other._own_task.pairs == want.pairs

    other.own_pairs = "hot -> cold"                      # too few pairs: refused, the old kept
    assert "pair" in other.error and other.own_pairs == ui.ICL_FORMAT
    assert other._own_task.pairs == want.pairs


def test_a_link_carries_the_conflict_examples_taken_in(gallery):
    from explorer.analyses import conflicts as C

    second = (ui.CONFLICT_FORMAT.replace("France", "Italy").replace("Paris", "Rome"))
    g = gallery("conflicts")
    page = g.page("conflicts")
    page.use_own(ui.CONFLICT_FORMAT)
    page.use_own(second)
    assert page.own_examples == [ui.CONFLICT_FORMAT, second] and page.error == ""
    first = next(label for label, fact in page._facts.items() if fact.subject == "France"
                 and label.startswith("yours"))
    page.example = first
    assert page.link_params.index("own_examples") < page.link_params.index("example")

    other = reopened(g, gallery)
    facts = [ui.parse_conflict_example(t) for t in (ui.CONFLICT_FORMAT, second)]
    assert other.own_examples == [ui.CONFLICT_FORMAT, second] and other.error == ""
    assert other.example == first and other._fact() == facts[0]
    assert [f for f in other._facts.values() if f in facts] == facts
    assert other.shown.prompts == (C.conflict_prompt(facts[0], other.kind),)

    other.own_examples = [*other.own_examples, "prompt: only a prompt"]   # refused: left out
    assert other.error and "\n" not in other.error
    assert other.own_examples == [ui.CONFLICT_FORMAT, second]


def test_a_link_carries_the_unlearning_fact_taken_in(gallery, tiny_model, tmp_path):
    from apps.unlearning import UnlearningView
    from explorer.analyses import unlearning as U
    from tests._views import tiny_facts_file

    text = "subject: Person Q\nprompt: Fact: Person Q likes the\nanswer: moon"
    facts = tiny_facts_file(tmp_path)
    view = UnlearningView(tiny_model, facts_file=facts, known_only=False, n_forget=4, n_retain=2,
                          background=False)
    view.use_own(text)                                   # Use: taken in, and Localize ran on it
    assert view.own_fact == text and view.localization_record is not None
    assert dict(view.localization_record.request)["own"] == text
    view.close()

    g = gallery("unlearning")
    page = g.page("unlearning")
    shipped = U.load_attribute_facts()[0]
    page.own_fact = ui.UNLEARNING_FORMAT                 # as a link sets it
    want = ui.parse_unlearning_fact(ui.UNLEARNING_FORMAT, attributes=shipped.attributes,
                                    mc=shipped.mc)
    assert page._own_fact == want and page.probe is None     # taken in; nothing localized
    assert page.link_params.index("own_fact") >= 0

    other = reopened(g, gallery)
    assert other.own_fact == ui.UNLEARNING_FORMAT and other._own_fact == want
    assert other._own.area.value == ui.UNLEARNING_FORMAT and other.error == ""
    assert dict(other.localization_request().request)["own"] == ui.UNLEARNING_FORMAT

    other.own_fact = "subject: nobody"                   # refused: the fact taken in stays
    assert other.error and other.own_fact == ui.UNLEARNING_FORMAT and other._own_fact == want


def test_a_link_carries_the_itda_layer_comparison(gallery):
    g = gallery("itda")
    page = g.page("itda")
    assert page.similarity is None and not page.comparing
    page.compare = True                                  # the button
    assert page.comparing and page.similarity is not None

    other = reopened(g, gallery)
    assert other.comparing and other.similarity is not None
    xr.testing.assert_allclose(other.similarity["similarity"], page.similarity["similarity"])
    assert other.similarity_shown.request == page.similarity_shown.request


def test_a_link_carries_the_atlas_own_induction_scores(gallery, tiny_model):
    from explorer.analyses import icl_heads as ih

    g = gallery("atlas")
    page = g.page("atlas")
    assert "induction_score" not in page.atlas
    page.add_induction()                                 # the button
    page.score = "induction_score"
    assert page.own_induction

    other = reopened(g, gallery)
    assert other.own_induction and other.score == "induction_score"
    want = ih.induction_scores(tiny_model, n_sequences=8, half_len=20)
    np.testing.assert_allclose(other.atlas["induction_score"].values,
                               want["induction_score"].values)
    assert dict(other.shown_record.request)["induction"] is not None


def test_a_retrained_knowledge_model_is_built_not_read_from_the_shipped_file(monkeypatch,
                                                                             tmp_path):
    """The Shattering page's snippet reads the shipped model file while the page shows it;
    after Retrain it builds the model as `knowledge_model` does (the retrained one is stored)."""
    import apps.shattering as S

    monkeypatch.setattr(S, "is_stored", lambda **_: False)      # no stored model: the shipped one
    view = S.ShatteringView(background=False)
    assert f"load_knowledge_model({str(S.SHIPPED_MODEL)!r})" in view.code_snippet()
    retrained = view.km
    asked = []
    monkeypatch.setattr(S, "knowledge_model", lambda **kw: asked.append(kw) or retrained)
    view.retrain = True                                         # the Retrain button
    assert asked and asked[0]["retrain"] is True
    code = view.code_snippet()
    assert "load_knowledge_model" not in code and "knowledge_model(" in code
    view.close()


def test_a_link_carries_the_study_items(gallery):
    g = gallery("study")
    page = g.page("study")
    page.items = "The sky is\nWater is"
    other = reopened(g, gallery)
    assert other.items == "The sky is\nWater is"
    assert other.prompts() == [g.prompt, "The sky is", "Water is"]
