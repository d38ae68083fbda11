"""User study page: put a page's explanation in front of participants, with a baseline and a
placebo, and watch the pre-registered analysis as answers come in (Pičulin et al., ICML 2025).

The researcher picks a source page (the Logit lens or the Logit attribution page) and the
conditions: the page's explanation, a baseline without one, and a placebo of the same form and
length (the lens of another prompt; the same attributions on random heads). *Build study*
writes a study file (`explorer.studies.study_from_dict` checks it), computes every item once
with the session's model (`StudyRun.prepare`: the sidebar prompt is the first item) and keeps
the answers in the run's SQLite database. *Open to participants* gives a link on the server
that serves the gallery (``/study?run=<key>``): each browser session there is one participant
(`apps.study.StudySession`: consent, a code, the items, answers saved as given). The analysis
under the link (`explorer.studies.analyse`: accuracy per condition with a bootstrap interval
over participants, each hypothesis's permutation p-value, Holm's correction) follows the
answers as they arrive.

The study built keeps its record (`StudyBuilderView.shown`, a `Provenance`): the source page,
its explanation and settings (and the source page's shown result it followed), the items and
the conditions. The heading and preview are written from it, so they keep naming the
explanation the study was built from when the source page or the settings move on; a note then
says what changed since and that *Build study* updates it.

The link's key is a secret like a password: it is shown on this page only, never in the page's
export, its link or the server's log. The participants' codes stay in the run's database.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import html
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._controls import caption, labelled_control
from apps._page_provenance import STALE_STYLE
from apps._provenance import Provenance, changed_inputs, computed_at_now, one_line
from apps._recipe import MODEL, Call, Expr, Let, Note, Recipe, Ref
from apps._server import open_runs
from apps._session import CancelToken
from apps._view import STATIC_TOOLS, Scope, View, serve, shown_dataset
from explorer._checks import InputError
from explorer.studies.analysis import analyse
from explorer.studies.run import StudyRun
from explorer.studies.schema import study_from_dict

__all__ = ["StudyBuilderView", "SOURCES", "DEFAULT_ITEMS", "study_dict", "analysis_tables",
           "analysis_html", "accuracy_plot", "open_runs", "participant_page", "STUDIES_ENV",
           "study_record", "study_heading", "study_stale_text"]

hv.extension("bokeh", logo=False)

STUDIES_ENV = "EXPLORER_STUDIES"
"""Environment variable: the folder the page keeps its study runs in (default
``~/.cache/explorer/studies``)."""

#: Source page slug -> (its title, explanation kind, task kind, placebo of the same form).
SOURCES: dict[str, tuple[str, str, str, str]] = {
    "lens": ("Logit lens", "logit_lens", "predict_next_token", "mismatched_example"),
    "dla": ("Logit attribution", "head_attribution", "pick_head", "random_heads"),
}

DEFAULT_ITEMS = (
    "One, two, three, four,", "The opposite of hot is", "Monday, Tuesday,",
    "The chemical symbol for gold is", "Water boils at one hundred degrees",
    "The first letter of the alphabet is the letter", "Roses are red, violets are",
    "The largest planet in the solar system is", "She opened the door and saw a",
    "To be or not to", "The sun rises in the")
"""The items after the sidebar prompt (with the gallery's default prompt: 12 items, the worked
example's)."""

_PLACEBO_TEXT = {"mismatched_example": "the logit lens of another item's prompt",
                 "random_heads": "the same head scores with the outlined heads moved to random heads"}
_CONSENT = ("You will see short prompts given to a language model and answer a question about "
            "each. Some questions come with a picture of what the model computed. No personal "
            "data is stored: you get a random code. You can stop at any time.")
_INSTRUCTIONS = ("Answer each question as well as you can, and say how confident you are. Use "
                 "the picture when there is one.")


# -- the server's open studies (`apps._server.open_runs`: link key -> run folder) ---------



def participant_page() -> Any:
    """The participants' route (``/study?run=<key>``): one `StudySession` per browser session
    on the run the key opens, or a page saying the link is closed."""
    from apps import study

    key = ""
    if pn.state.location is not None:
        key = str(pn.state.location.query_params.get("run", "") or "")
    folder = open_runs.folder(key) if key else None
    if folder is None:
        return theme.page([pn.pane.Markdown(
            "## This study is not open\n\nThe link is wrong, or the researcher has closed the "
            "study. Ask them for a new link.")], title="Study")
    return study.session_page(folder)


# -- pure functions ---------------------------------------------------------------------------

def study_dict(*, source: str, model: str, prompts: list[str], baseline: bool, placebo: bool,
               participants: int, design: str, seed: int, k: int = 3, top: int = 3,
               title: str = "") -> dict[str, Any]:
    """The study file of an explanation from page ``source`` (`SOURCES`), as a dict for
    `study_from_dict`: conditions ``explanation`` (real), ``none`` (baseline) and
    ``placebo``; hypotheses H1 (explanation beats none) and H2 (explanation beats placebo)
    for the conditions chosen."""
    if source not in SOURCES:
        raise InputError(f"`source` must be one of {', '.join(map(repr, SOURCES))}; got {source!r}.")
    if not (baseline or placebo):
        raise InputError("choose a baseline, a placebo or both: the explanation needs a "
                         "condition to be compared with.")
    page, e_kind, task, placebo_kind = SOURCES[source]
    explanation: dict[str, Any] = {"kind": e_kind}
    if e_kind == "logit_lens":
        explanation["k"] = max(1, min(10, int(k)))
    else:
        explanation["top"] = max(1, min(20, int(top)))
    conditions = [{"name": "explanation", "kind": "real"}]
    hypotheses = []
    if baseline:
        conditions.append({"name": "none", "kind": "baseline"})
        hypotheses.append({"id": "H1", "compare": ["explanation", "none"], "direction": "greater",
                           "statement": f"Participants answer more accurately with the {page} "
                                        "explanation than with no explanation."})
    if placebo:
        conditions.append({"name": "placebo", "kind": "placebo", "placebo": placebo_kind})
        hypotheses.append({"id": "H2", "compare": ["explanation", "placebo"],
                           "direction": "greater",
                           "statement": f"Participants answer more accurately with the {page} "
                                        f"explanation than with a placebo ({_PLACEBO_TEXT[placebo_kind]})."})
    return {
        "name": f"{source}-study", "title": title or f"Does the {page} explanation help?",
        "description": f"The {page} page's explanation, a baseline and a placebo, built in the "
                       "explorer's User study page.",
        "model": model, "seed": int(seed), "design": design, "participants": int(participants),
        "task": {"kind": task, "n_choices": 4, "confidence_levels": 5, "attention_checks": 1},
        "items": {"prompts": list(prompts)}, "explanation": explanation,
        "conditions": conditions, "hypotheses": hypotheses,
        "analysis": {"bootstrap": 2000, "permutations": 5000, "confidence_level": 0.95,
                     "alpha": 0.05, "correction": "holm"},
        "consent": _CONSENT, "instructions": _INSTRUCTIONS,
        "limitations": ["Built in the gallery: the items are the page's prompts, not a sample "
                        "from a stated population."],
    }


def study_record(data: dict[str, Any], *, source: str,
                 source_shown: Provenance | None = None) -> Provenance:
    """The record of a study file ``data`` (`study_dict`) built from page ``source``: the
    explanation and its settings, the items, the conditions, the schedule; and, in
    ``settings``, the source page's shown result it followed (page, prompt, method, time)."""
    explanation = dict(data["explanation"])
    kind = explanation.pop("kind")
    conditions = tuple(c["name"] for c in data["conditions"])
    followed = ()
    if source_shown is not None:
        followed = (("source_result", (source_shown.page, tuple(source_shown.prompts),
                                       source_shown.method, source_shown.computed_at)),)
    return Provenance(page="study", model=str(data["model"]), method=kind, task=source,
                      prompts=tuple(data["items"]["prompts"]),
                      request=(("conditions", conditions), ("design", data["design"]),
                               ("explanation", tuple(sorted(explanation.items()))),
                               ("participants", int(data["participants"])),
                               ("seed", int(data["seed"]))),
                      settings=followed)


def _explanation_words(rec: Provenance) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in dict(rec.request)["explanation"])
    return (f"the {SOURCES[rec.task][0]} page's explanation ({rec.method.replace('_', ' ')}"
            f"{', ' + settings if settings else ''})")


