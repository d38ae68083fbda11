"""Neuron-explanation page: a unit, a concept, every metric, and the two sanity checks live.

Oikarinen, Yan, Weng (ICML 2025) write the metrics that score an explanation of a unit as
one framework and test them with two perturbations of a correct explanation: *missing
labels* (drop each positive with probability 1/2) and *extra labels* (double the
positives). A sound metric must decrease under both. Here the units are ITDA atoms of the
model (activation = cosine of a token's activation with the atom) and the concepts are
token-level: the atom's own source token, digits, capitalised tokens, punctuation and
number words. Pick a unit and a concept to see every metric; play the seed to watch both
perturbations redraw and the score changes follow; the pass/fail table runs the checks
over synthetic units (the paper's theoretical test) and over the model's atoms.

The scores land with their record (`NeuronEvalView.shown`, `apps._dictionary_record`): the
probing prompts, layer, tau, unit, concept, binarisation and seed. The heading, scope line,
export and code are written from it; while a control moved and its recompute has not landed
(or was refused), a note says what the shown scores were computed on.
"""
from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Sequence
from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._paper import paper_panel
from apps._controls import index_choice, labelled_controls
from apps._dictionary_record import (dictionary_record, dictionary_stale_text, dictionary_words,
                                     stale_box, stale_state)
from apps._provenance import Provenance, computed_at_now
from apps._recipe import MODEL, Call, Note, Recipe, Ref
from apps._session import CancelToken
from apps._view import STATIC_TOOLS, Scope, View, serve, shown_dataset
from apps.itda import DEFAULT_PROBE_TEXT, MIN_POS, probe_prompts
from explorer.analyses.itda import ITDA
from explorer.analyses.neuron_eval import (
    BINARIZATIONS,
    METRIC_RANGES,
    METRICS,
    SANITY_TESTS,
    extra_labels,
    itda_atom_sanity_checks,
    missing_labels,
    paired_metrics,
    synthetic_sanity_checks,
    token_concepts,
)
from explorer.trace import trace

__all__ = ["NeuronEvalView", "CONCEPTS", "DELTAS_CAPTION", "STRIPS_CAPTION", "unit_data", "metric_table",
           "unchanged_note", "unit_heading", "unit_words", "unit_request",
           "perturbation_table", "plot_metric_deltas", "plot_perturbations", "pass_fail_html"]

#: Concepts offered: the atom's own token, then the token families.
CONCEPTS = ("own_token", "digit", "capitalised", "punctuation", "number_word")

_TOOLS = STATIC_TOOLS
_DATA_PARAMS = ("probe_text", "layer", "tau")
_VIEW_PARAMS = ("unit", "concept", "binarize", "alpha", "threshold", "seed")
_SYNTHETIC = dict(frequencies=(0.499, 0.1, 0.01, 0.001), n_inputs=20_000, n_seeds=10)
_STATUS_COLORS = {"concept (kept)": theme.CATEGORICAL[0], "dropped (missing labels)": theme.CATEGORICAL[3],
                  "added (extra labels)": theme.CATEGORICAL[1], "no concept": "#c8c8c8"}

hv.extension("bokeh", logo=False)


# -- analysis glue (no Panel) -------------------------------------------------------------------

def unit_data(model: explorer.Model, prompts: list[str], *, layer: int, tau: float, l0: int = 8
              ) -> dict[str, Any]:
    """Atoms of one layer as units over the probing set, with token-level concepts.

    Each prompt's first token (an attention sink) is left out. Returns a dict: ``acts``
    [n_tokens, n_atoms] (cosine of each token's resid_post with
    each atom), ``concepts`` (DataArray input x concept), ``token_ids`` and ``tokens``
    [n_tokens], and the fitted ``itda`` and traced ``activations``.
    """
    ds = trace(model, prompts, sites=("resid_post",), layers=[layer], progress=False)
    itda = ITDA(tau=tau, l0=l0).fit(ds, layer=layer, min_pos=MIN_POS)
    mask = ds["mask"].values & (ds["pos"].values >= MIN_POS)[None, :]
    x = ds["resid_post"].sel(layer=layer).values[mask].astype(np.float64)
    unit_x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
    return {"acts": unit_x @ itda.atoms_.astype(np.float64).T,
            "concepts": token_concepts(ds["token"].values[mask]),
            "token_ids": ds["token_id"].values[mask], "tokens": ds["token"].values[mask],
            "itda": itda, "activations": ds}


