"""A person walking the workspace, as a Hypothesis state machine (in-process, tiny-llama).

The gallery (`apps.gallery.Gallery`, its workspace and address bar) holds the Circuits page on
the task "your prompt", computing inline. Rules do what a person does: set the sidebar prompt,
click a token and type its replacement, type a ``word=replacement``, select and drop
components, add and remove edits, switch the attribution method, move the size slider, press
Compute, follow the page's link in a new session. After every step the invariants check what
the page says against the shown result's provenance and against this test's own model of the
session (the clicked position, the expected staleness), one message per fault, and that a
link reopens the same state.

Fast by default (a fixed seed, a few short walks: part of ``make test-fast``); a longer walk
with ``EXPLORER_MACHINE_EXAMPLES=500``.
"""
from __future__ import annotations

import logging
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from apps._circuits_text import method_label
from apps._provenance import counterfactual_text, one_line
from apps.circuits import PROMPT_TASK, CircuitsView
from apps.gallery import Gallery
from explorer.analyses import circuits as ca
from explorer.interventions import Ablate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLES = int(os.environ.get("EXPLORER_MACHINE_EXAMPLES", "0"))
PROMPTS = ["When Mary and John went to the store, John gave a drink to",
           "Ann met Bob and Bob thanked",
           "The cat sat on the mat and the cat",
           "line one\nline two " * 12]          # a long prompt, with newlines
REPLACEMENTS = ["M", "K", "Ed", "Mary"]
COMPONENTS = ["L0.H1", "L1.H0", "L2.H3", "L1.MLP"]


def _page(model):
    return CircuitsView(model, background=False, autostart=False, task=PROMPT_TASK,
                        n_edges=12)


