"""A person walking the workspace, as a Hypothesis state machine (in-process, tiny-llama).

The gallery (`apps.gallery.Gallery`, its workspace and address bar) holds the Circuits page
(opening on the task "your prompt"), the Logit lens, Attention, Saturation, Logit attribution,
Activation patching, Two prompts and Feature dashboards pages, all computing inline. Rules do
what a person does: set the sidebar prompt and second prompt, switch pages, and on the page in
view what it offers: on Circuits pick a task (a generated one, your pairs) and its number of
pairs, click a token and type its replacement, type a ``word=replacement``, press "Same pair
with other names", paste pairs and press Use, switch the attribution method, move the size
slider, press Compute; on Activation patching click a token and type its replacement; on Logit
attribution type the answer to explain; on Two prompts pick the view; on Feature dashboards
type a feature. Everywhere: select and drop components, add and remove edits, follow the
page's link in a new session. After every step the invariants check, for the
page in view, that the words about its result (title, caption, heading) are those of the
result's record (`shown_provenance`), and that its stale note is non-empty exactly when the
inputs the shown result was computed on differ from the workspace's, by this test's own model
of the session (the prompts and edits set, the clicked position, the answer, task, pairs,
view and feature picked; a page's stale note counts only what the page reads); one message
per fault; a link reopens the same state. A page whose `shown_provenance` is None is checked
for saying nothing stale.

The fixed walks (`walk`, below) are part of ``make test-fast`` (about 40 s together on a
loaded 2-core machine); the Hypothesis walks are marked slow: the derandomized one (8 short
walks, about 20-30 s) and two more seeds (``SEEDS``: 6 walks of 20 steps each). Walk longer
with ``EXPLORER_MACHINE_EXAMPLES=500`` (walks per seed, 25 steps each) and from other seeds
with ``EXPLORER_MACHINE_SEEDS=1,2,3``.
"""
from __future__ import annotations

import logging
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

import html

from apps import theme
from apps._circuits_text import method_label
from apps._page_provenance import ShownRecord
from apps._provenance import counterfactual_text, one_line
from apps.attention import AttentionView
from apps.circuits import OWN_TASK, PROMPT_TASK, CircuitsView
from apps.compare import CompareView, compare_caption, compare_title
from apps.dla import DLAView, dla_title
from apps.features import FeaturesView, dashboard_title
from apps.gallery import Gallery
from apps.lens import LensView
from apps.patching import PatchingView, patching_title
from apps.saturation import SaturationView
from explorer._checks import InputError
from explorer.analyses import circuits as ca
from explorer.interventions import Ablate
from explorer.workspace import MAX_PROMPT_TOKENS, Workspace, edit_label, workspace_link

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLES = int(os.environ.get("EXPLORER_MACHINE_EXAMPLES", "0"))
SEEDS = [int(s) for s in os.environ.get("EXPLORER_MACHINE_SEEDS", "3,17").split(",") if s]
PROMPTS = ["When Mary and John went to the store, John gave a drink to",
           "Ann met Bob and Bob thanked",
           "The cat sat on the mat and the cat",
           "line one\nline two " * 12,          # a long prompt, with newlines: over patching's 64
           "line one\nline two " * 32]          # over logit attribution's 256 tokens
REPLACEMENTS = ["M", "K", "Ed", "Mary"]
COMPONENTS = ["L0.H1", "L1.H0", "L2.H3", "L1.MLP"]
ANSWERS = ["", "#5", "#9", "zz"]      # the top token, two ids, two tokens (refused)
# the Circuits page's tasks: tiny-llama tokenises ioi's clean and corrupted prompts to
# different lengths, so it is refused; add's pairs are scored
TASKS = [PROMPT_TASK, "add", "ioi", OWN_TASK]
# pasted pairs: two good ones (the clean prompts by hand), and two refused: a corrupted
# prompt one token shorter in tiny-llama's letters, a line without the four fields
OWN_PAIRS = ['"1 + 2 = " | "1 + 3 = " | "3" | "4"\n"2 + 2 = " | "2 + 5 = " | "4" | "7"',
             "The cat sat on the | The dog sat on the | mat | rug",
             "no pipes here"]
OWN_CLEAN = {OWN_PAIRS[0]: ["1 + 2 = ", "2 + 2 = "]}
SECOND_PROMPTS = ["", "When Mary and John went to the store, Mary gave a drink to",
                  "Ann met Bob and Ann thanked",
                  "line one\nline two " * 20,   # over the Two prompts page's 128 tokens
                  "line one\nline two " * 32,   # over the sidebar's 256 (not set)
                  "x" * 256, "x" * 257]         # one letter a token: at the limit, one over
COMPARE_VIEWS = ["lens", "saturation", "dla", "attention"]
# how a stale note ends (`docs/workspace.md`): recomputing, refused, failed, recomputes when
# opened, or the page's own action (these pages recompute as each input changes: Enter)
STALE_ENDINGS = (*ShownRecord.stale_states.values(), "press Enter to update.")


def _page(model):
    return CircuitsView(model, background=False, autostart=False, task=PROMPT_TASK,
                        n_edges=12, n_prompts=2)


