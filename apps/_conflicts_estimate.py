"""How long the Knowledge conflicts page's *Select heads as JuICE does* takes, said on its
button before it is pressed.

JuICE's head selection (`explorer.analyses.conflicts.juice_head_selection`, Li et al.,
ICML 2025) makes, for each prompt type, one run 1 over the facts, then one run per head over
the facts x the alpha grid, resumed at the head's layer; with pruning the substitution and
coherent types score only the heads still consistent after the types before. The estimate
times the selection's own unit on this machine (`measure_selection_timing`: one run resumed
at the first layer over the facts x alphas batch, for the clean and the coherent prompts,
the shortest and the longest) and counts the runs the setting makes
(`estimated_selection_seconds`)."""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import panel as pn
import param

from apps._session import CancelToken
from explorer.analyses import conflicts as C

__all__ = ["KEPT_AFTER_PRUNING", "SelectionTiming", "measure_selection_timing",
           "estimated_selection_seconds", "selection_seconds_range", "duration_words",
           "selection_estimate_line", "SELECT_LABEL", "EstimatePart", "forget_timings"]

KEPT_AFTER_PRUNING = {
    "parametric": {"clean": 1.0, "substitution": 67 / 270, "coherent": 46 / 270},
    "context": {"clean": 1.0, "substitution": 254 / 270, "coherent": 201 / 270},
}
"""Per direction, the share of the heads scored on each prompt type with pruning, as
SmolLM2-135M's selection on 4 facts scored them (``n_scored`` of
``docs/figures/conflicts_summary_<direction>_select4.json``: parametric 270, 67, 46; context
270, 254, 201: toward the context few heads fail the test, so pruning saves little). A
model whose heads rarely fail the test (a random-init one scores 80-90%) takes longer: the
estimate's high end scores every head."""

N_ALPHAS = len(C.ENHANCE_ALPHAS) + len(C.SUPPRESS_ALPHAS)
"""Rows per fact in a selection run: the fact repeated once per alpha of the grid."""


@dataclass(frozen=True)
class SelectionTiming:
    """What `measure_selection_timing` measured: ``tokens`` of each prompt type's batch
    (facts x alphas rows times the padded width, in `C.PROMPT_KINDS` order), ``n_alphas``,
    and the seconds of one run resumed at the first layer over the clean and the coherent
    batch (``clean_seconds``, ``coherent_seconds``)."""

    tokens: tuple[int, ...]
    n_alphas: int
    clean_seconds: float
    coherent_seconds: float

    def run_seconds(self, tokens: float) -> float:
        """Seconds of one full-depth run over ``tokens``: the line through the two measured
        runs (a fixed cost per run and a cost per token), never below zero."""
        t0, t1 = self.tokens[0], self.tokens[-1]
        s0, s1 = self.clean_seconds, self.coherent_seconds
        per_token = max(0.0, (s1 - s0) / (t1 - t0)) if t1 > t0 else s1 / max(1, t1)
        fixed = max(0.0, s1 - per_token * t1)
        return fixed + per_token * tokens


def measure_selection_timing(model: Any, facts: Sequence[C.Fact], *, n_alphas: int = N_ALPHAS,
                             check: Callable[[], None] | None = None) -> SelectionTiming:
    """Time the selection's unit on ``model``: for the clean and the coherent prompts of
    ``facts``, run 1 over the facts x ``n_alphas`` batch and then one run resumed at the
    first layer with one head's output added (what the selection does per head), timed
    twice (the faster) after a one-row warm-up run. ``check`` is called between runs (a
    job's `CancelToken.check`)."""
    check = check or (lambda: None)
    facts = list(facts)
    tokens = tuple(len(facts) * n_alphas
                   * model.tokenize([C.conflict_prompt(f, kind) for f in facts]).width
                   for kind in C.PROMPT_KINDS)
    # warm-up: the first resumed run of a process pays one-time costs the selection's
    # hundreds of runs do not
    C.juice_logits(model, None, [(0, 0)],
                   run1=C.juice_first_run(model, [C.conflict_prompt(facts[0], "clean")]))
    seconds = []
    for kind in ("clean", "coherent"):
        check()
        run1 = C.juice_first_run(model, [C.conflict_prompt(f, kind) for f in facts] * n_alphas)
        times = []
        for _ in range(2):     # the faster of two: one run is at the mercy of a busy moment
            check()
            started = time.perf_counter()
            C.juice_logits(model, None, [(0, 0)], run1=run1)
            times.append(time.perf_counter() - started)
        seconds.append(min(times))
    return SelectionTiming(tokens, n_alphas, *seconds)