def study_heading(rec: Provenance | None) -> str:
    """The line over the preview, from the built study's record: the explanation, its
    page, prompt and settings, the items and conditions (Markdown)."""
    if rec is None:
        return ""
    r = dict(rec.request)
    more = len(rec.prompts) - 1
    items = one_line(rec.prompts[0]) + (f" and {more} more item{'s' if more != 1 else ''}"
                                        if more else "")
    followed = rec.setting("source_result")
    source = (f", as the {followed[0]} page showed it at {followed[3][11:16]} UTC,"
              if followed and followed[3] else "")
    text = (f"Study of {_explanation_words(rec)}{source} on {items} ({rec.model}), built at "
            f"{rec.computed_at[11:16]} UTC: conditions {', '.join(r['conditions'])}; "
            f"{r['design']} design, {r['participants']} participants, seed {r['seed']}.")
    return html.escape(text, quote=False)


_STUDY_WORDS = {"model": "the model", "method": "the explanation", "task": "the source page",
                "prompts": "the items", "explanation": "the explanation's settings",
                "conditions": "the conditions", "design": "the design",
                "participants": "the participants", "seed": "the seed"}


def study_stale_text(shown: Provenance, wanted: Provenance) -> str:
    """Empty when the built study is of the current settings; else what it was built from,
    what changed since, and that *Build study* updates it."""
    changed = changed_inputs(shown, wanted)
    if not changed:
        return ""
    what = ", ".join(_STUDY_WORDS.get(c, c) for c in changed)
    return (f"Shown: built at {shown.computed_at[11:16]} UTC from {_explanation_words(shown)} "
            f"of {one_line(shown.prompts[0])}; {what} changed since: press Build study to "
            "update.")