def _features(model):
    """The dashboards of a small ITDA dictionary (128 corpus tokens, layer 1: about 1 s to
    train on tiny-llama, then read from the process's store)."""
    return FeaturesView(model, corpus_tokens=128, layer=1)


VIEWS = [("Circuits", "circuits", _page), ("Logit lens", "lens", LensView),
         ("Attention", "attention", AttentionView), ("Saturation", "saturation", SaturationView),
         ("Logit attribution", "dla", DLAView), ("Activation patching", "patching", PatchingView),
         ("Two prompts", "compare", CompareView), ("Feature dashboards", "features", _features)]
SLUGS = [slug for _, slug, _ in VIEWS]


def _markdown(text: str) -> str:
    """``text`` as the pages write it into Markdown (``&`` and ``<`` escaped)."""
    return html.escape(text, quote=False)


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

    @initialize(view=st.sampled_from(SLUGS))
    def open_gallery(self, view="circuits"):
        self.gallery = Gallery("tiny-llama", views=VIEWS, view=view)
        self.gallery.prompt = PROMPTS[0]
        self.messages = _Messages()
        logging.getLogger("apps").addHandler(self.messages)
        self.clicked: int | None = None
        self.faults_allowed = 0      # messages the step may raise (one per fault)
        self.answer = ""             # the answer typed on the logit attribution page
        self.replaced: tuple[int, str] | None = None   # the patching page's token and its new text
        self.own_version = 0         # good pastes into the Circuits page's own pairs
        self.own: tuple[str, int] | None = None   # their first clean prompt and their count
        self.compare_view = "lens"   # the view picked on the Two prompts page
        self.feature = 0             # the feature typed on the Feature dashboards page

    def teardown(self):
        if hasattr(self, "messages"):
            logging.getLogger("apps").removeHandler(self.messages)

    @property
    def page(self) -> CircuitsView:
        return self.gallery.page("circuits")

    @property
    def view(self) -> str:
        return self.gallery.view

    @property
    def in_view(self):
        """The page shown."""
        return self.gallery.page(self.gallery.view)

    def _step(self, faults_allowed: int = 0) -> None:
        self.messages.records.clear()
        self.faults_allowed = faults_allowed

    def _tokens(self) -> list[str]:
        tok = self.gallery.model.tokenizer
        return [tok.decode([i]) for i in tok(self.page.prompt, add_special_tokens=False)["input_ids"]]

    # -- rules: what a person does -------------------------------------------------------
    def _circuits_followed(self, before: str) -> None:
        """The Circuits page took a new prompt (``before``: its last): the strip follows the
        counterfactual's position, if it is a token of the new prompt."""
        if self.page.prompt == before:
            return
        m = re.search(r"@(\d+)=", self.page.counterfactual)
        n = len(self._tokens())
        self.clicked = int(m.group(1)) if m and int(m.group(1)) < n else None

    @rule(prompt=st.sampled_from(PROMPTS))
    def set_prompt(self, prompt):
        self._step(faults_allowed=0 if self.view == "circuits" else 1)  # a page may refuse it
        before = self.page.prompt
        self.gallery.prompt = prompt
        self._circuits_followed(before)

    @rule(slug=st.sampled_from(SLUGS))
    def switch_page(self, slug):
        self._step(faults_allowed=1)        # the page opened catches up, and may refuse
        before = self.page.prompt
        self.gallery.view = slug
        self._circuits_followed(before)

    def _words(self, page) -> list[int]:
        tok = self.gallery.model.tokenizer
        ids = tok(page.prompt, add_special_tokens=False)["input_ids"]
        return [i for i, t in enumerate(ids) if tok.decode([t]).strip()]

    @precondition(lambda self: self.view == "patching")
    @rule(index=st.integers(0, 63), replacement=st.sampled_from(REPLACEMENTS))
    def patch_token(self, index, replacement):
        """On the patching page: click the ``index``-th word-bearing token, type its
        replacement (one of two tokens is refused)."""
        self._step(faults_allowed=1)
        page = self.in_view
        words = self._words(page)
        pos = words[index % len(words)] if words else 0
        page.param.update(cf_position=pos, cf_token=replacement)
        self.replaced = (pos, replacement)

    @precondition(lambda self: self.view == "dla")
    @rule(answer=st.sampled_from(ANSWERS))
    def type_answer(self, answer):
        """On the logit attribution page: type the answer to explain."""
        self._step(faults_allowed=1)
        self.in_view.answer = answer
        self.answer = answer

    @precondition(lambda self: self.view == "circuits")
    @rule(index=st.integers(0, 63), replacement=st.sampled_from(REPLACEMENTS))
    def click_token_and_type(self, index, replacement):
        """Click the ``index``-th word-bearing token (modulo their count), type a replacement."""
        self._step()
        words = [i for i, t in enumerate(self._tokens()) if t.strip()]
        pos = words[index % len(words)]
        self.page._strip.selected = [pos]          # the click
        self.page.replacement = replacement        # the typing
        self.clicked = pos

    @precondition(lambda self: self.view == "circuits")
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
        self._step(faults_allowed=0 if self.view == "circuits" else 1)
        with torch.enable_grad():
            self.gallery.workspace.push_edit(Ablate(layer, head))

    @precondition(lambda self: bool(self.gallery.workspace.edits))
    @rule()
    def remove_edit(self):
        self._step(faults_allowed=0 if self.view == "circuits" else 1)
        with torch.enable_grad():
            self.gallery.workspace.remove_edit(0)

    @precondition(lambda self: self.view == "circuits")
    @rule()
    def switch_method(self):
        self._step(faults_allowed=1)   # with a result shown, the other method is computed
        with torch.enable_grad():
            self.page.method = "eap-ig" if self.page.method == "eap" else "eap"

    @precondition(lambda self: self.view == "circuits")
    @rule(task=st.sampled_from(TASKS))
    def choose_task(self, task):
        """Pick a task (your pairs once some are pasted): a task computed before shows at
        once, another is computed once the page has scored (ioi refused)."""
        self._step(faults_allowed=1)
        if task in self.page.param.task.objects:
            with torch.enable_grad():
                self.page.task = task

    @precondition(lambda self: self.view == "circuits")
    @rule(n=st.sampled_from([2, 3]))
    def set_pairs(self, n):
        """Type the number of prompt pairs (a generated task's)."""
        self._step(faults_allowed=1)
        with torch.enable_grad():
            self.page.n_prompts = n

    def _pasted(self, first: str, n: int) -> None:
        """Pairs were taken in: the task 'your pairs', its circuit computed."""
        self.own_version += 1
        self.own = (first, n)
        page = self.page
        assert page.task == OWN_TASK and page.error == "" and not self.messages.records
        assert page.shown.task == OWN_TASK and list(page.shown.prompts[:1]) == [first]
        assert page.shown.n_pairs == n == len(page.shown.prompts)

    @precondition(lambda self: self.view == "circuits")
    @rule(text=st.sampled_from(OWN_PAIRS))
    def paste_pairs(self, text):
        """Paste pairs into 'Your own prompt pairs' and press Use: good pairs become the
        task, refused ones say why once and leave the page as it was."""
        self._step(faults_allowed=1)
        page = self.page
        before = (page.task, page.shown)
        page._own.area.value = text
        with torch.enable_grad():
            page._own.button.clicks += 1        # the Use button
        if text in OWN_CLEAN:
            self._pasted(OWN_CLEAN[text][0], len(OWN_CLEAN[text]))
        else:
            assert (page.task, page.shown) == before and page.error
            assert len(set(self.messages.records)) == 1, self.messages.records

    @precondition(lambda self: self.view == "circuits" and self.page.task == PROMPT_TASK)
    @rule()
    def name_variants(self):
        """Press 'Same pair with other names (8 pairs)': with a counterfactual that fits the
        prompt, its pair and 7 more become the task; else one message, the page as it was."""
        self._step(faults_allowed=1)
        page = self.page
        prompt, before = page.prompt, page.shown
        try:
            fits = page.replacement_of(prompt, page.counterfactual) is not None
        except ValueError:
            fits = False
        with torch.enable_grad():
            task = page.use_name_variants()
        if task is not None:
            assert fits
            self._pasted(prompt, 8)
        else:       # no counterfactual, one that does not fit, or no name to vary
            assert page.task == PROMPT_TASK and page.shown is before and page.error
            assert len(set(self.messages.records)) == 1, self.messages.records

    def _second_limit(self, text: str) -> tuple[int, int]:
        """``text``'s length in tokens and the sidebar's limit for a prompt (its own rule,
        `Gallery.prompt_limit`: tiny-llama's 256-token context, under the 2,048 cap)."""
        limit = self.gallery.prompt_limit
        assert limit == min(MAX_PROMPT_TOKENS, self.gallery.model.spec.context_length) == 256
        return len(self.gallery.model.tokenizer(text, add_special_tokens=False)["input_ids"]), limit

    @rule(text=st.sampled_from(SECOND_PROMPTS))
    def set_second_prompt(self, text):
        """Type the sidebar's second prompt (Prompt B) and press Enter: one over the
        sidebar's limit for a prompt is not set (a warning says why)."""
        self._step(faults_allowed=1 if self.view == "compare" else 0)
        ws = self.gallery.workspace
        before = ws.second_prompt
        n, limit = self._second_limit(text)
        assert self.gallery.submit_second_prompt(text) == (n <= limit)
        assert ws.second_prompt == (text if n <= limit else before)

    @rule(text=st.sampled_from(SECOND_PROMPTS))
    def set_second_prompt_in_workspace(self, text):
        """Set the second prompt on the workspace itself (what a notebook or a loaded state
        does): the sidebar's limit holds there too. One over it raises one InputError, one
        line naming its length and the limit, and the workspace keeps all it had."""
        self._step(faults_allowed=1 if self.view == "compare" else 0)
        ws = self.gallery.workspace
        before = ws.state()
        n, limit = self._second_limit(text)
        if n <= limit:
            ws.second_prompt = text
            assert ws.second_prompt == text
            return
        with pytest.raises(InputError) as refused:
            ws.second_prompt = text
        message = str(refused.value)
        assert "\n" not in message and f"the second prompt is {n:,} tokens" in message
        assert f"at most {limit:,} tokens" in message
        assert ws.state() == before and not self.messages.records

    @precondition(lambda self: self.view == "compare")
    @rule(view=st.sampled_from(COMPARE_VIEWS))
    def compare_with(self, view):
        """On the Two prompts page: pick what is set side by side."""
        self._step(faults_allowed=1)
        self.in_view.view = view
        self.compare_view = view

    @precondition(lambda self: self.view == "features" and self.in_view.index is not None)
    @rule(index=st.integers(0, 63))
    def pick_feature(self, index):
        """On the Feature dashboards page: type a feature (one of the dictionary's); its
        dashboards are computed on the prompt, which the page refuses again when it is over
        the model's context (one message)."""
        self._step(faults_allowed=1)
        page = self.in_view
        self.feature = index % page.index.sizes["feature"]
        page.feature = self.feature

    @precondition(lambda self: self.view == "features" and self.in_view.index is not None)
    @rule(index=st.integers(0, 63))
    def select_feature_in_the_sidebar(self, index):
        """Type one of the dictionary's features in the sidebar's box (L1.F<index>, the page's
        layer): the workspace selects it and the page shows it (selected again, it is the
        newest again and shown)."""
        self._step(faults_allowed=1)
        page = self.in_view
        self.feature = index % page.index.sizes["feature"]
        self.gallery.add_to_selection(f"L1.F{self.feature}")
        assert self.gallery.workspace.selected_features[-1] == f"L1.F{self.feature}"
        assert page.feature == self.feature

    @precondition(lambda self: self.view == "circuits" and self.page.scores is not None)
    @rule(index=st.integers(0, 63))
    def move_slider(self, index):
        self._step()
        options = list(self.page._slider.options.values())
        self.page._slider.value = options[index % len(options)]

    def _stale(self) -> bool:
        """This test's own reading of whether the shown circuit is of other inputs than the
        page's current ones: the task and method; for 'your prompt' the prompt, the
        counterfactual and the token to explain; for a generated task the number of pairs;
        for your pairs the paste (this test's count of good ones)."""
        page, shown = self.page, self.page.shown
        request = dict(shown.request)
        if shown.task != page.task or shown.method != page.method:
            return True
        if shown.task == PROMPT_TASK:
            return (shown.prompts[0] != page.prompt
                    or request["counterfactual"] != page.counterfactual.strip()
                    or request["explain"] != page.explain)
        if shown.task == OWN_TASK:
            return request["own"] != self.own_version
        return shown.n_pairs != page.n_prompts

    # a person presses Compute when there is something to compute (or to retry)
    @precondition(lambda self: self.view == "circuits" and (
        self.page.shown is None or self.page.error or self._stale()))
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
            if m and self.page.task == PROMPT_TASK and len(re.findall(rf"(?<!\w){m.group(1)}(?!\w)", self.page.prompt)) > 1:
                assert "occurs" in self.page.error and "positions" in self.page.error
        else:
            assert self.page.shown is not before and not self.page.stale_note()

    @rule()
    def follow_link(self):
        """Open the session's link in a new session and work there. A session whose prompt
        is over the sidebar's limit (set here past the sidebar, as a notebook or a state
        written for a longer context can) writes a link that the new session refuses whole,
        with one message naming the prompt's length and the limit: the person stays."""
        self._step(faults_allowed=1)        # the page opened may refuse the prompt
        query, _ = self.gallery.link()
        state = dict(p.split("=", 1) for p in query.lstrip("?").split("&")).get("s")
        view = self.view
        other = Gallery("tiny-llama", views=VIEWS)
        n, limit = self._second_limit(self.gallery.workspace.prompt)
        if n > limit:
            opening = other.workspace.state()
            assert not other.open_link(view, state)
            assert f"the prompt is {n:,} tokens" in other.link_message
            assert f"at most {limit:,} tokens" in other.link_message
            assert other.workspace.state() == opening
            assert len(set(self.messages.records)) == 1, self.messages.records
            self.messages.records.clear()   # the new session's message, checked here
            other.close()
            return
        assert other.open_link(view, state) if state else True
        other.view = view
        a, b = self.gallery.workspace, other.workspace
        assert (a.prompts, a.second_prompt, a.selected, a.selected_edges,
                a.selected_positions) == (b.prompts, b.second_prompt, b.selected,
                                          b.selected_edges, b.selected_positions)
        assert [e.to_dict() for e in a.edits] == [e.to_dict() for e in b.edits]
        assert self.gallery.page_settings(view) == other.page_settings(view)
        if view == "circuits":
            assert other.page("circuits").clicked == self.page.clicked
        else:   # the other pages open afresh there: nothing clicked, typed or computed yet
            self.clicked = None
            if view != "dla":
                self.answer = ""
            if view != "patching":
                self.replaced = None
        if view != "compare":
            self.compare_view = "lens"
        if view != "features":
            self.feature = 0
        # the Circuits page's link holds its pasted pairs, which the new session takes in once
        if view == "circuits" and self.own is not None:
            self.own_version = 1
        else:
            self.own_version, self.own = 0, None
        # the person now works in the new session (nothing computed there yet)
        self.gallery.close()
        self.gallery = other

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def one_message_per_fault(self):
        if not hasattr(self, "messages"):
            return
        # the same message again is the same notification (`apps.theme.notify` replaces it)
        n = len(set(self.messages.records))
        assert n <= self.faults_allowed, self.messages.records
        if n:
            assert self.in_view.error and self.in_view.error in self.messages.records[0]

    @invariant()
    def the_replaced_position_is_the_clicked_one(self):
        if not hasattr(self, "gallery") or self.clicked is None or self.view != "circuits":
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
        if not hasattr(self, "gallery") or self.view != "circuits":
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
        pairs = shown.n_pairs
        assert f"{label} scores of {'1 pair' if pairs == 1 else f'{pairs} pairs'}." in own
        other = "EAP-IG" if label == "EAP" else "EAP scores"
        assert other not in own
        assert f"Shown: {n:,} edges" in own or f": {n:,} edges (top {page.n_edges:,} by" in own
        code = page.code_snippet()
        assert f"method={shown.method!r}" in code
        if shown.task == PROMPT_TASK:
            # one pair: no interval, and why; the gap the recovery is a share of
            assert "One pair: the recovery has no interval" in own and "gap" in own
            assert scope.startswith(f"your prompt {one_line(shown.prompts[0])}")
            if shown.counterfactual is not None:
                assert counterfactual_text(shown.counterfactual) in scope
            assert repr(shown.prompts[0]) in code
            return
        # a task's pairs: the record holds them all; the mean gap over them
        assert pairs == len(shown.prompts) > 1 and f"over the {pairs} pairs" in own
        if shown.task == OWN_TASK:
            assert scope.startswith(f"your own prompt pairs ({pairs} pairs)")
            assert self.own == (shown.prompts[0], pairs)
            assert shown.prompts[0] in code
        else:
            assert scope.startswith(f"task pairs: {shown.task}, {pairs} pairs")
            assert f"make_task({shown.task!r}, {pairs}" in code

    @invariant()
    def a_stale_result_is_marked_stale(self):
        if not hasattr(self, "gallery") or self.view != "circuits" or self.page.shown is None:
            return
        page, stale = self.page, self._stale()
        assert page.redraw()["title"].endswith("(outdated)") == stale
        assert page._caption().startswith("**Outdated.**") == stale
        assert ("Outdated:" in page.scope().on) == stale

    # -- the other pages: their words and stale notes against the record and this model ------
    def _expected_stale(self, shown) -> bool:
        """This test's own reading: whether the inputs the page in view shows its result for
        differ from the workspace's (and from what the person typed on the page). The Two
        prompts page reads both prompts, the edits and its view; the Feature dashboards the
        prompt and the feature, not the edits (the dictionary reads the clean model)."""
        ws = self.gallery.workspace
        if self.view == "compare":
            return (tuple(shown.prompts) != (ws.prompt, ws.second_prompt)
                    or list(shown.edits) != [edit_label(e) for e in ws.edits]
                    or dict(shown.request)["view"] != self.compare_view)
        if self.view == "features":
            return (shown.prompts[0] != ws.prompt
                    or dict(shown.request)["feature"] != self.feature)
        stale = (shown.prompts[0] != ws.prompt
                 or list(shown.edits) != [edit_label(e) for e in ws.edits])
        if self.view == "dla":
            stale |= dict(shown.request)["pickers"] != (self.answer, "")
        if self.view == "patching":
            stale |= dict(shown.request)["replacement"] != self.replaced
        return stale

    @invariant()
    def the_page_in_view_says_what_its_result_was_computed_on(self):
        if not hasattr(self, "gallery") or self.view == "circuits":
            return
        page = self.in_view
        shown = page.shown_provenance()
        if shown is None:
            assert page.stale_note() == ""
            return
        assert shown.model == "tiny-llama"
        on = _markdown(one_line(shown.prompts[0]))
        if self.view == "dla":
            caption = page.caption()
            assert caption.startswith(f"On {on} (tiny-llama).")
            a, b = theme.show_token(shown.answer), theme.show_token(shown.wrong)
            assert dla_title(page.result) == f"clean: logit({a}) − logit({b})"
            for label in shown.edits or ["No workspace edits"]:
                assert _markdown(label) in caption
        elif self.view == "patching":
            caption = page.caption()
            assert caption.startswith(f"On {on} (tiny-llama).")
            cf = shown.counterfactual
            assert cf is not None and cf.position == shown.positions[0]
            assert (f"position {cf.position}: {_markdown(repr(cf.old))} -> "
                    f"{_markdown(repr(cf.new))}") in caption
            r = dict(shown.request)
            assert patching_title(page.result).endswith(f", {r['direction']}")
            assert r["replacement"][0] == cf.position
            for label in shown.edits:
                assert _markdown(label) in caption
        elif self.view == "compare":
            ds = page.result
            caption = compare_caption(ds)
            assert caption.startswith(f"A: {_markdown(one_line(shown.prompts[0]))} (")
            if shown.prompts[1]:
                assert f" · B: {_markdown(one_line(shown.prompts[1]))} (" in caption
            assert ("Both prompts under the workspace's edits" in caption) == bool(shown.edits)
            view, r = dict(shown.request)["view"], dict(shown.request)
            what = {"lens": "logit lens, top-1 probability",
                    "saturation": f"saturation layer of the top-{r.get('k')} tokens",
                    "dla": f"logit({theme.show_token(shown.answer)}) − "
                           f"logit({theme.show_token(shown.wrong)})"}.get(view)
            if what is not None:
                assert compare_title(ds, "A") == f"A: {what}"
        elif self.view == "features":
            r = dict(shown.request)
            title = dashboard_title(shown)
            assert title.startswith(f"**ITDA atom {r['feature']}** of the ITDA dictionary "
                                    f"at layer 1 (128 corpus tokens)")
            assert _markdown(one_line(shown.prompts[0])) in title
            # the dashboards shown are of the record's feature and prompt
            assert int(page.contexts.attrs["feature"]) == r["feature"]
            assert page.on_prompt.attrs["prompt"] == shown.prompts[0]
            assert not shown.edits
        else:       # the pages with a heading over their result (`ShownRecord`)
            heading = page.heading_html()
            assert html.escape(one_line(shown.prompts[0])) in heading
            assert ("workspace edit" in heading) == bool(shown.edits)
        stale = self._expected_stale(shown)
        assert bool(page.stale_note()) == stale, (page.stale_note(), shown)
        if stale:
            note = page.stale_note()
            assert one_line(shown.prompts[0]) in note     # what it was computed on
            # and what the page is doing about it, in every page's words: a refusal or a
            # failure exactly when the page's message says one
            assert note.endswith(STALE_ENDINGS), note
            assert ("the message above says why" in note) == bool(page.error), (note, page.error)


