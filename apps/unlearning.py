"""Mechanistic unlearning page: where is a fact looked up, and does unlearning there hold?

Guo, Syed, Sheshadri, Ewart & Dziugaite, "Mechanistic Unlearning" (ICML 2025).
"Localize" computes the per-layer probe accuracy for the attribute on the subject token,
a causal-tracing heatmap (layer x position) for one forget fact, and the causal-tracing
and attribution-patching scores of every attention head and MLP over the forget set. The
probe curve shades the MLP layers fact lookup trains; the component map shows which heads
and MLPs output tracing picks for the same parameter budget (the contrast of the paper:
fact-lookup MLPs against the attention / extraction components). "Run" trains a copy of
the model on the chosen components only (unlearning the forget set while keeping the
retain facts and general text) and shows forget, multiple-choice, retain and relearning
accuracy and the perplexity on held-out text next to the original model. Both run in the
background with a progress bar and can be cancelled. Each keeps a record of what it ran on
(`localization_record`, `run_record`: the facts, the run's settings, when); the scope line, the
captions over the results and the page's code are written from those records, and a note marks
a result outdated once the controls differ from its record (`lab_stale_text`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._paper import paper_panel
from apps._controls import OwnItems, tip
from apps._lab_provenance import plural, stale_pane, stamped
from apps._unlearning_record import (LOCALIZE_INPUTS, RUN_INPUTS, UnlearningRecords,
                                     localization_caption, run_caption)
from apps._session import CancelToken
from apps._view import Scope, View, serve
from explorer.analyses import unlearning as U
from explorer.analyses import user_items

__all__ = ["UnlearningView", "plot_probe_curve", "plot_trace_heatmap", "trace_token_labels",
           "plot_accuracy_bars", "component_map_rows", "plot_component_map", "contrast_caption",
           "perplexity_caption",
           "accuracy_rows", "probe_caption", "trace_caption", "METRIC_LABELS", "SHORT_NAMES",
           "BARS_CAPTION", "LOCALIZE_INPUTS", "RUN_INPUTS", "localization_caption", "run_caption"]

hv.extension("bokeh", logo=False)

SHORT_NAMES = {"original": "before", "fact_lookup": "FLU", "causal_tracing": "CT",
               "attribution_patching": "AP", "causal_tracing_mlp": "CT-MLP",
               "attribution_patching_mlp": "AP-MLP", "random": "rand", "all": "all"}
LONG_NAMES = {"fact_lookup": "fact lookup", "causal_tracing": "causal tracing",
              "attribution_patching": "attribution patching",
              "causal_tracing_mlp": "causal tracing (MLPs only)",
              "attribution_patching_mlp": "attribution patching (MLPs only)",
              "random": "random MLPs", "all": "all parameters"}
METRIC_LABELS = {"forget": "forget",   # short: five groups share one axis (the caption says more)
                 "forget_mc_known": "forget MC",
                 "retain": "retain", "relearn_heldout": "held out",
                 "relearn_learned": "relearned"}
BARS_CAPTION = (
    "Accuracy = the top answer among the attributes. **forget**: the forget facts in the trained "
    "format; **forget MC**: the same facts as multiple choice (those known before); **retain**: "
    "facts kept; after a relearning attack on half the forget set, **relearned**: that half, "
    "**held out**: the other half (low = the unlearning holds). Bars: **before** = the original "
    "model, then the methods (FLU fact lookup, CT causal tracing, AP attribution patching; "
    "-MLP: their MLP-only variants).")


def plot_probe_curve(probe: xr.Dataset | None, layers: list[int] | None = None) -> hv.Overlay:
    """Probe accuracy per layer with the localized MLP layers shaded."""
    if probe is None:
        return theme.placeholder("Press Localize: probe accuracy per layer appears here.", height=140)
    curve = hv.Curve((probe.layer.values, probe.probe_accuracy.values), "layer",
                     "probe accuracy").opts(color=theme.ACCENT, line_width=2, tools=["hover"])
    dots = hv.Scatter((probe.layer.values, probe.probe_accuracy.values), "layer",
                      "probe accuracy").opts(color=theme.ACCENT, size=6)
    chance = hv.HLine(float(probe.chance)).opts(color="gray", line_dash="dashed")
    parts = [curve, dots, chance]
    for a, b in _runs(layers or []):
        parts.insert(0, hv.VSpan(a - 0.5, b + 0.5).opts(color="#f0a030", alpha=0.25))
    return hv.Overlay(parts).opts(
        title="Attribute probe",
        responsive=True, height=300, ylim=(0, 1.02), xlabel="layer",
        ylabel="probe accuracy")


def _runs(layers: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted layers as (first, last)."""
    out: list[tuple[int, int]] = []
    for x in sorted(layers):
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out