def _interval(low: float, high: float, digits: int = 2) -> str:
    if pd.isna(low) or pd.isna(high):
        return "–"
    return f"[{low:.{digits}f}, {high:.{digits}f}]"


def analysis_tables(ds: xr.Dataset) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The analysis as two tables: per condition and per hypothesis (no participant codes)."""
    cond = pd.DataFrame({
        "condition": ds["condition"].values, "kind": ds["condition_kind"].values,
        "participants": ds["n_participants"].values, "answers": ds["n_responses"].values,
        "accuracy": ds["accuracy"].values, "accuracy_low": ds["accuracy_low"].values,
        "accuracy_high": ds["accuracy_high"].values})
    hyp = pd.DataFrame({
        "hypothesis": ds["hypothesis"].values, "compare_a": ds["compare_a"].values,
        "compare_b": ds["compare_b"].values, "effect": ds["effect"].values,
        "effect_low": ds["effect_low"].values, "effect_high": ds["effect_high"].values,
        "cohens_h": ds["cohens_h"].values, "p_value": ds["p_value"].values,
        "p_adjusted": ds["p_adjusted"].values, "supported": ds["supported"].values})
    return cond, hyp


def analysis_html(ds: xr.Dataset) -> str:
    """The analysis pane: participants, accuracy per condition and the hypotheses."""
    a = ds.attrs
    level = round(100 * a["confidence_level"])
    cond, hyp = analysis_tables(ds)
    rows = "".join(
        f"<tr><td>{html.escape(str(r.condition))}</td><td>{html.escape(str(r.kind))}</td>"
        f"<td class='num'>{r.participants}</td><td class='num'>{r.answers}</td>"
        f"<td class='num'>{'–' if pd.isna(r.accuracy) else f'{r.accuracy:.2f}'}</td>"
        f"<td class='num'>{_interval(r.accuracy_low, r.accuracy_high)}</td></tr>"
        for r in cond.itertuples())
    correction = "Holm-adjusted" if a["correction"] == "holm" else "unadjusted"
    hrows = "".join(
        f"<tr><td>{html.escape(str(r.hypothesis))}</td>"
        f"<td>{html.escape(str(r.compare_a))} &gt; {html.escape(str(r.compare_b))}</td>"
        f"<td class='num'>{'–' if pd.isna(r.effect) else f'{r.effect:+.2f}'}</td>"
        f"<td class='num'>{_interval(r.effect_low, r.effect_high)}</td>"
        f"<td class='num'>{'–' if pd.isna(r.cohens_h) else f'{r.cohens_h:+.2f}'}</td>"
        f"<td class='num'>{'–' if pd.isna(r.p_value) else f'{r.p_value:.4f}'}</td>"
        f"<td class='num'>{'–' if pd.isna(r.p_adjusted) else f'{r.p_adjusted:.4f}'}</td>"
        f"<td>{'yes' if r.supported else 'no'}</td></tr>"
        for r in hyp.itertuples())
    simulated = f", {a['n_simulated']} of them simulated" if a["n_simulated"] else ""
    return (
        f"<div class='study-analysis'><p><b>n = {a['n_analysed']}</b> participants analysed "
        f"({a['n_enrolled']} enrolled, {a['n_complete']} finished, {a['n_excluded']} excluded "
        f"for a failed attention check{simulated}). Chance accuracy: "
        f"{a['chance_accuracy']:.2f}.</p>"
        f"<table class='study-table'><tr><th>condition</th><th>kind</th><th>participants</th>"
        f"<th>answers</th><th>accuracy</th><th>{level}% interval</th></tr>{rows}</table>"
        f"<table class='study-table'><tr><th>hypothesis</th><th>comparison</th>"
        f"<th>accuracy difference</th><th>{level}% interval</th><th>Cohen's h</th><th>p</th>"
        f"<th>p ({correction})</th><th>supported</th></tr>{hrows}</table>"
        f"<p class='study-method'>Intervals: percentile bootstrap over participants "
        f"({a['bootstrap']} resamples). p: permutation test ({a['permutations']} permutations, "
        f"condition labels swapped within participants in a within design), one-sided as "
        f"pre-registered, {correction} over {len(hyp)} hypotheses; supported: adjusted p < "
        f"α = {a['alpha']} in the pre-registered direction.</p></div>")


def accuracy_plot(conditions: list[str], ds: xr.Dataset | None, chance: float) -> hv.Overlay:
    """Accuracy per condition with its interval (bars) and chance accuracy (dashed); the
    conditions without answers are listed with no point."""
    acc = np.full(len(conditions), np.nan)
    low, high = acc.copy(), acc.copy()
    if ds is not None:
        for i, c in enumerate(conditions):
            if c in ds["condition"].values and ds["n_responses"].sel(condition=c) > 0:
                acc[i] = float(ds["accuracy"].sel(condition=c))
                low[i] = float(ds["accuracy_low"].sel(condition=c))
                high[i] = float(ds["accuracy_high"].sel(condition=c))
    data = pd.DataFrame({"condition": conditions, "accuracy": acc,
                         "below": acc - low, "above": high - acc})
    n = 0 if ds is None else int(ds.attrs["n_analysed"])
    points = hv.Scatter(data, "condition", "accuracy").opts(
        size=11, color=theme.ACCENT, default_tools=[], tools=[*STATIC_TOOLS, "hover"])
    chance_line = hv.HLine(chance).opts(color="#888", line_dash="dashed", line_width=2,
                                        default_tools=[])
    overlay = chance_line * points
    if np.isfinite(acc).any():
        overlay = overlay * hv.ErrorBars(data.dropna(), "condition",
                                         ["accuracy", "below", "above"]).opts(
            line_width=2, color=theme.ACCENT, default_tools=[])
    return overlay.opts(
        title=f"Accuracy by condition · n = {n}", ylim=(0, 1.02), height=260, responsive=True,
        min_width=300, max_width=900, ylabel="accuracy (share correct)", xlabel="",
        show_grid=True)


_CSS = """
.study-table { border-collapse: collapse; margin: 6px 0 10px 0; font-size: 14px; }
.study-table th, .study-table td { border-bottom: 1px solid #d0d7de; padding: 4px 10px;
  text-align: left; }