def walk(steps, machine: WorkspaceWalk | None = None) -> WorkspaceWalk:
    """Run the rules ``steps`` ((name, kwargs) pairs) in order on ``machine`` (default: a new
    one), every invariant checked after each, as Hypothesis does."""
    if machine is None:
        machine = WorkspaceWalk()
        machine.open_gallery()
    invariants = [getattr(machine, n) for n in (
        "one_message_per_fault", "the_replaced_position_is_the_clicked_one",
        "texts_about_the_shown_result_match_its_provenance", "a_stale_result_is_marked_stale",
        "the_page_in_view_says_what_its_result_was_computed_on")]
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


def test_a_walk_through_the_pages(tiny_model):
    """Patching on a token, a prompt over its 64 tokens (refused: the old grid is marked
    outdated and keeps its words), an edit, a refused replacement; logit attribution with a
    refused answer and a prompt over its 256 tokens, whose link another session refuses
    whole (the prompt is over the sidebar's limit too); the lens refusing that prompt; the
    attention and saturation pages catching up as they open; a link followed from two
    pages."""
    m = walk([("switch_page", {"slug": "patching"}),
              ("patch_token", {"index": 0, "replacement": "M"}),
              ("set_prompt", {"prompt": PROMPTS[3]})])
    try:
        assert m.in_view.stale_note() and m.in_view.shown_provenance().prompts[0] == PROMPTS[0]
        walk([("add_edit", {"layer": 0, "head": 1}), ("set_prompt", {"prompt": PROMPTS[1]}),
              ("patch_token", {"index": 2, "replacement": "Ed"})], m)
        assert "the replacement token changed" in m.in_view.stale_note()
        walk([("switch_page", {"slug": "dla"}), ("type_answer", {"answer": "zz"})], m)
        assert "the answer or alternative changed" in m.in_view.stale_note()
        walk([("type_answer", {"answer": ""}), ("set_prompt", {"prompt": PROMPTS[4]})], m)
        assert "the prompt changed" in m.in_view.stale_note()
        # its link is refused whole: the prompt is over the sidebar's limit (the person stays)
        walk([("follow_link", {})], m)
        assert m.gallery.workspace.prompt == PROMPTS[4] and m.view == "dla"
        walk([("switch_page", {"slug": "lens"}), ("set_prompt", {"prompt": PROMPTS[2]}),
              ("set_prompt", {"prompt": PROMPTS[4]})], m)
        assert "the prompt changed since" in m.in_view.stale_note()    # over the lens's 256
        walk([("set_prompt", {"prompt": PROMPTS[2]}),
              ("switch_page", {"slug": "attention"}), ("remove_edit", {}),
              ("switch_page", {"slug": "saturation"}), ("follow_link", {}),
              ("switch_page", {"slug": "patching"}),
              ("patch_token", {"index": 1, "replacement": "K"}), ("follow_link", {})], m)
        shown = m.in_view.shown_provenance()       # the new session computed the link's grid
        assert shown.prompts[0] == PROMPTS[2] and dict(shown.request)["replacement"][1] == "K"
    finally:
        m.teardown()