def trace_token_labels(tokens: list[str], positions: list[int]) -> list[str]:
    """Short x labels for the causal-tracing columns: each token as the model sees it, cut to
    8 characters; a label that repeats gets its position in brackets (columns need distinct
    names). The hover names the position of every column."""
    short = [_short(theme.show_token(t), 8) for t in tokens]
    return [f"{label} ({p})" if short.count(label) > 1 else label for label, p in zip(short, positions)]


def plot_trace_heatmap(trace: xr.Dataset | None, fact: int = 0) -> hv.Element:
    """Causal tracing: p(answer) when one layer's output is restored at one position."""
    if trace is None:
        return theme.placeholder("Press Localize: the causal-tracing map (layer x token) "
                                 "appears here.", height=140)
    r = trace.restore_resid.isel(fact=fact)
    tokens = [str(t) for t in trace.token.isel(fact=fact).values]
    keep = [p for p in range(len(tokens)) if tokens[p] != "" and not np.all(np.isnan(r.values[:, p]))]
    labels = trace_token_labels([tokens[p] for p in keep], keep)
    rows = [(labels[i], int(layer), float(r.values[layer, p]), p)
            for i, p in enumerate(keep) for layer in range(r.sizes["layer"])]
    subject = str(trace.subject.values[fact])
    return hv.HeatMap(rows, ["token", "layer"], ["p_answer", "position"]).opts(
        cmap="viridis", colorbar=True, tools=["hover"], xrotation=0, responsive=True,
        height=360, title=f"Causal tracing: {_short(subject)}",
        xlabel="restored token (position in the hover)", ylabel="layer")


def _caption(text: Any) -> pn.pane.Markdown:
    """A caption under a plot: the numbers and how to read it (the title stays short)."""
    return pn.pane.Markdown(text, css_classes=["caption"], sizing_mode="stretch_width",
                            styles={"font-size": "0.9em", "color": "#444"}, margin=(0, 10))


def _short(text: str, n: int = 18) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def probe_caption(probe: xr.Dataset | None, layers: list[int], method: str = "fact_lookup",
                  budget: int | None = None) -> str:
    """What the probe plot shows, under it; ``layers``: those ``method`` trains for a budget
    of ``budget`` MLP layers (the controls the shading is drawn from)."""
    if probe is None:
        return ""  # the plot's placeholder says what to press
    best = int(probe.layer.values[int(np.argmax(probe.probe_accuracy.values))])
    budget_words = "" if budget is None else f" for a budget of {plural(budget, 'MLP layer')}"
    shaded = (f"shaded: the MLP layers {LONG_NAMES.get(method, method)} trains{budget_words} "
              f"({', '.join(map(str, layers))})") if layers else \
        "no layers shaded (method `all` trains every parameter)"
    return (f"Linear probe for the attribute on the last subject token: best at layer {best} "
            f"({float(probe.probe_accuracy.max()):.2f}; chance {float(probe.chance):.2f} dashed); "
            f"{shaded}.")


def trace_caption(trace: xr.Dataset | None, fact: int = 0) -> str:
    """What the causal-tracing heatmap shows, under it."""
    if trace is None:
        return ""  # the plot's placeholder says what to press
    return (f"**{trace.subject.values[fact]}**: p(answer) when the subject is noised and one "
            f"layer's output is restored at one position (clean run "
            f"{float(trace.p_clean[fact]):.2f}, noised {float(trace.p_corrupt[fact]):.2f}).")