.study-table td.num { text-align: right; font-variant-numeric: tabular-nums; }
.study-method { color: #555; font-size: 13px; }
.study-link input { font-family: monospace; }
"""


class StudyBuilderView(View):
    """The User study page (see the module's docstring).

    Parameters
    ----------
    model : explorer.Model
        The session's model: the items are computed with it.
    folder : str or Path, optional
        Where the page keeps its study runs (default ``$EXPLORER_STUDIES`` or
        ``~/.cache/explorer/studies``).
    """

    notify_title = "User study"
    link_params = ("source", "baseline", "placebo", "participants", "design", "seed", "items")

    prompt = param.String(default="The capital of France is", label="Prompt",
                          doc="The first item (the sidebar's prompt in the gallery).")
    source = param.Selector(default="lens", objects={title: slug for slug, (title, *_) in SOURCES.items()},
                            label="Explanation from",
                            doc="The page whose explanation participants see (its settings: "
                                "the lens's top-k).")
    baseline = param.Boolean(default=True, label="Baseline: no explanation",
                             doc="A condition with the same items and no explanation.")
    placebo = param.Boolean(default=True, label="Placebo of the same length",
                            doc="A condition with an explanation of the same form and length "
                                "that belongs to another prompt (lens) or to random heads "
                                "(attribution).")
    participants = param.Integer(default=30, bounds=(1, 1000), label="Participants",
                                 doc="Places in the schedule: a multiple of the number of "
                                     "conditions.")
    design = param.Selector(default="within", objects=["within", "between"], label="Design",
                            doc="within: every participant sees every condition (a Latin "
                                "square); between: one condition each.")
    seed = param.Integer(default=0, bounds=(0, None), label="Seed",
                         doc="Seed of the schedule, the placebos, the order of choices and the "
                             "analysis.")
    items = param.String(default="\n".join(DEFAULT_ITEMS), label="More items (one per line)",
                         doc="The prompts after the sidebar prompt; in a within design the "
                             "count must be a multiple of the number of conditions.")
    analysis = shown_dataset(doc="The latest analysis of the answers.")
    n_answers = param.Integer(default=0, precedence=-1, doc="Answers stored so far.")
    run_folder = param.String(default="", precedence=-1, doc="The run folder of the study built.")
    shown = param.ClassSelector(class_=Provenance, default=None, allow_None=True, precedence=-1,
                                doc="What the study built was built from.")

    compute_action = "Build study"

    def __init__(self, model: Any, *, folder: str | Path | None = None, **params: Any):
        super().__init__(**params)
        self._model = model
        root = folder or os.environ.get(STUDIES_ENV) or "~/.cache/explorer/studies"
        self._root = Path(root).expanduser()
        self._pages: Callable[[], dict[str, Any]] = dict
        self._run: StudyRun | None = None
        self._study: dict[str, Any] | None = None    # the study file of the run built
        self._key = ""
        self._poll: Any = None
        self.runner("build", self._built, progress=True)
        self.status = "Choose the explanation and the conditions, then Build study."
        self._preview = pn.Column(caption("*Build study* computes the items; what participants "
                                          "see under each condition shows here."),
                                  sizing_mode="stretch_width", css_classes=["study-preview"])
        self._analysis_pane = pn.pane.HTML("", sizing_mode="stretch_width", stylesheets=[_CSS],
                                           css_classes=["study-analysis-pane"])
        self._link = pn.widgets.TextInput(label="Participants' link", value="", disabled=True,
                                          placeholder="Open to participants gives the link",
                                          sizing_mode="stretch_width", css_classes=["study-link"])
        self._build = pn.widgets.Button(label="Build study", color="primary", width=160,
                                        css_classes=["study-build"])
        self._open = pn.widgets.Button(label="Open to participants", color="success", width=200,
                                       disabled=True, css_classes=["study-open"])
        self._refresh = pn.widgets.Button(label="Refresh analysis", color="light", width=160,
                                          disabled=True, css_classes=["study-refresh"])
        self._build.on_click(lambda _e: self.build())
        self._open.on_click(lambda _e: self.close_to_participants() if self._key
                            else self.open_to_participants())
        self._refresh.on_click(lambda _e: self.refresh_analysis())
        self._plot = pn.pane.HoloViews(self._accuracy_plot(), sizing_mode="stretch_width",
                                       css_classes=["study-accuracy"])
        self.param.watch(lambda _e: self._show_analysis(), "analysis")
        self.param.watch(lambda *_: self._show_plot(), ["analysis", "baseline", "placebo"])

    # -- the gallery ------------------------------------------------------------------------
    def set_gallery_pages(self, pages: Callable[[], dict[str, Any]]) -> None:
        """Where the source pages are: ``pages()`` is the session's pages built so far."""
        self._pages = pages

    def scope(self) -> Scope:
        return Scope(on="the sidebar prompt and the items listed here",
                     edits="not applicable: participants see the clean model's explanations")

    def _source_shown(self) -> Provenance | None:
        page = self._pages().get(self.source)
        shown = getattr(page, "shown_provenance", None)
        return shown() if callable(shown) else None

    def source_settings(self) -> dict[str, int]:
        """The source page's settings the explanation follows (its top-k for the lens: that
        of the lens it shows, else of its control)."""
        page = self._pages().get(self.source)
        if self.source == "lens":
            shown = self._source_shown()
            k = dict(shown.request).get("top_k") if shown is not None else None
            if k is None:
                k = getattr(page, "k", 5) if page is not None else 5
            return {"k": min(int(k), 10)}
        return {"top": 3}

    def _study_data(self) -> dict[str, Any]:
        """The study file of the current settings (`study_dict`)."""
        return study_dict(source=self.source, model=self._model.spec.name,
                          prompts=self.prompts(), baseline=self.baseline, placebo=self.placebo,
                          participants=self.participants, design=self.design, seed=self.seed,
                          **self.source_settings())

    def shown_provenance(self) -> Provenance | None:
        """The built study's record (`shown`)."""
        return self.shown

    def requested_provenance(self) -> Provenance | None:
        """What *Build study* would build now (None while the settings are refused)."""
        try:
            data = self._study_data()
        except InputError:
            data = None
        if data is None:
            return None
        return study_record(data, source=self.source, source_shown=self._source_shown())

    def stale_note(self) -> str:
        """Empty while the built study is of the current settings; else what it was built
        from and what changed since (`study_stale_text`)."""
        wanted = self.requested_provenance() if self.shown is not None else None
        return "" if wanted is None else study_stale_text(self.shown, wanted)

    def prompts(self) -> list[str]:
        """The items: the sidebar prompt, then the listed prompts (without repeats)."""
        out = [self.prompt.strip()] if self.prompt.strip() else []
        for line in self.items.splitlines():
            if line.strip() and line.strip() not in out:
                out.append(line.strip())
        return out

    # -- building ---------------------------------------------------------------------------
    def build(self) -> None:
        """Check the study and compute its items in the background (`StudyRun.prepare`)."""
        self.close_to_participants()
        try:
            data = self._study_data()
            study_from_dict(data)   # a bad setting fails here, with the field it names
        except InputError as exc:
            self.show_error(exc)
            return
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        name = f"{data['name']}-{stamp}-{secrets.token_hex(3)}"
        self.error = ""
        self.status = f"Computing {len(data['items']['prompts'])} items with {self._model.spec.name}…"
        self.progress_active = True
        model = self._model
        record = study_record(data, source=self.source, source_shown=self._source_shown())

        def job(token: CancelToken) -> tuple[StudyRun, dict[str, Any], Provenance]:
            self._root.mkdir(parents=True, exist_ok=True)
            path = self._root / f"{name}.json"
            path.write_text(json.dumps(data, indent=1), encoding="utf-8")
            return StudyRun.prepare(path, self._root / name, model=model,
                                    progress=self.progress_fn(token)), data, record

        self.submit("build", job)

    def _built(self, out: tuple[StudyRun, dict[str, Any], Provenance]) -> None:
        run, self._study, record = out
        if self._run is not None:
            self._run.close()
        self._run = run
        self.shown = dataclasses.replace(record, computed_at=computed_at_now())
        self.run_folder = str(run.folder)
        self.status = (f"Built: {len(run.study.prompts)} items, {run.store.n_slots} participant "
                       f"places, conditions {', '.join(run.study.condition_names)}.")
        self._open.disabled = self._refresh.disabled = False
        self._show_preview()
        self.refresh_analysis()

    @property
    def run(self) -> StudyRun | None:
        """The study run built on this page (None before *Build study*)."""
        return self._run

    # -- participants -----------------------------------------------------------------------
    def open_to_participants(self) -> str:
        """Open the run on this server and show the participants' link; returns the link."""
        if self._run is None:
            self.show_error(InputError("build the study first: there is nothing to open."))
            return ""
        self._key = open_runs.open(self._run.folder)
        self._link.value = self.participant_link()
        self._open.param.update(label="Close to participants", color="warning")
        if self._doc is not None and self._poll is None:
            self._poll = pn.state.add_periodic_callback(self._check_answers, period=3000)
        self.status = "Open: send the link to participants; the analysis follows their answers."
        return self._link.value

    def close_to_participants(self) -> None:
        """Close the link (answers already given stay in the run)."""
        if self._key:
            open_runs.close(self._key)
        self._key = ""
        self._link.value = ""
        self._open.param.update(label="Open to participants", color="success")
        if self._poll is not None:
            self._poll.stop()
            self._poll = None

    def participant_link(self) -> str:
        """The link participants open: this server's ``/study`` with the run's key."""
        origin = "http://127.0.0.1:5006"
        location = pn.state.location if self._doc is not None else None
        if location is not None and location.href:
            parts = urlsplit(location.href)
            origin = f"{parts.scheme}://{parts.netloc}"
        return f"{origin}/study?run={self._key}"

    # -- analysis ---------------------------------------------------------------------------
    def _check_answers(self) -> None:
        if self._run is not None and len(self._run.store.responses()) != self.n_answers:
            self.refresh_analysis()

    def refresh_analysis(self) -> None:
        """Analyse every answer stored so far (`explorer.studies.analyse`)."""
        if self._run is None:
            return
        self.n_answers = len(self._run.store.responses())
        self.analysis = analyse(self._run)

    def _show_analysis(self) -> None:
        ds = self.analysis
        if ds is None:
            self._analysis_pane.object = ""
        elif ds.attrs["n_analysed"] == 0:
            self._analysis_pane.object = ("<p class='study-method'><b>n = 0</b>: no answers yet. "
                                          "The tables appear with the first answer.</p>")
        else:
            self._analysis_pane.object = analysis_html(ds)

    def _accuracy_plot(self) -> hv.Overlay:
        if self._run is not None:
            names = list(self._run.study.condition_names)
            chance = 1 / self._run.study.task.n_choices
        else:
            names = ["explanation"] + ["none"] * self.baseline + ["placebo"] * self.placebo
            chance = 0.25
        return accuracy_plot(names, self.analysis, chance)

    def _show_plot(self) -> None:
        self._plot.object = self._accuracy_plot()

    def _show_preview(self) -> None:
        from apps.study import explanation_html

        run = self._run
        item = run.items["item-001"]
        title = SOURCES[self.shown.task][0]     # the built study's source, not the control's
        cards = []
        for c in run.study.conditions:
            what = {"real": "the page's explanation", "baseline": "a baseline",
                    "placebo": f"a placebo, {_PLACEBO_TEXT.get(c.placebo or '', c.placebo)}"}
            e = item["explanations"].get(c.name)
            shown = {k: v for k, v in e.items() if k not in ("placebo", "source_item")} if e else None
            body = explanation_html(shown) or "<p><i>No explanation.</i></p>"
            cards.append(pn.pane.HTML(
                f"<h4 style='margin:4px 0'>{html.escape(c.name)}: {html.escape(what[c.kind])}"
                f"</h4>{body}",
                sizing_mode="stretch_width", min_width=300, styles={"flex": "1 1 0"},
                css_classes=["study-condition"]))
        self._preview.objects = [
            caption(f"What participants see for item 1, *{item['prompt']}*, under each "
                    f"condition: the {title} page's explanation, computed by the study run."),
            pn.FlexBox(*cards, sizing_mode="stretch_width")]

    # -- export -----------------------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """The study built (or, before *Build study*, the one the settings describe) as the
        library calls that prepare, serve and analyse it."""
        data = self._study
        if data is None:
            try:
                data = self._study_data()
            except InputError as exc:
                return Recipe(steps=[Note(f"No study: {exc}")])
        return Recipe(model=data["model"], imports=["json", "pathlib",
                                                    "explorer.studies.StudyRun"], steps=[
            Let("study", data, "the study file the page writes"),
            Expr("path", "pathlib.Path('study.json')"),
            Expr("n_bytes", "path.write_text(json.dumps(study, indent=1))"),
            Expr("run", "StudyRun.prepare(path, 'study-run', model=model)",
                 "computes the items once"),
            Note("Serve it to participants: explorer study run study.json --dir study-run"),
            Call("ds", "explorer.studies.analyse", (Ref("run"),),
                 comment="accuracy per condition, the hypotheses")])

    def export_tables(self) -> dict[str, pd.DataFrame]:
        """The analysis tables (per condition, per hypothesis); never the participants' codes."""
        if self.analysis is None:
            return {}
        cond, hyp = analysis_tables(self.analysis)
        return {"conditions": cond, "hypotheses": hyp}

    def close(self) -> None:
        self.close_to_participants()
        super().close()
        if self._run is not None:
            self._run.close()

    def __panel__(self) -> pn.viewable.Viewable:
        spec = {"source": pn.widgets.Select, "baseline": pn.widgets.Checkbox,
                "placebo": pn.widgets.Checkbox, "participants": pn.widgets.IntInput,
                "design": pn.widgets.Select, "seed": pn.widgets.IntInput}
        controls = [labelled_control(self, name, kind) for name, kind in spec.items()]
        items = pn.widgets.TextAreaInput.from_param(self.param.items, height=220,
                                                    sizing_mode="stretch_width")
        left = pn.Column(*controls, items, self._build, width=theme.SIZES["controls_width"],
                         css_classes=["study-controls"])
        status = pn.Row(self.busy_spinner(), theme.status_line(self.param.status), align="center")
        heading = pn.pane.Markdown(pn.bind(study_heading, self.param.shown),
                                   css_classes=["study-heading"], sizing_mode="stretch_width")
        deps = [self.param[n] for n in ("shown", "prompt", "items", *self.link_params)]
        stale = pn.pane.HTML(
            pn.bind(lambda *_: (f"<b>Outdated.</b> {html.escape(self.stale_note())}"
                                if self.stale_note() else ""), *deps),
            visible=pn.bind(lambda *_: bool(self.stale_note()), *deps),
            css_classes=["study-stale", "stale-note"], styles=STALE_STYLE,
            sizing_mode="stretch_width", margin=(2, 10))
        right = pn.Column(
            status, self.progress_bar(), pn.pane.Markdown("### Explanation shown"), heading,
            stale, self._preview,
            pn.pane.Markdown("### Participants"), pn.Row(self._open, self._refresh),
            self._link, pn.pane.Markdown("### Analysis"), self._plot, self._analysis_pane,
            sizing_mode="stretch_width")
        return pn.Row(left, right, sizing_mode="stretch_width")


serve(__name__, StudyBuilderView, title="User study")