def test_a_walk_through_the_circuit_tasks(tiny_model):
    """The task add scored (2 pairs, then 3), ioi refused (add's circuit marked outdated:
    the task changed), back to your prompt: the second J clicked and replaced, the same pair
    with other names (8 pairs), refused and good pasted pairs, add again (its result shown at
    once), EAP-IG, and a link followed, which holds the pasted pairs."""
    m = walk([("choose_task", {"task": "add"})])
    try:
        assert m.page.shown is None     # nothing scored yet: the button computes
        walk([("compute", {}), ("set_pairs", {"n": 3})], m)
        assert m.page.shown.task == "add" and m.page.shown.n_pairs == 3
        walk([("choose_task", {"task": "ioi"})], m)
        assert m.page.error and m.page.redraw()["title"].endswith("(outdated)")
        walk([("choose_task", {"task": PROMPT_TASK}), ("compute", {}),
              ("click_token_and_type", SECOND_J), ("name_variants", {})], m)
        assert m.page.shown.n_pairs == 8 and "bootstrap interval over the 8" in m.page._caption()
        walk([("paste_pairs", {"text": OWN_PAIRS[1]}), ("paste_pairs", {"text": OWN_PAIRS[0]}),
              ("choose_task", {"task": "add"}), ("choose_task", {"task": OWN_TASK}),
              ("switch_method", {}), ("follow_link", {})], m)
        # the link holds the pasted pairs: the new session scored them, by EAP-IG, once
        shown = m.page.shown
        assert (m.page.task, shown.task, shown.method) == (OWN_TASK, OWN_TASK, "eap-ig")
        assert list(shown.prompts) == OWN_CLEAN[OWN_PAIRS[0]] and len(m.page._results) == 1
    finally:
        m.teardown()