def concept_vector(data: dict[str, Any], unit: int, concept: str) -> np.ndarray:
    """The chosen concept's labels over the probing set (own_token: the atom's source token)."""
    if concept == "own_token":
        return (data["token_ids"] == data["itda"].atom_token_id_[unit]).astype(np.float64)
    return data["concepts"].sel(concept=concept).values.astype(np.float64)


def unit_request(p: dict[str, Any]) -> dict[str, Any]:
    """The inputs of one unit's scores (a record's ``request``): the dictionary's layer and
    tau, the unit, the concept, the binarisation with its alpha or threshold, the seed."""
    out = {"layer": int(p["layer"]), "tau": float(p["tau"]), "unit": int(p["unit"]),
           "concept": str(p["concept"]), "binarize": str(p["binarize"]), "seed": int(p["seed"])}
    if p["binarize"] == "top_quantile":
        out["alpha"] = float(p["alpha"])
    else:
        out["threshold"] = float(p["threshold"])
    return out


def unit_words(rec: Provenance) -> str:
    """What the record's scores are of: ``atom 3 of the ITDA dictionary of the 8 probing
    prompts at layer 2 (tau 0.30; tiny-llama) · concept 'digit' · top_quantile (alpha 0.05)
    · seed 4``."""
    r = dict(rec.request)
    how = (f"alpha {r['alpha']:g}" if "alpha" in r else f"threshold {r['threshold']:g}")
    return (f"atom {r['unit']} of the ITDA dictionary of {dictionary_words(rec)} · "
            f"concept '{r['concept']}' · {r['binarize']} ({how}) · seed {r['seed']}")


def unit_heading(rec: Provenance | None) -> str:
    """The heading over the scores, from their record (`unit_words`), as Markdown."""
    if rec is None:
        return ""
    words = unit_words(rec)
    return html.escape(words[0].upper() + words[1:], quote=False)


def _normaliser(metric: str, scores: np.ndarray) -> float:
    span = METRIC_RANGES[metric]
    if span is not None:
        return span[1] - span[0]
    finite = scores[np.isfinite(scores)]
    width = float(finite.max() - finite.min()) if finite.size else 0.0
    return width if width > 0 else 1.0


def metric_table(acts: np.ndarray, c: np.ndarray, unit: int, *, seed: int, binarize: str, alpha: float,
                 threshold: float) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """Every metric for (unit, concept) and its normalised change under both perturbations.

    The perturbations are drawn from ``numpy.random.default_rng(seed)``: missing labels
    first, then extra labels. Returns the table (metric, score, missing_labels,
    extra_labels) and the two perturbed concepts.
    """
    a = acts[:, unit]
    opts = dict(binarize=binarize, alpha=alpha, threshold=threshold, seed=seed)
    base = paired_metrics(a, c, **opts)
    rng = np.random.default_rng(seed)
    perturbed = {"missing_labels": missing_labels(c[:, None], rng)[:, 0],
                 "extra_labels": extra_labels(c[:, None], rng)[:, 0]}
    after = {t: paired_metrics(a, v, **opts) for t, v in perturbed.items()}
    rows = []
    for m in METRICS:
        # unbounded metrics: normalise by the spread of this concept's score over all units
        span = (_normaliser(m, paired_metrics(acts, c[:, None], metrics=(m,), **opts)[m])
                if METRIC_RANGES[m] is None else _normaliser(m, np.zeros(1)))
        rows.append({"metric": m, "score": float(base[m][0]),
                     **{t: float((after[t][m][0] - base[m][0]) / span) for t in SANITY_TESTS}})
    return pd.DataFrame(rows), perturbed