class _Messages(logging.Handler):
    """The notifications a step raised (`apps.theme.notify` logs each one it is asked for)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


class WorkspaceWalk(RuleBasedStateMachine):
    """The session under test and this test's model of it: the position clicked (None when
    the counterfactual was typed or the prompt changed), the message count of the step."""

    @initialize()
    def open_gallery(self):
        self.gallery = Gallery("tiny-llama", views=[("Circuits", "circuits", _page)])
        self.gallery.prompt = PROMPTS[0]
        self.messages = _Messages()
        logging.getLogger("apps").addHandler(self.messages)
        self.clicked: int | None = None
        self.faults_allowed = 0      # messages the step may raise (one per fault)

    def teardown(self):
        if hasattr(self, "messages"):
            logging.getLogger("apps").removeHandler(self.messages)

    @property
    def page(self) -> CircuitsView:
        return self.gallery.page("circuits")

    def _step(self, faults_allowed: int = 0) -> None:
        self.messages.records.clear()
        self.faults_allowed = faults_allowed

    def _tokens(self) -> list[str]:
        tok = self.gallery.model.tokenizer
        return [tok.decode([i]) for i in tok(self.page.prompt, add_special_tokens=False)["input_ids"]]

    # -- rules: what a person does -------------------------------------------------------
    @rule(prompt=st.sampled_from(PROMPTS))
    def set_prompt(self, prompt):
        self._step()
        self.gallery.prompt = prompt
        # the strip follows the counterfactual's position, if it is a token of the new prompt
        m = re.search(r"@(\d+)=", self.page.counterfactual)
        n = len(self._tokens())
        self.clicked = int(m.group(1)) if m and int(m.group(1)) < n else None

    @rule(index=st.integers(0, 63), replacement=st.sampled_from(REPLACEMENTS))
    def click_token_and_type(self, index, replacement):
        """Click the ``index``-th word-bearing token (modulo their count), type a replacement."""
        self._step()
        words = [i for i, t in enumerate(self._tokens()) if t.strip()]
        pos = words[index % len(words)]
        self.page._strip.selected = [pos]          # the click
        self.page.replacement = replacement        # the typing
        self.clicked = pos

    @rule(index=st.integers(0, 63), replacement=st.sampled_from(REPLACEMENTS))
    def type_counterfactual(self, index, replacement):
        """Type ``word=replacement`` for the ``index``-th distinct word of the prompt."""
        self._step()
        words = sorted(set(re.findall(r"\w+", self.page.prompt)))
        self.page.counterfactual = f"{words[index % len(words)]}={replacement}"
        self.clicked = None

    @rule(name=st.sampled_from(COMPONENTS))
    def select_component(self, name):
        self._step()
        self.gallery.workspace.select(name)

    @precondition(lambda self: bool(self.gallery.workspace.selected))
    @rule()
    def drop_component(self):
        self._step()
        ws = self.gallery.workspace
        ws.deselect(ws.selected[-1])

    @rule(layer=st.integers(0, 2), head=st.integers(0, 3))
    def add_edit(self, layer, head):
        self._step()
        with torch.enable_grad():
            self.gallery.workspace.push_edit(Ablate(layer, head))

    @precondition(lambda self: bool(self.gallery.workspace.edits))
    @rule()
    def remove_edit(self):
        self._step()
        with torch.enable_grad():
            self.gallery.workspace.remove_edit(0)

    @rule()
    def switch_method(self):
        self._step(faults_allowed=1)   # with a result shown, the other method is computed
        with torch.enable_grad():
            self.page.method = "eap-ig" if self.page.method == "eap" else "eap"

    @precondition(lambda self: self.page.scores is not None)
    @rule(index=st.integers(0, 63))
    def move_slider(self, index):
        self._step()
        options = list(self.page._slider.options.values())
        self.page._slider.value = options[index % len(options)]

    def _stale(self) -> bool:
        """This test's own reading of whether the shown result is of other inputs than the
        page's current ones."""
        page, shown = self.page, self.page.shown
        request = dict(shown.request)
        return (shown.prompts[0] != page.prompt or shown.method != page.method
                or request["counterfactual"] != page.counterfactual.strip()
                or request["explain"] != page.explain)

    # a person presses Compute when there is something to compute (or to retry)
    @precondition(lambda self: self.page.shown is None or self.page.error or self._stale())
    @rule()
    def compute(self):
        self._step(faults_allowed=1)
        before = self.page.shown
        with torch.enable_grad():
            self.page._request_scores()         # the Compute circuit button
        if self.page.error:
            assert len(self.messages.records) == 1, self.messages.records
            # a refused counterfactual: one message, naming every place of an ambiguous word
            assert self.page.shown is before
            m = re.fullmatch(r"(\w+)=.*", self.page.counterfactual)
            if m and len(re.findall(rf"(?<!\w){m.group(1)}(?!\w)", self.page.prompt)) > 1:
                assert "occurs" in self.page.error and "positions" in self.page.error
        else:
            assert self.page.shown is not before and not self.page.stale_note()

    @rule()
    def follow_link(self):
        self._step()
        query, _ = self.gallery.link()
        state = dict(p.split("=", 1) for p in query.lstrip("?").split("&")).get("s")
        other = Gallery("tiny-llama", views=[("Circuits", "circuits", _page)])
        assert other.open_link("circuits", state) if state else True
        a, b = self.gallery.workspace, other.workspace
        assert (a.prompts, a.selected, a.selected_edges, a.selected_positions) == \
            (b.prompts, b.selected, b.selected_edges, b.selected_positions)
        assert [e.to_dict() for e in a.edits] == [e.to_dict() for e in b.edits]
        assert self.gallery.page_settings("circuits") == other.page_settings("circuits")
        assert other.page("circuits").clicked == self.page.clicked
        # the person now works in the new session (nothing computed there yet)
        self.gallery.close()
        self.gallery = other

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def one_message_per_fault(self):
        if not hasattr(self, "messages"):
            return
        n = len(self.messages.records)
        assert n <= self.faults_allowed, self.messages.records
        if n:
            assert self.page.error and self.page.error in self.messages.records[0]

    @invariant()
    def the_replaced_position_is_the_clicked_one(self):
        if not hasattr(self, "gallery") or self.clicked is None:
            return
        page = self.page
        assert re.fullmatch(rf".*@{self.clicked}=.*", page.counterfactual, re.DOTALL), \
            page.counterfactual
        assert page._strip.selected == [self.clicked]
        try:
            r = page.replacement_of(page.prompt, page.counterfactual)
        except ValueError:
            return          # no replacement typed yet, or one that does not fit
        assert r.position == self.clicked
        assert r.corrupt[:r.start] == page.prompt[:r.start]

    @invariant()
    def texts_about_the_shown_result_match_its_provenance(self):
        if not hasattr(self, "gallery"):
            return
        page = self.page
        scope = page.scope().on
        assert len(scope) < 1200 and "\n" not in scope
        shown = page.shown
        if shown is None:
            return
        title, caption = page.redraw()["title"], page._caption()
        label = method_label(shown.method)
        n = int(ca.select_circuit(page.scores, top_n=page.n_edges).sum())
        assert title.startswith(f"Circuit: {n:,} edges") and f", {label}, base model" in title
        own = caption.split("Layout:")[0]
        assert f"{label} scores of 1 pair." in own
        other = "EAP-IG" if label == "EAP" else "EAP scores"
        assert other not in own
        assert f"Shown: {n:,} edges" in own or f": {n:,} edges (top {page.n_edges:,} by" in own
        # one pair: no interval, and why; the gap the recovery is a share of
        assert "One pair: the recovery has no interval" in own and "gap" in own
        assert scope.startswith(f"your prompt {one_line(shown.prompts[0])}")
        if shown.counterfactual is not None:
            assert counterfactual_text(shown.counterfactual) in scope
        code = page.code_snippet()
        assert repr(shown.prompts[0]) in code and f"method={shown.method!r}" in code

    @invariant()
    def a_stale_result_is_marked_stale(self):
        if not hasattr(self, "gallery") or self.page.shown is None:
            return
        page, stale = self.page, self._stale()
        assert page.redraw()["title"].endswith("(outdated)") == stale
        assert page._caption().startswith("**Outdated.**") == stale
        assert ("Outdated:" in page.scope().on) == stale