def test_a_walk_through_two_prompts_and_feature_dashboards(tiny_model):
    """Prompt B typed, the Two prompts page opened, a B over its 128 tokens refused (the
    old comparison marked outdated), the attribution view, an edit; the feature dashboards:
    a feature selected in the sidebar, one picked on the page, an edit (which they do not
    read: not outdated), a new prompt; links; the sidebar's feature selected again."""
    m = walk([("set_second_prompt", {"text": SECOND_PROMPTS[1]}),
              ("switch_page", {"slug": "compare"}),
              ("set_second_prompt", {"text": SECOND_PROMPTS[3]})])
    try:
        assert "prompt B changed" in m.in_view.stale_note()
        walk([("set_second_prompt_in_workspace", {"text": SECOND_PROMPTS[6]}),
              ("set_second_prompt", {"text": SECOND_PROMPTS[6]}),
              ("set_second_prompt_in_workspace", {"text": SECOND_PROMPTS[2]}),
              ("set_second_prompt", {"text": SECOND_PROMPTS[2]}),
              ("compare_with", {"view": "dla"}), ("add_edit", {"layer": 0, "head": 1}),
              ("follow_link", {}), ("switch_page", {"slug": "features"}),
              ("select_feature_in_the_sidebar", {"index": 5}),
              ("pick_feature", {"index": 3}), ("add_edit", {"layer": 1, "head": 0}),
              ("set_prompt", {"prompt": PROMPTS[1]}), ("follow_link", {})], m)
        assert m.in_view.shown.prompts[0] == PROMPTS[1]
        assert dict(m.in_view.shown.request)["feature"] == 3   # the page's own pick, last
        assert m.gallery.workspace.selected_features == ["L1.F5"]
        walk([("select_feature_in_the_sidebar", {"index": 5})], m)   # selected again: shown
        assert dict(m.in_view.shown.request)["feature"] == 5
    finally:
        m.teardown()