def estimated_selection_seconds(n_layers: int, n_heads: int, timing: SelectionTiming,
                                kept: dict[str, float] | None = None) -> float:
    """Seconds of the selection: per prompt type, run 1 over the facts and ``kept[kind]``
    (default 1: every head) x layers x heads runs over the facts x alphas, a run resumed at
    layer l costing (L - l + 1) / (L + 1) of one from the first layer (the layers it runs,
    plus the fixed part), so the mean over layers is (L + 3) / (2 (L + 1))."""
    kept = kept or {}
    depth = (n_layers + 3) / (2 * (n_layers + 1))
    total = 0.0
    for kind, tokens in zip(C.PROMPT_KINDS, timing.tokens):
        total += timing.run_seconds(tokens / timing.n_alphas)              # run 1
        total += kept.get(kind, 1.0) * n_layers * n_heads * depth * timing.run_seconds(tokens)
    return total


def selection_seconds_range(n_layers: int, n_heads: int, timing: SelectionTiming,
                            direction: str = "parametric") -> tuple[float, float]:
    """(low, high): heads pruned as on SmolLM2 toward ``direction``
    (`KEPT_AFTER_PRUNING`), and none pruned."""
    return (estimated_selection_seconds(n_layers, n_heads, timing, KEPT_AFTER_PRUNING[direction]),
            estimated_selection_seconds(n_layers, n_heads, timing))


def duration_words(low: float, high: float) -> str:
    """'about 20–50 s', 'about 5–13 min', 'about 40 s–2 min' (one value where both round
    alike)."""
    def words(s: float) -> tuple[str, str]:
        return (f"{max(1, round(s)):d}", "s") if s < 90 else (f"{max(1, round(s / 60)):d}", "min")
    (a, ua), (b, ub) = words(low), words(high)
    if (a, ua) == (b, ub):
        return f"about {b} {ub}"
    return f"about {a}–{b} {ub}" if ua == ub else f"about {a} {ua}–{b} {ub}"


def selection_estimate_line(n_layers: int, n_heads: int, n_facts: int,
                            timing: SelectionTiming | None, direction: str = "parametric") -> str:
    """The words beside the button: the time range and what it counts, or that the time is
    being measured."""
    if timing is None:
        return "Measuring how long the selection takes here…"
    low, high = selection_seconds_range(n_layers, n_heads, timing, direction)
    return (f"Takes {duration_words(low, high)} here: {n_facts} fact"
            f"{'s' if n_facts != 1 else ''} × {timing.n_alphas} α × 3 prompt types over "
            f"{n_layers * n_heads} heads, from one run timed on this machine "
            f"({timing.clean_seconds:.2f} s clean, {timing.coherent_seconds:.2f} s coherent). "
            "Fewer heads pruned: the longer end.")


SELECT_LABEL = "Select heads as JuICE does"