def accuracy_rows(result: xr.Dataset | None) -> list[tuple[str, str, float]]:
    """(metric label, method, accuracy) rows for the bars."""
    if result is None:
        return []
    return [(METRIC_LABELS[k], SHORT_NAMES.get(str(m), str(m)),
             float(result.accuracy.sel(localization=m, metric=k)))
            for k in METRIC_LABELS for m in result["localization"].values.tolist()]


def plot_accuracy_bars(rows: list[tuple[str, str, float]]) -> hv.Element:
    """Accuracy per metric, before and after unlearning with each localization method."""
    if not rows:  # nothing to draw yet: a line of text, no empty axes
        return theme.placeholder("Press Run unlearning: accuracy before and after unlearning, "
                                 "per metric, appears here.", height=120)
    bars = hv.Bars(rows, ["metric", "localization"], "accuracy").opts(
        ylim=(0, 1.05), tools=["hover"], multi_level=True, xrotation=0, responsive=True,
        height=320, title="Accuracy before / after unlearning", xlabel="", ylabel="accuracy")
    return bars.opts(color="localization", cmap=theme.CATEGORICAL, show_legend=False)


def component_map_rows(scores: xr.DataArray | None) -> list[tuple[str, int, float, str]]:
    """(column, layer, score, component) rows of the component map: columns H0..Hn, MLP."""
    if scores is None:
        return []
    rows = []
    for name, value in zip(scores["component"].values.tolist(), scores.values.tolist()):
        layer, part = name[1:].split(".")
        rows.append((part, int(layer), float(value), name))
    return rows


def plot_component_map(scores: xr.DataArray | None, chosen: list[str], lookup: list[str],
                       score_name: str = "causal tracing") -> hv.Overlay:
    """Score of every head and MLP (layer x component), signed colours centred on 0; dots
    mark the components the selected method trains, rings the fact-lookup MLPs."""
    rows = component_map_rows(scores)
    if not rows:
        return theme.placeholder("Press Localize: the score of every attention head and MLP "
                                 "appears here.", height=140)
    lim = max(1e-12, max(abs(r[2]) for r in rows))
    columns = list(dict.fromkeys(r[0] for r in rows))
    heat = hv.HeatMap(rows, ["component", "layer"], ["score", "name"]).redim.values(
        component=columns).opts(
        cmap=theme.SIGNED_CMAP, clim=(-lim, lim), colorbar=True, tools=["hover"],
        responsive=True, height=420, xlabel="attention head / MLP", ylabel="layer",
        title=f"Components: {score_name} score")
    pick = hv.Points([(c.split(".")[1], int(c[1:].split(".")[0])) for c in chosen],
                     ["component", "layer"], label="trained by the selected method").opts(
        color="black", size=7, marker="circle")
    ring = hv.Points([(c.split(".")[1], int(c[1:].split(".")[0])) for c in lookup],
                     ["component", "layer"], label="fact-lookup MLPs").opts(
        color="#f0a030", size=15, marker="square", fill_alpha=0, line_width=3)
    return (heat * ring * pick).opts(legend_position="top", show_legend=True)


def contrast_caption(model: Any, chosen: dict[str, list[str]]) -> str:
    """What each localization trains, in words: MLPs (which layers) and heads (how many,
    which layers), with the parameter count."""
    parts = []
    for method, comps in chosen.items():
        if method == "all":
            parts.append("**all parameters**: every weight")
            continue
        n = sum(U.component_parameter_count(model, c) for c in comps)
        parts.append(f"**{LONG_NAMES.get(method, method)}**: {U.component_label(comps)} "
                     f"({n / 1e6:.2f} M parameters)")
    return ("Same parameter budget, different places. " + "; ".join(parts) + ". Fact lookup "
            "edits the MLPs where the attribute is looked up on the subject token; output "
            "tracing picks what moves the answer at the last position (heads that extract it "
            "and the MLPs it finds).")