_WALK_SETTINGS = dict(deadline=None, database=None, print_blob=False,
                      phases=[Phase.explicit, Phase.generate, Phase.shrink],
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                             HealthCheck.filter_too_much])


@pytest.mark.slow
def test_walking_the_workspace_keeps_every_page_text_true(tiny_model):
    """Fixed seed, a few short walks from a page drawn at random (20-30 s of wall time here,
    on a loaded 2-core machine); EXPLORER_MACHINE_EXAMPLES for more (30 walks of 25 steps:
    about 6 minutes)."""
    run_state_machine_as_test(WorkspaceWalk, settings=settings(
        max_examples=EXAMPLES or 8, stateful_step_count=10 if not EXAMPLES else 25,
        derandomize=True, **_WALK_SETTINGS))


@pytest.mark.slow
@pytest.mark.parametrize("walk_seed", SEEDS)
def test_walks_from_other_seeds_keep_every_page_text_true(tiny_model, walk_seed):
    """Longer walks drawn from the seed ``walk_seed`` (``EXPLORER_MACHINE_SEEDS``): 6 walks of
    20 steps each (about a minute here), EXPLORER_MACHINE_EXAMPLES walks of 25 for more."""
    run_state_machine_as_test(seed(walk_seed)(lambda: WorkspaceWalk()), settings=settings(
        max_examples=EXAMPLES or 6, stateful_step_count=20 if not EXAMPLES else 25,
        derandomize=False, **_WALK_SETTINGS))


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