def perturbation_table(a: np.ndarray, c: np.ndarray, perturbed: np.ndarray, test: str, tokens: np.ndarray,
                       *, top: int = 80) -> pd.DataFrame:
    """The ``top`` inputs by activation, each with its label status under one perturbation."""
    order = np.argsort(-a, kind="stable")[:top]
    status = []
    for i in order:
        if c[i] >= 0.5 and perturbed[i] >= 0.5:
            status.append("concept (kept)")
        elif c[i] >= 0.5:
            status.append("dropped (missing labels)")
        elif perturbed[i] >= 0.5:
            status.append("added (extra labels)")
        else:
            status.append("no concept")
    return pd.DataFrame({"rank": np.arange(len(order)), "activation": a[order],
                         "token": np.array(theme.show_tokens(tokens[order]), dtype=object),
                         "status": np.array(status, dtype=object), "test": test})


def _legend_above(plot: Any, element: Any) -> None:
    """Move the legend out of the plot frame into the band above it, in one row, so that it
    covers neither the bars nor the frame's edge."""
    from bokeh.models import Legend

    fig = plot.state
    for legend in fig.select(type=Legend):
        if legend in fig.center:
            fig.center.remove(legend)
        if legend not in fig.above:
            fig.add_layout(legend, "above")
        legend.update(orientation="horizontal", location="top_left", nrows="auto", ncols="auto",
                      border_line_alpha=0, background_fill_alpha=0, margin=0, padding=4)


def plot_metric_deltas(table: pd.DataFrame | None) -> hv.Element:
    """Normalised score change of every metric under both perturbations (a sound metric drops).

    Every metric is named: names stand upright and the legend sits in a row above the frame
    (`_legend_above`), so the frame has a column wide enough for each (at 60 degrees beside a
    legend, 12 of 17 hid)."""
    if table is None:
        return hv.Text(0, 0, "Scoring…").opts(xaxis=None, yaxis=None, toolbar=None, height=300,
                                              responsive=True)
    long = table.melt(id_vars=["metric", "score"], value_vars=list(SANITY_TESTS), var_name="test",
                      value_name="delta")
    long["test"] = long["test"].map({"missing_labels": "missing labels", "extra_labels": "extra labels"})
    return hv.Bars(long, ["metric", "test"], ["delta", "score"]).opts(
        color="test", cmap=[theme.CATEGORICAL[3], theme.CATEGORICAL[1]], xrotation=90,
        ylabel="Δ score / metric range", xlabel="metric", tools=["hover"], responsive=True,
        height=440, title="Score change under each perturbation",
        fontsize={"title": f"{theme.SIZES['title_font_pt']}pt", "xticks": f"{theme.SIZES['label_font_pt']}pt"},
        default_tools=_TOOLS, active_tools=[], show_legend=True, legend_position="top",
        multi_level=False, hooks=[_legend_above])


#: The caption under the score-change bars.
DELTAS_CAPTION = ("Each metric's score after the perturbation minus before, divided by the metric's "
                  "range (unbounded metrics: by the spread of this concept's score over all units). "
                  "A sound metric falls under both perturbations: both bars below 0.")
#: The caption under the two strips.
STRIPS_CAPTION = ("The 80 inputs the unit activates most, coloured by what the perturbation did to "
                  "their label. Missing labels: each positive dropped with p = 1/2. Extra labels: as "
                  "many negatives labelled positive, so the positives double in expectation.")


def plot_perturbations(strips: list[pd.DataFrame] | None) -> hv.Layout | hv.Element:
    """Top inputs by activation, coloured by what each perturbation did to their label."""
    if not strips:
        return hv.Text(0, 0, "…").opts(xaxis=None, yaxis=None, toolbar=None, height=240, responsive=True)
    panels = []
    for df in strips:
        title = {"missing_labels": "Missing labels", "extra_labels": "Extra labels"}[df["test"].iloc[0]]
        pts = hv.Scatter(df, "rank", ["activation", "status", "token"]).opts(
            color="status", cmap=_STATUS_COLORS, size=7, tools=["hover"], responsive=True, height=220,
            xlabel="input rank by activation", ylabel="cosine with atom", title=title,
            legend_position="right", default_tools=_TOOLS, active_tools=[],
            fontsize={"title": f"{theme.SIZES['title_font_pt']}pt"})
        panels.append(pts)
    return hv.Layout(panels).cols(1).opts(shared_axes=False)