def walk(steps, machine: WorkspaceWalk | None = None) -> WorkspaceWalk:
    """Run the rules ``steps`` ((name, kwargs) pairs) in order on ``machine`` (default: a new
    one), every invariant checked after each, as Hypothesis does."""
    if machine is None:
        machine = WorkspaceWalk()
        machine.open_gallery()
    invariants = [getattr(machine, n) for n in (
        "one_message_per_fault", "the_replaced_position_is_the_clicked_one",
        "texts_about_the_shown_result_match_its_provenance", "a_stale_result_is_marked_stale")]
    for name, kwargs in steps:
        getattr(machine, name)(**kwargs)
        for check in invariants:
            check()
    return machine


# tiny-llama spells names in letters: word-bearing token 21 of PROMPTS[0] is the second J
SECOND_J = {"index": 21, "replacement": "M"}


def test_the_walk_of_a_person_on_the_ioi_sentence(tiny_model):
    """The second John clicked and replaced, EAP then EAP-IG, a long prompt typed without a
    compute (the old circuit marked outdated), a link followed, the ambiguous 'John=Mary'
    refused with one message naming both places, the second J clicked again and computed."""
    m = walk([("click_token_and_type", SECOND_J), ("compute", {}), ("switch_method", {})])
    try:
        assert m.page.shown.counterfactual.position == 24 and m.page.shown.method == "eap-ig"
        assert m.page._task.corrupt == [
            "When Mary and John went to the store, Mohn gave a drink to"]
        walk([("move_slider", {"index": 3}), ("set_prompt", {"prompt": PROMPTS[3]})], m)
        assert m.page.redraw()["title"].endswith("(outdated)")
        walk([("follow_link", {}), ("set_prompt", {"prompt": PROMPTS[0]}),
              ("type_counterfactual", {"index": 0, "replacement": "Mary"}), ("compute", {})], m)
        assert m.page.counterfactual == "John=Mary" and m.page.shown is None
        assert "at token positions 9 and 24" in m.page.error
        assert len(m.messages.records) == 1
        walk([("click_token_and_type", SECOND_J), ("compute", {})], m)
        assert m.page.shown.counterfactual.position == 24 and m.page.error == ""
    finally:
        m.teardown()


@pytest.mark.slow
def test_walking_the_workspace_keeps_every_page_text_true(tiny_model):
    """Fixed seed, a few short walks (about 30 s here); EXPLORER_MACHINE_EXAMPLES for more."""
    run_state_machine_as_test(WorkspaceWalk, settings=settings(
        max_examples=EXAMPLES or 6, stateful_step_count=10 if not EXAMPLES else 25,
        derandomize=True, deadline=None, database=None, print_blob=False,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much]))


def test_a_head_selected_then_dropped_is_not_reopened_by_a_link(tiny_model):
    """Selecting a head pins it on the Circuits page; dropping it from the workspace unpins
    it, so the page's link reopens the empty selection (a walk the machine found)."""
    m = walk([("select_component", {"name": "L0.H1"})])
    try:
        assert m.page.selected == "L0.H1"
        walk([("drop_component", {}), ("follow_link", {})], m)
        assert m.gallery.workspace.selected == [] and m.page.selected == ""
    finally:
        m.teardown()