def perplexity_caption(result: xr.Dataset | None) -> str:
    """Perplexity on held-out general text per row of a run."""
    if result is None or "perplexity" not in result or np.all(np.isnan(result.perplexity.values)):
        return ""
    vals = ", ".join(f"{SHORT_NAMES.get(str(m), str(m))} {float(v):.2f}"
                     for m, v in zip(result["localization"].values.tolist(),
                                     result.perplexity.values))
    return (f"Perplexity on held-out general text (the shipped corpus's held-out documents; "
            f"training also keeps a cross-entropy term on its other documents): {vals}.")


# the page's settings a person sets, in order, with the widget of each
_CONTROLS = {"method": pn.widgets.Select, "n_layers": pn.widgets.IntSlider,
             "compare": pn.widgets.Checkbox, "steps": pn.widgets.IntSlider,
             "lr": pn.widgets.Select, "n_forget": pn.widgets.IntSlider,
             "n_retain": pn.widgets.IntSlider, "text_weight": pn.widgets.Select,
             "relearn_steps": pn.widgets.IntSlider}


def _shown_controls(view: param.Parameterized) -> pn.Column:
    """The settings of ``view`` not hidden by their precedence, each with its tip."""
    p = view.param
    return pn.Column(*[tip(kind.from_param(p[name], sizing_mode="stretch_width"), p[name].doc)
                       for name, kind in _CONTROLS.items()
                       if p[name].precedence is None or p[name].precedence >= 0],
                     sizing_mode="stretch_width")