def test_a_page_opened_recomputes_once_on_the_inputs_set_while_it_was_hidden(tiny_model):
    """On the Two prompts page a prompt B over its 128 tokens (refused); on another page B
    changes (still over) and a head is selected. Opening Two prompts gives one message, of
    the B now set: the page takes the prompts and edits in one update before the head (which
    set alone first recomputed it on the old B: two messages; a walk the machine found)."""
    m = walk([("switch_page", {"slug": "compare"}),
              ("set_second_prompt", {"text": SECOND_PROMPTS[5]}),
              ("switch_page", {"slug": "saturation"}),
              ("set_second_prompt_in_workspace", {"text": SECOND_PROMPTS[3]}),
              ("select_component", {"name": "L1.H0"}), ("switch_page", {"slug": "compare"})])
    try:
        assert m.in_view.second_prompt == SECOND_PROMPTS[3]
        assert (m.in_view.layer, m.in_view.head) == (1, 0)
        assert "Prompt B is 181 tokens" in m.in_view.error
        assert "prompt B changed" in m.in_view.stale_note()
    finally:
        m.teardown()


def test_a_head_selected_outside_the_attention_view_recomputes_nothing(tiny_model):
    """On Two prompts, saturation view, prompt B over its 128 tokens (refused, one message):
    selecting a head changes nothing the view reads, so nothing is recomputed and no message
    repeats; the attention view then reads the head (a walk the machine found)."""
    m = walk([("switch_page", {"slug": "compare"}),
              ("set_second_prompt", {"text": SECOND_PROMPTS[3]}),
              ("compare_with", {"view": "saturation"}), ("select_component", {"name": "L1.H0"})])
    try:
        assert "Prompt B is 181 tokens" in m.in_view.error
        walk([("set_second_prompt", {"text": SECOND_PROMPTS[2]}),
              ("compare_with", {"view": "attention"})], m)
        shown = m.in_view.shown_provenance()
        assert dict(shown.request)["head"] == (1, 0) and m.in_view.error == ""
    finally:
        m.teardown()