_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> {selection facts' key: `SelectionTiming`}: what the pages of this process measured
(every session's page on a model reads and adds to the same dict)."""


def forget_timings() -> None:
    """Drop every measured timing: the next page to show bars measures again (after the
    machine's load changed, or in a test that needs a measurement)."""
    for timings in list(_MEASURED.values()):
        timings.clear()             # the pages hold these dicts
    _MEASURED.clear()


class EstimatePart(param.Parameterized):
    """The selection's time estimate of `apps.conflicts.ConflictsView`: measured once per
    set of selection facts (after the first bars, off the busy state), shown on the button
    and beside it."""

    timing_version = param.Integer(default=0, precedence=-1,
                                   doc="Bumped when a selection timing arrives.")

    def _init_estimate(self, measure: bool) -> None:
        # the timings measured on this model in this process, by the selection's facts: a
        # new session's page reuses them (the machine is the same) rather than taking the
        # cores for another measurement
        self._timings = _MEASURED.setdefault(self._model, {})
        self._measure_time = measure
        self.runner("timing", self._got_timing, busy=False, heavy=False, counted=False)
        self.param.watch(lambda *_: self._request_timing(), ["select_facts"])

    def selection_facts(self) -> list[C.Fact]:
        """The facts *Select heads as JuICE does* averages over: the example and the next
        ones in the list, `select_facts` in all."""
        labels = list(self._facts)
        start = labels.index(self.example)
        return [self._facts[labels[(start + i) % len(labels)]]
                for i in range(min(int(self.select_facts), len(labels)))]

    def _timing_key(self) -> tuple[str, ...]:
        return tuple(f"{f.subject}|{f.relation}|{f.memory}|{f.context}"
                     for f in self.selection_facts())

    def selection_timing(self) -> SelectionTiming | None:
        """The measured timing of the current selection facts; None until measured."""
        return self._timings.get(self._timing_key())

    def _request_timing(self) -> None:
        """Measure the selection's unit for the current facts, once the page shows bars (the
        first result comes first) and unless measured already."""
        if not self._measure_time or self.bar_rows is None or self.selection_timing():
            return
        model, facts, key = self._model, self.selection_facts(), self._timing_key()

        def job(token: CancelToken) -> tuple:
            return key, measure_selection_timing(model, facts, check=token.check)
        self.submit("timing", job)

    def _yield_timing(self) -> None:
        """The person's work comes first: a measurement in flight stops at its next run (it
        would slow a drag's previews and be slowed by them), and starts again after the next
        exact bars (`_request_timing`)."""
        self.cancel("timing")

    def page_hidden(self) -> None:
        """The gallery showed another page: the measurement gives way to that page's work."""
        self._yield_timing()

    def page_shown(self) -> None:
        """The gallery shows this page again: measure what is not measured yet."""
        self._request_timing()

    def _got_timing(self, result: tuple) -> None:
        key, timing = result
        self._timings[key] = timing
        self.timing_version += 1

    def selection_seconds(self) -> tuple[float, float] | None:
        """(low, high) seconds of the selection with the current setting; None unmeasured."""
        timing = self.selection_timing()
        if timing is None:
            return None
        return selection_seconds_range(self._model.n_layers, self._model.spec.n_heads, timing,
                                       self.direction)

    def select_label(self, *_: Any) -> str:
        """The button's label, with the time it takes once measured."""
        seconds = self.selection_seconds()
        return SELECT_LABEL if seconds is None else f"{SELECT_LABEL} ({duration_words(*seconds)})"

    def select_widgets(self) -> tuple[pn.widgets.Button, pn.pane.Markdown]:
        """*Select heads as JuICE does* (its label with the time) and the line under it."""
        p = self.param
        depends = (p.select_facts, p.example, p.direction, p.timing_version)
        select = pn.widgets.Button(
            label=pn.bind(self.select_label, *depends),
            description="Score every head by adding its output (α = the paper's grid) on the "
                        "three prompt types of the selection facts, keep those that help on all "
                        "three (the paper's selection). The time on the button is measured on "
                        "this machine; the time left is shown while it runs.")
        select.on_click(lambda *_: self._request("select"))
        estimate = pn.pane.Markdown(
            pn.bind(self.select_estimate_words, *depends),
            css_classes=["cf-select-estimate"], sizing_mode="stretch_width",
            styles={"font-size": "0.85em", "color": "#555"}, margin=(0, 10))
        return select, estimate

    def select_estimate_words(self, *_: Any) -> str:
        """The line beside the button (empty where the time is not measured on this page)."""
        if not self._measure_time:
            return ""
        return selection_estimate_line(self._model.n_layers, self._model.spec.n_heads,
                                       len(self.selection_facts()), self.selection_timing(),
                                       self.direction)