class UnlearningView(UnlearningRecords, View):
    """Localize a fact set, unlearn it on the localized MLPs, measure robustness."""

    notify_title = "Unlearning"
    link_params = ("method", "n_layers", "steps", "lr", "n_forget", "n_retain", "relearn_steps",
                   "compare", "text_weight", "own_fact")

    method = param.Selector(default="fact_lookup", objects=list(U.METHODS), label="Localization",
                            doc="How the trained MLP layers are picked: fact_lookup (the probe), "
                                "causal_tracing, attribution_patching, random, or all parameters.")
    n_layers = param.Integer(default=4, bounds=(1, 30), label="Budget (MLP layers)",
                             doc="Budget: the parameters of this many MLP layers. Fact lookup "
                                 "trains that many MLPs (shaded on the probe plot); output "
                                 "tracing spends the same on its top heads and MLPs.")
    compare = param.Boolean(default=True, label="Also train fact lookup",
                            doc="Run trains the fact-lookup MLPs too, beside the selected "
                                "method, so the bars show the contrast.")
    text_weight = param.Selector(default=1.0, objects=[0.0, 0.5, 1.0, 2.0],
                                 label="General-text weight",
                                 doc="Weight of the retain term on general text (cross-entropy "
                                     "on the shipped corpus); 0: none.")
    steps = param.Integer(default=8, bounds=(1, 100), label="Training steps",
                          doc="Optimiser steps of the unlearning run.")
    lr = param.Selector(default=2e-4, objects=[1e-5, 3e-5, 1e-4, 2e-4, 3e-4, 1e-3],
                        label="Learning rate", doc="Learning rate of the unlearning run (AdamW).")
    n_forget = param.Integer(default=8, bounds=(2, 40), label="Facts to forget",
                             doc="Facts the run unlearns (Localize uses them too).")
    n_retain = param.Integer(default=8, bounds=(1, 40), label="Facts to retain",
                             doc="Facts the run must keep (the retain loss).")
    relearn_steps = param.Integer(default=3, bounds=(0, 20), label="Relearning steps",
                                  doc="Steps of the relearning attack on half the forget set "
                                      "after unlearning (0: no attack).")
    own_fact = param.String(default="", precedence=-1,
                            doc="Your own fact (the text Use took in), the first forget fact of "
                                "Localize; a link carries it, and a page given it takes it in "
                                "(Localize, pressed, then uses it)")
    status = param.String(default="Press Localize to compute the probe curve and causal tracing.")
    probe = param.Parameter(default=None)
    trace = param.Parameter(default=None)
    attribution = param.Parameter(default=None)
    result = param.Parameter(default=None)

    def __init__(self, model: Any, *, facts_file: str | Path | None = None, known_only: bool = True,
                 background: bool | None = None, **params: Any):
        super().__init__(background=background, **params)
        self._model = model
        self._facts_file = facts_file
        self._known_only = known_only
        self._split: tuple[list, list] | None = None
        self._own_fact: U.AttributeFact | None = None   # `own_fact` parsed
        self._own = OwnItems(
            "Your own fact", user_items.UNLEARNING_FORMAT,
            "One fact: subject, prompt (the relation prompt the model completes, with the "
            "subject in it) and answer (one of the relation's answers). Use makes it the first "
            "forget fact (the causal-tracing heatmap's) and localizes.",
            self.use_own)
        # a fact set from elsewhere (a link) is taken in for the next Localize (as for every
        # setting a link carries, no job starts)
        self._own.follow(self, "own_fact", self._own.taking(self._parse_own, self._take_own))
        self.param.n_layers.bounds = (1, model.n_layers)
        if self.n_layers > model.n_layers:
            self.n_layers = max(1, model.n_layers // 2)
        self.runner("work", self._show_result, heavy=True)   # training: waits its turn
        self._localize_button = pn.widgets.Button(
            label="Localize", color="primary", width=120,
            description="Probe curve, causal tracing and attribution patching over the forget "
                        "facts: where the facts are looked up.")
        self._run_button = pn.widgets.Button(
            label="Run unlearning", color="primary", width=160,
            description="Train a copy of the model on the localized components to forget the "
                        "forget facts, then measure it (needs Localize first).")
        if getattr(model, "remote", False):
            # training runs on the server with the updates held apart; what trains every
            # parameter (method "all", the relearning attack) would need a second copy there
            self.param.method.objects = [m for m in U.METHODS if m != "all"]
            self.param.relearn_steps.bounds = (0, 0)
            self.param.relearn_steps.precedence = -1
            self.relearn_steps = 0
            self._run_button.description = "Trains on the server; the served weights stay as they are."
            self._remote_note = (
                "*Remote model:* training runs on the server, with the updates held apart "
                "from the served weights. Method `all` and the relearning attack train every "
                "parameter, which would need a second copy of the weights there, so they are "
                "off.")
        else:
            self._remote_note = ""
        self._cancel_button = pn.widgets.Button(label="Cancel", color="default",
                                                variant="outline", width=90,
                                                description="Stop the job in flight.")
        self._localize_button.on_click(lambda e: self.localize())
        self._run_button.on_click(lambda e: self.run())
        self._cancel_button.on_click(lambda e: self.cancel())
        self.param.watch(self._sync_buttons, ["busy", "probe"])

    # -- jobs --------------------------------------------------------------------------------
    def _sync_buttons(self, *events: Any) -> None:
        """Localize and Run while no job runs (Run before Localize says to localize
        first); Cancel stops the job in flight and does nothing otherwise."""
        self._localize_button.disabled = self.busy
        self._run_button.disabled = self.busy
        self._cancel_button.color = "warning" if self.busy else "default"

    def scope(self) -> Scope:
        """Its own fact set and the corpus text; edits do not apply (training runs on a copy).
        The facts are the shown localization's (its record), else those Localize would use."""
        inputs = dict((self.localization_record or self.localization_request()).request)
        return Scope(on=f"its own facts: {inputs['n_forget']} to forget, {inputs['n_retain']} to "
                        "retain (athlete -> sport), and the shipped corpus as general text",
                     edits="not applicable: unlearning trains a copy of the model's weights")

    # -- what the shown results were computed on ------------------------------------------
    def _start(self, status: str) -> None:
        self.param.update(busy=True, progress=0, status=status)

    def facts(self) -> tuple[list[U.AttributeFact], list[U.AttributeFact]]:
        """(forget, retain) for the current sizes (the known-facts filter is cached); the
        user's own fact, once given, is the first forget fact and in neither set otherwise."""
        everything = U.load_attribute_facts(self._facts_file)
        facts = U.known_facts(self._model, everything) if self._known_only else everything
        own = self._own_fact
        if own is not None:
            facts = [f for f in facts if f.subject != own.subject]
            forget, retain = U.split_facts(facts, max(2, self.n_forget - 1), self.n_retain)
            return [own, *forget][:self.n_forget], retain
        return U.split_facts(facts, self.n_forget, self.n_retain)

    def _parse_own(self, text: str) -> U.AttributeFact:
        known = U.load_attribute_facts(self._facts_file)[0]   # the shipped attributes
        return user_items.parse_unlearning_fact(text, attributes=known.attributes, mc=known.mc)

    def _take_own(self, fact: U.AttributeFact, text: str) -> None:
        self._own_fact = fact
        self._own.keep(text)

    def use_own(self, text: str) -> U.AttributeFact | None:
        """Parse the user's fact, make it the first forget fact and localize (the same job as
        for the shipped facts); bad text shows the parser's message and keeps the result."""
        def use(fact: U.AttributeFact) -> None:
            self._take_own(fact, text)
            self.localize()
        return self.adopt_own(text, self._parse_own, use)

    def localize(self) -> None:
        """Probe curve, causal tracing and attribution patching, in the background; a stop
        (the page's Cancel, the gallery's stop button) ends it at the next progress step."""
        self._start("Localizing: probe, causal tracing, attribution patching …")
        model = self._model
        used = self.localization_request()

        def job(token: CancelToken):
            everything = U.load_attribute_facts(self._facts_file)
            forget, retain = self.facts()
            token.check()
            _, counts = np.unique([f.attribute for f in everything], return_counts=True)
            probe = U.attribute_probe_curve(model, everything, n_folds=int(min(4, counts.min())),
                                            progress=self.progress_fn(token, lo=0, hi=40))
            token.check()
            # the heatmap: from the subject's first token to the end of the prompt
            first = U.subject_positions(model, forget[0])[0]
            n = len(model.tokenizer(U.fact_prompt(forget[0]), add_special_tokens=False)["input_ids"])
            heat = U.causal_trace(model, forget[:1], positions=list(range(first, n)), heads=False,
                                  progress=self.progress_fn(token, lo=40, hi=50))
            token.check()
            trace = U.causal_trace(model, forget, positions=False, heads=True,
                                   progress=self.progress_fn(token, lo=50, hi=85))
            trace["restore_resid"] = heat.restore_resid.reindex(fact=trace.fact)
            trace = trace.assign_coords(token=heat.token.reindex(fact=trace.fact, fill_value=""))
            token.check()
            attribution = U.attribution_patching(model, forget,
                                                 progress=self.progress_fn(token, lo=85, hi=100))
            return "localize", (probe, trace, attribution, (forget, retain), used)

        self.submit("work", job)

    def run(self) -> None:
        """Train on the chosen method's layers and evaluate, in the background."""
        if self.probe is None:
            theme.notify("warning", "Unlearning: press Localize first.")
            return
        model = self._model
        used = self.run_request()
        request = dict(used.request)
        methods = list(request["methods"])
        self._start(f"Training {', '.join(methods)} (budget {request['n_layers']} MLP layers) …")
        settings = {k: request[k] for k in ("n_layers", "steps", "lr", "relearn_steps",
                                            "text_weight")}
        probe, trace, attribution = self.probe, self.trace, self.attribution
        forget, retain = self._split

        def job(token: CancelToken):
            text = U.text_windows(model, "train", window=64) if settings["text_weight"] else None
            heldout = U.text_windows(model, "heldout", window=64, max_windows=16)
            ds = U.unlearning_comparison(model, forget, retain, methods=methods, probe=probe,
                                         trace=trace, attribution=attribution, text=text,
                                         heldout_text=heldout,
                                         progress=self.progress_fn(lo=0, hi=100),
                                         should_stop=lambda: token.cancelled, **settings)
            return "run", (ds, used)

        self.submit("work", job)

    def cancel(self, name: str | None = None) -> None:
        """Stop the job in flight (its result is discarded)."""
        super().cancel(name)
        self._finish("Cancelled.")

    def _finish(self, status: str) -> None:
        self.param.update(busy=False, status=status)

    def _runner_busy(self, name: str, busy: bool) -> None:
        """A job ending with no result (stopped by the gallery's stop button) leaves no
        "Localizing …" or "Training …" line behind: the status says it stopped."""
        started = self.status
        super()._runner_busy(name, busy)
        if name == "work" and not busy and started.endswith("…"):
            self._finish("Stopped: nothing was computed.")

    def _show_result(self, out: tuple[str, Any]) -> None:
        kind, value = out
        if kind == "localize":
            probe, trace, attribution, split, used = value
            self._split = split
            self.param.update(probe=probe, trace=trace, attribution=attribution, progress=100,
                              localization_record=stamped(used))
            self._finish(f"Localized on {len(split[0])} forget facts; for a budget of "
                         f"{plural(self.n_layers, 'MLP layer')}, fact lookup picks MLPs "
                         f"{self.chosen_layers('fact_lookup')}; causal tracing "
                         f"{U.component_label(self.chosen_components('causal_tracing'))}.")
        else:
            value, used = value
            self.param.update(result=value, progress=100, run_record=stamped(used))
            m = value["localization"].values[-1]
            self._finish(f"{m}: trained {int(value.n_params.sel(localization=m)):,} parameters, "
                         f"{float(value.seconds_per_step.sel(localization=m)):.1f} s per step.")

    # -- reproducibility ---------------------------------------------------------------------
    # -- plots -------------------------------------------------------------------------------
    def chosen_layers(self, method: str | None = None) -> list[int]:
        """The MLP layers ``method`` (default the selected one) trains for the budget."""
        if self.probe is None:
            return []
        return U.localized_layers(self._model, method or self.method, self.n_layers,
                                  probe=self.probe, trace=self.trace, attribution=self.attribution)

    def chosen_components(self, method: str | None = None) -> list[str]:
        """The heads and MLPs ``method`` (default the selected one) trains for the budget."""
        if self.probe is None:
            return []
        method = method or self.method
        if method == "all":
            return U.component_names(self._model)
        return U.localized_components(self._model, method, self.n_layers, probe=self.probe,
                                      trace=self.trace, attribution=self.attribution)

    def _map_source(self) -> tuple[xr.DataArray | None, str]:
        """The scores the component map shows: attribution patching's for the AP methods,
        causal tracing's otherwise."""
        if self.trace is None:
            return None, "causal tracing"
        if self.method.startswith("attribution_patching"):
            return U.component_scores(self.attribution), "attribution patching"
        return U.component_scores(self.trace), "causal tracing (restore effect)"

    @param.depends("trace", "attribution", "method", "n_layers")
    def _component_map(self) -> hv.Overlay:
        scores, name = self._map_source()
        if scores is None:
            return plot_component_map(None, [], [])
        chosen = self.chosen_components() if self.method != "all" else []
        return plot_component_map(scores, chosen, self.chosen_components("fact_lookup"), name)

    @param.depends("trace", "attribution", "method", "n_layers")
    def _contrast_caption(self) -> str:
        if self.trace is None:
            return ""
        methods = list(dict.fromkeys(["fact_lookup", self.method if self.method not in (
            "fact_lookup", "all") else "causal_tracing"]))
        return contrast_caption(self._model, {m: self.chosen_components(m) for m in methods})

    @param.depends("result")
    def _perplexity_caption(self) -> str:
        return perplexity_caption(self.result)

    @param.depends("probe", "method", "n_layers")
    def _probe_plot(self) -> hv.Overlay:
        layers = self.chosen_layers() if self.method != "all" else []
        return plot_probe_curve(self.probe, layers)

    # The shading and the component map's dots are drawn at once from the method and budget
    # controls (no stale state): their words name those controls.
    @param.depends("probe", "method", "n_layers")
    def _probe_caption(self) -> str:
        return probe_caption(self.probe, self.chosen_layers() if self.method != "all" else [],
                             self.method, self.n_layers)

    @param.depends("trace")
    def _trace_caption(self) -> str:
        return trace_caption(self.trace)

    @param.depends("trace")
    def _heatmap(self) -> hv.HeatMap:
        return plot_trace_heatmap(self.trace)

    @param.depends("result")
    def _bars(self) -> hv.Bars:
        return plot_accuracy_bars(accuracy_rows(self.result))

    @param.depends("probe", "result", "busy", "method")
    def _state(self) -> pn.pane.HTML:
        """Machine-readable state for browser tests: localized, result rows, busy."""
        rows = "none" if self.result is None else ",".join(self.result["localization"].values.tolist())
        return pn.pane.HTML(
            f'<div class="unlearning-state" data-unlearning-localized="{self.probe is not None}" '
            f'data-unlearning-result="{rows}" data-unlearning-busy="{self.busy}" '
            f'data-unlearning-method="{self.method}"></div>', height=0, margin=0)

    def __panel__(self) -> pn.viewable.Viewable:
        controls = _shown_controls(self)
        bar = self.progress_bar(visible=self.param.busy)
        spinner = pn.indicators.LoadingSpinner(value=self.param.busy, visible=self.param.busy,
                                               size=theme.SIZES["spinner"], color="primary")
        p = self.param
        deps = [p[n] for n in _CONTROLS] + [p.localization_record, p.run_record]
        localized = _caption(pn.bind(localization_caption, p.localization_record))
        localized.css_classes = ["caption", "unlearning-localized"]
        ran = _caption(pn.bind(run_caption, p.run_record))
        ran.css_classes = ["caption", "unlearning-run"]
        return pn.Row(
            pn.Column(controls, self._own.layout(self.param.error),
                      pn.pane.Markdown(self._remote_note, visible=bool(self._remote_note),
                                       styles={"font-size": "0.9em"}),
                      self._state, width=320),
            pn.Column(
                # the buttons, what runs (Localizing …, Training …), its progress and its end,
                # at the top of the main column as on the other pages: pressing a button
                # scrolls nothing, and its status is in view
                pn.Row(self._localize_button, self._run_button, self._cancel_button, spinner,
                       align="center"),
                self.status_text("unlearning-status"), bar,
                paper_panel("unlearning", self),
                localized, stale_pane(self.localization_stale_note, deps,
                                      "unlearning-localization-stale"),
                # Side by side where the heatmap keeps room for its token labels (about
                # 480 px); one above the other on narrower windows.
                pn.FlexBox(pn.Column(pn.pane.HoloViews(self._probe_plot, sizing_mode="stretch_width"),
                                     _caption(self._probe_caption), sizing_mode="stretch_width",
                                     min_width=360, styles={"flex": "1 1 0"},
                                     css_classes=["unlearning-probe"]),
                           pn.Column(pn.pane.HoloViews(self._heatmap, sizing_mode="stretch_width"),
                                     _caption(self._trace_caption), sizing_mode="stretch_width",
                                     min_width=480, styles={"flex": "1.3 1 0"},
                                     css_classes=["unlearning-trace"]),
                           sizing_mode="stretch_width"),
                pn.Column(pn.pane.HoloViews(self._component_map, sizing_mode="stretch_width"),
                          _caption(self._contrast_caption), sizing_mode="stretch_width",
                          css_classes=["unlearning-components"]),
                stale_pane(self.run_stale_note, deps, "unlearning-run-stale"),
                pn.pane.HoloViews(self._bars, sizing_mode="stretch_width"),
                ran, _caption(BARS_CAPTION),
                _caption(self._perplexity_caption),
                sizing_mode="stretch_width"),
            sizing_mode="stretch_width")


serve(__name__, UnlearningView, title="Mechanistic unlearning", intro="unlearning")