def pass_fail_html(synthetic: xr.Dataset | None, real: xr.Dataset | None) -> str:
    """The sanity-check table: decrease accuracy per test, pass/fail, synthetic and real units."""
    if synthetic is None:
        return "<div class='neuron-passfail'>Running the sanity checks…</div>"

    def cells(ds: xr.Dataset | None, m: str) -> str:
        if ds is None or m not in ds["metric"].values:
            return "<td>–</td><td>–</td><td>–</td>"
        out = []
        for t in SANITY_TESTS:
            v = float(ds["pooled_decrease_accuracy"].sel(test=t, metric=m))
            if ds.attrs["params"].get("pass_rule") == "every_unit":
                v = float(ds["decrease_accuracy"].sel(test=t, metric=m).min())
            ok = bool(ds["passed"].sel(test=t, metric=m))
            out.append(f"<td class='{'pass' if ok else 'fail'}'>{v:.0%}</td>")
        ok = bool(ds["passed_both"].sel(metric=m))
        out.append(f"<td class='{'pass' if ok else 'fail'} verdict' data-metric='{m}'>"
                   f"{'pass' if ok else 'fail'}</td>")
        return "".join(out)

    real_head = (f"ITDA atoms, own token ({int(real.sizes['unit'])} units)" if real is not None
                 else "ITDA atoms (none with a repeated token)")
    rows = "".join(f"<tr><td>{html.escape(m)}</td>{cells(synthetic, m)}{cells(real, m)}</tr>" for m in METRICS)
    return (
        "<div class='neuron-passfail'><table class='passfail'><thead>"
        "<tr><th rowspan=2>metric</th><th colspan=3>synthetic units (worst frequency)</th>"
        f"<th colspan=3>{html.escape(real_head)}</th></tr>"
        "<tr><th>missing</th><th>extra</th><th>result</th><th>missing</th><th>extra</th><th>result</th></tr>"
        f"</thead><tbody>{rows}</tbody></table>"
        "<p class='note'>Decrease accuracy: share of (unit, seed) cases whose score fell by more than "
        "0.1% of the metric's range. Pass: above 90% on both tests. Synthetic: 20,000 inputs, 10 seeds. "
        "The atoms are scored on this page's probing prompts: with a few occurrences per token the "
        "real-unit column is noisy (docs/representations.md has a 1,500-token run).</p></div>")


_CSS = """
table.passfail { border-collapse: collapse; font-size: 13px; }
table.passfail td, table.passfail th { padding: 2px 8px; border: 1px solid #ddd; text-align: center; }
table.passfail td:first-child { text-align: left; font-family: monospace; }
table.passfail td.pass { background: #d9f0d3; }
table.passfail td.fail { background: #f6d5d0; }
.neuron-passfail .note { color: #555; font-size: 12px; }
table.neuron-scores { border-collapse: collapse; font-size: 13px; }
table.neuron-scores td, table.neuron-scores th { padding: 1px 8px; border-bottom: 1px solid #eee; }
"""


def unchanged_note(c: np.ndarray, perturbed: dict[str, np.ndarray], seed: int) -> str:
    """Why a perturbation's score changes are all 0, when it changed no label (else '').

    Missing labels keeps each of the n positives with p = 1/2, so with the few positives an
    atom's own token has on the probing prompts it keeps them all 1 time in 2^n (SmolLM2's
    atom 0: 2 positives, seed 0 keeps both): the perturbed explanation is the original and
    every metric's change is exactly 0, the right value, not a failure of the metric.
    """
    notes = []
    n = int(np.asarray(c).sum())
    for test in SANITY_TESTS:
        if np.array_equal(perturbed[test], c):
            if test == "missing_labels":
                notes.append(f"Missing labels with seed {seed} dropped none of the {n} positive "
                             f"label{'s' if n != 1 else ''} (each is kept with p = 1/2: all "
                             f"{n} stay 1 time in {2 ** n}), so the perturbed explanation is the "
                             "original and every Δ missing is 0. Try another seed.")
            else:
                notes.append(f"Extra labels with seed {seed} added no positive label, so every "
                             "Δ extra is 0. Try another seed.")
    return " ".join(notes)