def test_a_link_opens_the_enlarged_head_without_selecting_it(tiny_model):
    """On the Attention page a head selected enlarges it; dropped from the workspace, the page
    keeps it enlarged. The link carries the enlarged head (layer, head) and the empty
    selection: the new session enlarges the same head and selects nothing (setting the layer,
    then the head, selected neither the head in between nor the last; a walk the machine
    found)."""
    m = walk([("switch_page", {"slug": "attention"}), ("select_component", {"name": "L2.H3"}),
              ("drop_component", {})])
    try:
        assert m.in_view.selected == "L2.H3" and m.gallery.workspace.selected == []
        walk([("follow_link", {})], m)
        assert m.gallery.workspace.selected == [] and m.in_view.selected == "L2.H3"
    finally:
        m.teardown()



def test_a_second_prompt_over_the_limit_is_refused_by_link_state_and_workspace(tiny_model):
    """A second prompt one token over the sidebar's limit for a prompt (one letter a token on
    tiny-llama, so 257 letters), in a link or a state written where no limit held (a
    workspace without the model's tokenizer): the link opens the page alone with one message
    naming the length and the limit, the state is not imported, and the session keeps its
    prompt, second prompt, selection and edits. 256 letters pass."""
    g = Gallery("tiny-llama", views=VIEWS[1:2], view="lens")
    try:
        limit = g.prompt_limit
        assert limit == 256 and len(g.model.tokenizer("x" * 10, add_special_tokens=False)[
            "input_ids"]) == 10
        ws = g.workspace
        assert g.submit_second_prompt(SECOND_PROMPTS[2])
        ws.select("L1.H0")
        ws.push_edit(Ablate(0, 1))
        before = ws.state()
        elsewhere = Workspace(model_name="tiny-llama", prompts=[PROMPTS[2]],
                              second_prompt="x" * (limit + 1))          # no tokenizer: kept
        text, _ = workspace_link(elsewhere, view="lens")
        assert not g.open_link("lens", text)
        assert f"the second prompt is {limit + 1:,} tokens" in g.link_message
        assert f"at most {limit:,} tokens" in g.link_message and "\n" not in g.link_message
        assert ws.state() == before and g.view == "lens"
        g.import_state(elsewhere.to_json())
        assert g.state_message.startswith("Could not import the state: the second prompt is "
                                          f"{limit + 1:,} tokens")
        assert ws.state() == before
        with pytest.raises(InputError, match=f"at most {limit:,} tokens"):
            ws.update_from(elsewhere)
        assert ws.state() == before
        with pytest.raises(InputError, match=f"{limit + 1:,} tokens"):
            Workspace.from_model(g.model, second_prompt="x" * (limit + 1))
        # at the limit: the link opens whole
        elsewhere.second_prompt = "x" * limit
        text, _ = workspace_link(elsewhere, view="lens")
        assert g.open_link("lens", text) and ws.second_prompt == "x" * limit
        assert ws.prompt == PROMPTS[2] and ws.edits == []
    finally:
        g.close()