def scores_html(table: pd.DataFrame | None, caption: str, note: str = "") -> str:
    """The metric table under its caption; ``note`` (`unchanged_note`) under the table."""
    if table is None:
        return "<div class='neuron-scores'>No scores yet.</div>"
    note_html = (f"<p class='note' data-unchanged='1' style='color:#555;font-size:12px'>"
                 f"{html.escape(note)}</p>" if note else "")
    rows = "".join(f"<tr data-metric='{r.metric}'><td><code>{r.metric}</code></td><td>{r.score:.4g}</td>"
                   f"<td>{r.missing_labels:+.4f}</td><td>{r.extra_labels:+.4f}</td></tr>"
                   for r in table.itertuples())
    return (f"<div class='neuron-scores'><b>{html.escape(caption)}</b><table class='neuron-scores'>"
            "<thead><tr><th>metric</th><th>score</th><th>Δ missing</th><th>Δ extra</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>{note_html}</div>")


# -- the view --------------------------------------------------------------------------------------

class NeuronEvalView(View):
    """Metrics of a unit's explanation, the two sanity-check perturbations, the pass/fail table.

    Parameters
    ----------
    model : explorer.Model
    background : bool, optional
        Compute in a worker thread (default when served) or inline (tests, notebooks).
    n_seeds : int, default=10
        Seeds of the real-unit sanity checks in the table.
    """

    probe_text = param.String(default=DEFAULT_PROBE_TEXT, label="Probing prompts",
                              doc="One prompt a line: the probing set of the units.")
    layer = index_choice("Layer", doc="Layer whose ITDA atoms are the units.")
    tau = param.Number(default=0.3, bounds=(0.05, 0.9), step=0.05, label="ITDA tau",
                       doc="Error threshold of the dictionary whose atoms are the units.")
    unit = index_choice("Unit (atom)",
                        doc="The unit evaluated: an ITDA atom of the layer (0 = the first added).")
    concept = param.Selector(default="own_token", objects=list(CONCEPTS), label="Concept",
                             doc="own_token: the atom's source token; or a token family.")
    binarize = param.Selector(default="top_quantile", objects=list(BINARIZATIONS), label="Binarisation",
                              doc="Active inputs: the top alpha fraction, or activation >= threshold.")
    alpha = param.Number(default=0.05, bounds=(0.001, 0.5), step=0.001, label="alpha (top fraction)",
                         doc="With top_quantile binarisation: the share of inputs, by activation, "
                             "counted as active.")
    threshold = param.Number(default=0.5, bounds=(-1.0, 1.0), step=0.05, label="threshold",
                             doc="With threshold binarisation: the activation (cosine with the atom) "
                                 "from which an input counts as active.")
    seed = param.Integer(default=0, bounds=(0, 49), label="Perturbation seed",
                         doc="Seed of the two random perturbations; play to redraw them seed after seed.")

    table = param.ClassSelector(class_=pd.DataFrame, default=None, allow_None=True, precedence=-1)
    strips = param.List(default=[], precedence=-1)
    synthetic = shown_dataset()
    real = shown_dataset()
    caption = param.String(default="", precedence=-1)
    note = param.String(default="", precedence=-1, doc="Why a perturbation changed no score (or '').")
    shown = param.ClassSelector(class_=Provenance, default=None, allow_None=True, precedence=-1,
                                doc="What the shown scores were computed on.")

    notify_title = "Neuron evaluation"
    failed_status = "Last run failed: {message}"
    wait_timeout = 300
    link_params = ("probe_text", "layer", "tau", "unit", "concept", "binarize", "alpha",
                   "threshold", "seed")

    def scope(self) -> Scope:
        """Its own probing prompts (the shown scores'); the units are atoms of a dictionary of
        unedited activations."""
        n = (len(self.shown.prompts) if self.shown is not None
             else len(self._prompts_now()) if self.probe_text.strip() else 0)
        return Scope(on=f"its own probing prompts ({n}, the box on the left), not your prompt",
                     edits="not applicable: the units are ITDA atoms of the unedited model's "
                           "activations and the sanity checks perturb concept labels, not "
                           "the model")

    def __init__(self, model: explorer.Model, *, background: bool | None = None, n_seeds: int = 10,
                 **params: Any):
        layer = params.pop("layer", model.spec.n_layers // 2)
        super().__init__(background=background, **params)
        self._model = model
        self._n_seeds = n_seeds
        self.bound_layer("layer", layer, model.spec.n_layers)
        # its caches (`View.cached`): "units" (the units of one probing set, layer and tau)
        # and "sanity" (the sanity-check tables, by probing set, layer and tau)
        self.runner("run", self._show_result)
        self._started = 0.0
        self.param.watch(self._request_run, list(_DATA_PARAMS + _VIEW_PARAMS))
        self._request_run()

    # -- computation -------------------------------------------------------------------------
    def _params(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _DATA_PARAMS + _VIEW_PARAMS}

    def _record(self, p: dict[str, Any], prompts: Sequence[str]) -> Provenance:
        return dictionary_record("neuron-eval", self._model.spec.name, prompts,
                                 method="neuron explanation metrics", request=unit_request(p))

    def _prompts_now(self) -> tuple[str, ...]:
        # an empty box is a request too (refused): it differs from every shown record
        return tuple(line for line in self.probe_text.splitlines() if line.strip()) or ("",)

    def shown_provenance(self) -> Provenance | None:
        """The shown scores' record (`shown`)."""
        return self.shown

    def requested_provenance(self) -> Provenance:
        """What the page would score from its current controls."""
        return self._record(self._params(), self._prompts_now())

    def stale_note(self) -> str:
        """Empty while the shown scores are of the current controls; else what they were
        computed on, what changed since and what the page is doing about it."""
        if self.shown is None:
            return ""
        return dictionary_stale_text(self.shown, self.requested_provenance(),
                                     state=stale_state(self.running, self.error),
                                     on=unit_words(self.shown))

    def _shown_params(self) -> dict[str, Any]:
        """The inputs of the shown scores (their record), before any the current controls."""
        if self.shown is None:
            return self._params()
        return {**self._params(), **dict(self.shown.request),
                "probe_text": "\n".join(self.shown.prompts)}

    def _request_run(self, *events: Any) -> None:
        p = self._params()
        self.running = True
        self._started = time.perf_counter()
        self.submit("run", lambda token: self._compute(p, token))

    @staticmethod
    def _data_key(p: dict[str, Any]) -> tuple:
        return tuple(probe_prompts(p["probe_text"])), p["layer"], p["tau"]

    def _unit_data(self, p: dict[str, Any]) -> dict[str, Any]:
        key = self._data_key(p)
        return self.cached("units", key, lambda: unit_data(
            self._model, list(key[0]), layer=p["layer"], tau=p["tau"]), limit=0)

    def _sanity_tables(self, key: tuple, data: dict[str, Any], token: CancelToken
                       ) -> tuple[xr.Dataset, xr.Dataset | None]:
        synthetic = self.cached("sanity", ("synthetic",),
                                lambda: synthetic_sanity_checks(**_SYNTHETIC))
        token.check()

        def checks() -> xr.Dataset | None:
            try:
                return itda_atom_sanity_checks(data["itda"], data["activations"], layer=key[1],
                                               min_count=2, n_seeds=self._n_seeds, alpha=0.05,
                                               min_pos=MIN_POS)
            except explorer.ExplorerError:
                return None                            # no atom token repeats in the probing set
        return synthetic, self.cached("sanity", key, checks)

    def _compute(self, p: dict[str, Any], token: CancelToken) -> dict[str, Any]:
        data = self._unit_data(p)
        token.check()
        n_units = data["acts"].shape[1]
        unit = min(max(0, p["unit"]), n_units - 1)
        c = concept_vector(data, unit, p["concept"])
        table, perturbed = metric_table(data["acts"], c, unit, seed=p["seed"], binarize=p["binarize"],
                                        alpha=p["alpha"], threshold=p["threshold"])
        a = data["acts"][:, unit]
        strips = [perturbation_table(a, c, perturbed[t], t, data["tokens"]) for t in SANITY_TESTS]
        token.check()
        synthetic, real = self._sanity_tables(self._data_key(p), data, token)
        itda = data["itda"]
        label = (theme.show_token(str(itda.atom_token_[unit])) if p["concept"] == "own_token"
                 else p["concept"])
        caption = (f"Unit: atom {unit} of {n_units} (source token '{theme.show_token(str(itda.atom_token_[unit]))}'),"
                   f" concept '{label}' on {int(c.sum())} of {len(c)} tokens, seed {p['seed']}")
        record = self._record({**p, "unit": unit}, self._data_key(p)[0])
        return {"p": p, "unit": unit, "n_units": n_units, "table": table, "strips": strips,
                "record": record,
                "synthetic": synthetic, "real": real, "caption": caption,
                "note": unchanged_note(c, perturbed, p["seed"])}

    # -- reproducibility ---------------------------------------------------------------------
    def export_datasets(self) -> dict[str, xr.Dataset]:
        """The sanity-check tables, and the shown unit's activations with its concept labels
        (of the shown scores' record, which it carries in its attrs' ``page_provenance``)."""
        out = super().export_datasets()
        if self.shown is None or self.table is None:
            return out
        p = self._shown_params()
        data = self.cache_get("units", self._data_key(p))
        if data is not None:
            unit = int(p["unit"])
            out["unit"] = xr.Dataset(
                {"activation": ("input", data["acts"][:, unit]),
                 "concept": ("input", concept_vector(data, unit, p["concept"]))},
                coords={"token": ("input", data["tokens"].astype(str))},
                attrs={"unit": unit, "concept_name": p["concept"], "layer": p["layer"],
                       "page_provenance": self.shown.to_json()})
        return out

    def code_recipe(self) -> Recipe:
        """The page's metric table and sanity checks as records, with the shown scores'
        inputs (their record; before the first, the current settings; the units and the
        table come from the page module's numpy glue)."""
        p = self._shown_params()
        L, unit, ne = p["layer"], p["unit"], "explorer.analyses.neuron_eval"
        return Recipe(model=self._model.spec.name, inputs={
            "prompts": probe_prompts(p["probe_text"])}, steps=[
            Note("the units, the concept and the table: apps.neuron_eval's numpy glue"),
            Call("data", "apps.neuron_eval.unit_data", (MODEL, Ref("prompts")),
                 {"layer": L, "tau": p["tau"]}, "ITDA atoms as units"),
            Call("c", "apps.neuron_eval.concept_vector", (Ref("data"), unit, p["concept"])),
            Call("table, perturbed", "apps.neuron_eval.metric_table", (Ref("data['acts']"),
                 Ref("c"), unit), {"seed": p["seed"], "binarize": p["binarize"],
                                   "alpha": p["alpha"], "threshold": p["threshold"]}),
            Call("real", f"{ne}.itda_atom_sanity_checks",
                 (Ref("data['itda']"), Ref("data['activations']")),
                 {"layer": L, "min_count": 2, "n_seeds": self._n_seeds, "alpha": 0.05,
                  "min_pos": MIN_POS}),
            Call("synthetic", f"{ne}.synthetic_sanity_checks", (), dict(_SYNTHETIC))])

    # -- results -------------------------------------------------------------------------------
    def _show_result(self, out: dict[str, Any]) -> None:
        self.param.unit.bounds = (0, max(0, out["n_units"] - 1))
        if self.unit != out["unit"]:
            with param.parameterized.discard_events(self):
                self.unit = out["unit"]
        seconds = time.perf_counter() - self._started
        self.param.update(table=out["table"], strips=out["strips"], synthetic=out["synthetic"],
                          real=out["real"], caption=out["caption"], note=out["note"], error="",
                          running=False, shown=dataclasses.replace(out["record"],
                                                                   computed_at=computed_at_now()),
                          status=f"{self._model.spec.name} · layer {out['p']['layer']} · {seconds:.2f} s")

    # -- layout ------------------------------------------------------------------------------
    def controls(self) -> pn.Column:
        widgets = {
            "probe_text": {"type": pn.widgets.TextAreaInput, "rows": 6, "auto_grow": True},
            "layer": {"type": pn.widgets.IntSlider, "throttled": True},
            "tau": {"type": pn.widgets.FloatSlider, "throttled": True},
            "unit": {"type": pn.widgets.IntInput},
            "concept": {"type": pn.widgets.Select},
            "binarize": {"type": pn.widgets.Select},
            "alpha": {"type": pn.widgets.FloatSlider, "throttled": True},
            "threshold": {"type": pn.widgets.FloatSlider, "throttled": True},
            "seed": {"type": pn.widgets.Player, "interval": 900, "loop_policy": "loop",
                     "show_loop_controls": False, "name": "Perturbation seed (play to animate)"},
        }
        return pn.Column(*labelled_controls(self, widgets), width=theme.SIZES["controls_width"],
                         css_classes=["neuron-controls"])

    def __panel__(self) -> pn.viewable.Viewable:
        spinner = self.busy_spinner()
        status = theme.status_line(self.param.status)
        note = {"styles": {"color": "#555"}, "sizing_mode": "stretch_width"}
        deltas = pn.pane.HoloViews(pn.bind(plot_metric_deltas, self.param.table),
                                   sizing_mode="stretch_width", css_classes=["neuron-deltas"])
        strips = pn.pane.HoloViews(pn.bind(plot_perturbations, self.param.strips),
                                   sizing_mode="stretch_width", css_classes=["neuron-strips"])
        scores = pn.pane.HTML(pn.bind(scores_html, self.param.table, self.param.caption,
                                      self.param.note),
                              stylesheets=[_CSS], css_classes=["neuron-score-table"], width=440)
        heading = pn.pane.Markdown(pn.bind(unit_heading, self.param.shown),
                                   css_classes=["neuron-heading"], sizing_mode="stretch_width",
                                   styles={"font-weight": "bold"})
        stale = stale_box("neuron-stale", self.stale_note, [self.param[n] for n in (
            "shown", "running", "error", *_DATA_PARAMS, *_VIEW_PARAMS)])
        passfail = pn.pane.HTML(pn.bind(pass_fail_html, self.param.synthetic, self.param.real),
                                stylesheets=[_CSS], css_classes=["neuron-passfail-pane"],
                                sizing_mode="stretch_width", min_width=440)
        # the two tables side by side when there is room, one under the other when not
        tables = pn.FlexBox(scores, pn.Column(pn.pane.Markdown("#### Sanity checks: pass/fail"), passfail,
                                              min_width=440, sizing_mode="stretch_width"),
                            flex_wrap="wrap", gap="24px", sizing_mode="stretch_width")
        return pn.Row(self.controls(),
                      pn.Column(pn.Row(spinner, status, align="center"),
                                paper_panel("neuron-eval", self), heading, stale, deltas,
                                pn.pane.Markdown(DELTAS_CAPTION, **note),
                                pn.pane.Markdown(self.param.note, visible=self.param.note.rx.bool(),
                                                 css_classes=["neuron-unchanged"], **note),
                                strips,
                                pn.pane.Markdown(STRIPS_CAPTION, **note), tables,
                                sizing_mode="stretch_width"),
                      sizing_mode="stretch_width")


serve(__name__, NeuronEvalView, title=f"{theme.TITLE}: evaluating neuron explanations", intro="neuron-eval")
