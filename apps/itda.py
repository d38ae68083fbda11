"""ITDA page: a dictionary of real activations, live under tau, its atoms, and layer similarity.

Inference-Time Decomposition of Activations (Leask, Nanda, Al Moubayed, ICML 2025) builds a
dictionary from the activations themselves: a token becomes an atom when matching pursuit
over the atoms so far reconstructs it with relative error above tau. The page shows the
dictionary size, reconstruction error and L0 as functions of tau (the slider marks where
you are), the top examples of an atom with their tokens highlighted, and a layer x layer
similarity heatmap between the model and a second model of the same family, each layer's
best match marked (ITDA-Jaccard of atom labels, linear CKA or SVCCA). Each prompt's first
token (an attention sink with a huge norm) is left out of every measure.

Each result lands with its record (`apps._dictionary_record`): the dictionary and its atom
(`ITDAView.shown`), the tau curves (`sweep_shown`) and the layer comparison
(`similarity_shown`). The heading, captions, scope line, export and code are written from
those records; while a control moved and its recompute has not landed (or was refused), a note
says what the shown dictionary was computed on.
"""
from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Sequence
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._paper import paper_panel
from apps._controls import index_choice, labelled_controls
from apps._dictionary_record import (dictionary_record, dictionary_stale_text, dictionary_words,
                                     stale_box, stale_state, with_records)
from apps._page_provenance import recompute_state
from apps._provenance import Provenance, computed_at_now
from apps._recipe import MODEL, Call, Recipe, Ref, Step
from apps._session import CancelToken, Cancelled
from apps._view import STATIC_TOOLS, Scope, View, serve, shown_dataset
from explorer._checks import InputError
from explorer.analyses.itda import ITDA, itda_atom_examples, itda_reconstruction, itda_tau_sweep
from explorer.analyses.similarity import SIMILARITY_METHODS, layer_similarity, perturbed_copy
from explorer.trace import trace

__all__ = ["ITDAView", "DEFAULT_PROBE_TEXT", "TAU_GRID", "MIN_POS", "TAU_CAPTION", "plot_tau_curves",
           "plot_similarity", "similarity_caption", "atom_examples_html", "probe_prompts",
           "dictionary_heading", "tau_caption", "similarity_record", "itda_recipe"]

#: A small probing set: digits, names, punctuation, number words, repeated function words.
DEFAULT_PROBE_TEXT = "\n".join([
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "In 1905 the physicist wrote four papers about light, time and matter.",
    "She counted one, two, three, four and five apples on the table.",
    "Water boils at 100 degrees; it freezes at 0 degrees.",
    "The quick brown fox jumps over the lazy dog!",
    "Alice met Bob in London on Monday, then they flew to Berlin.",
    "Is this the right way? Yes, it is the only way.",
    "He paid 25 dollars for two books and 3 pens.",
])

#: Each prompt's first token is left out: in SmolLM2 (and many models) it carries an
#: attention-sink norm about a hundred times the others', which would swamp every measure.
MIN_POS = 1

#: Taus of the size / error / L0 curve (the slider's own tau is marked on it).
TAU_GRID = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9)

_TOOLS = STATIC_TOOLS
_RUN_PARAMS = ("probe_text", "layer", "tau", "l0")
_SIMILARITY_PARAMS = ("method", "noise")

hv.extension("bokeh", logo=False)


# -- analysis glue (no Panel) -------------------------------------------------------------------

def probe_prompts(text: str) -> list[str]:
    """Prompts from a text box, one a line (blank lines skipped)."""
    prompts = [line for line in str(text).splitlines() if line.strip()]
    if not prompts:
        raise InputError("the probing set is empty; write at least one prompt (one per line).")
    return prompts


_font = theme.font_sizes


def plot_tau_curves(sweep: xr.Dataset | None, tau: float) -> hv.Layout | hv.Element:
    """Dictionary size, mean relative error and mean L0 against tau, the current tau marked."""
    if sweep is None:
        return hv.Text(0, 0, "Measuring the dictionaries over tau…").opts(
            xaxis=None, yaxis=None, toolbar=None, height=220, responsive=True)
    taus = sweep["tau"].values
    common = dict(responsive=True, height=220, tools=["hover"], default_tools=_TOOLS,
                  fontsize=_font(), xlabel="tau", padding=0.05, active_tools=[])
    panels = []
    for var, title, label, color in (
            ("n_atoms", "dictionary size", "atoms", theme.CATEGORICAL[0]),
            ("mean_error", "relative error", "mean ‖x−x̂‖²/‖x‖²", theme.CATEGORICAL[1]),
            ("mean_l0", "mean L0", "atoms per token", theme.CATEGORICAL[2])):
        curve = hv.Curve((taus, sweep[var].values), "tau", label).opts(color=color, line_width=2)
        dots = hv.Scatter((taus, sweep[var].values), "tau", label).opts(color=color, size=5)
        marker = hv.VLine(float(tau)).opts(color="black", line_dash="dashed", line_width=1.5)
        panels.append((curve * dots * marker).opts(title=title, ylabel=label, **common))
    return hv.Layout(panels).cols(3).opts(shared_axes=False)


#: The caption under the tau curves.
TAU_CAPTION = ("One dictionary per tau on the probing set (tau: the relative error above which a "
               "token becomes a new atom); the dashed line is the slider's tau.")


def tau_caption(rec: Provenance | None) -> str:
    """The caption under the tau curves, naming the prompts, layer and L0 they were measured
    on (their record, ``sweep_shown``)."""
    if rec is None:
        return TAU_CAPTION
    return (f"One dictionary per tau on {dictionary_words(rec)}; tau is the relative error "
            "above which a token becomes a new atom, and the dashed line is the slider's tau.")


def dictionary_heading(rec: Provenance | None) -> str:
    """The heading over the dictionary's summary, from its record: ``ITDA dictionary of the 8
    probing prompts at layer 2 (tau 0.30, L0 8; tiny-llama), atom 3 shown``."""
    if rec is None:
        return ""
    return (f"**ITDA dictionary of {html.escape(dictionary_words(rec), quote=False)}**, atom "
            f"{dict(rec.request)['atom']} shown")


def similarity_record(model: str, prompts: Sequence[str], *, method: str, tau: float, l0: int,
                      noise: float | None, other: str | None) -> Provenance:
    """The record of a layer comparison: the probing prompts, the measure, the second model
    (a named one, or this model with weight ``noise``) and, for ITDA-Jaccard, tau and L0."""
    request: dict[str, Any] = ({"other": other} if other is not None else {"noise": noise})
    if method == "itda":
        request.update(tau=tau, l0=l0)
    return dictionary_record("itda", model, prompts, method=method, request=request)

def itda_recipe(model: str, shown: Provenance, compared: Provenance | None) -> Recipe:
    """The page's dictionary, its atom, tau curves (and the layer comparison ``compared``
    once shown) as records of the library calls the page makes, from their records."""
    it, sim = "explorer.analyses.itda", "explorer.analyses.similarity"
    r = dict(shown.request)
    tau, l0, fit = r["tau"], r["l0"], {"layer": r["layer"], "min_pos": MIN_POS}
    steps: list[Step] = [
        Call("acts", "explorer.trace", (MODEL, Ref("prompts")), {"sites": ("resid_post",)}),
        Call("itda", f"{it}.ITDA", (), {"tau": tau, "l0": l0}),
        Call("itda", "itda.fit", (Ref("acts"),), fit),
        Call("reconstruction", f"{it}.itda_reconstruction", (Ref("itda"), Ref("acts")), fit,
             "error, L0, FVE"),
        Call("examples", f"{it}.itda_atom_examples", (Ref("itda"), Ref("acts")),
             {"k": 5, "atoms": [r["atom"]], **fit}),
        Call("sweep", f"{it}.itda_tau_sweep", (Ref("acts"),), {"taus": TAU_GRID, "l0": l0, **fit})]
    if compared is not None:
        c = dict(compared.request)
        if "other" in c:
            steps.append(Call("other", "explorer.load_model", (c["other"],)))
        else:
            steps.append(Call("other", f"{sim}.perturbed_copy", (MODEL,),
                              {"scale": c["noise"], "seed": 1}))
        steps += [Call("other_acts", "explorer.trace", (Ref("other"), Ref("prompts")),
                       {"sites": ("resid_post",)}),
                  Call("similarity", f"{sim}.layer_similarity", (Ref("acts"), Ref("other_acts")),
                       {"method": compared.method, "tau": c.get("tau", tau),
                        "l0": c.get("l0", l0), "min_pos": MIN_POS})]
    return Recipe(model=model, steps=steps, inputs={"prompts": list(shown.prompts)})


_SIMILARITY_NAMES = {"itda": "ITDA-Jaccard of atom labels", "cka": "linear CKA", "svcca": "SVCCA"}


def plot_similarity(sim: xr.Dataset | None, message: str = "Computing layer similarity…",
                    rec: Provenance | None = None) -> hv.Overlay | hv.Element:
    """Layer x layer similarity between two models, each layer's best match marked with ×,
    titled with the measure of its record ``rec`` (else of its attrs); ``message`` in its
    place while there is none."""
    if sim is None:
        return hv.Text(0, 0, message).opts(xaxis=None, yaxis=None, toolbar=None, height=320,
                                           responsive=True)
    la, lb = sim["layer_a"].values, sim["layer_b"].values
    s = sim["similarity"].values
    rows = [(int(b), int(a), float(s[i, j])) for i, a in enumerate(la) for j, b in enumerate(lb)]
    method = rec.method if rec is not None else sim.attrs.get("method", "")
    heat = hv.HeatMap(rows, ["layer_b", "layer_a"], "similarity").opts(
        cmap=theme.MAGNITUDE_CMAP, colorbar=True, clabel="similarity", tools=["hover"],
        xlabel="layer of the second model", ylabel="layer of the model",
        responsive=True, height=max(320, 14 * len(la) + 120),
        title=f"Layer similarity ({_SIMILARITY_NAMES.get(method, method)})", fontsize=_font(),
        default_tools=_TOOLS, active_tools=[], line_color="white", line_width=0.3)
    matched = hv.Points([(int(m), int(a)) for a, m in zip(la, sim["matched_layer"].values)],
                        ["layer_b", "layer_a"]).opts(marker="x", size=12, color="black", line_width=2)
    return (heat * matched).opts(responsive=True)


def similarity_caption(sim: xr.Dataset | None, rec: Provenance | None = None) -> str:
    """The line under the heatmap: the measure, the two models and the prompts, from its
    record ``rec`` (the second model named, or this one's weight noise; how many prompts, and
    tau and L0 for ITDA-Jaccard; without one, from the Dataset's attrs), and how often the
    best match is the same layer."""
    if sim is None:
        return ""
    acc = float(sim["matched"].values.mean())
    method, a, b = (sim.attrs.get("method", ""), f"`{sim.attrs.get('model_a')}`",
                    f"`{sim.attrs.get('model_b')}`")
    on = "the probing set"
    if rec is not None:
        r, n = dict(rec.request), len(rec.prompts)
        method, a = rec.method, f"`{rec.model}`"
        b = (f"`{r['other']}`" if "other" in r
             else f"a copy of it with weight noise {float(r['noise']):g}")
        on = f"the {n} probing prompt{'s' if n != 1 else ''}"
        if "tau" in r:
            on += f" (tau {float(r['tau']):.2f}, L0 {int(r['l0'])})"
    return (f"{_SIMILARITY_NAMES.get(method, method)} of every layer of {a} (rows) with every "
            f"layer of {b} (columns) on {on}; × = each row's best match, on the diagonal for "
            f"{acc:.0%} of the layers.")


def atom_examples_html(ex: xr.Dataset | None, acts: xr.Dataset | None, atom: int | None = None,
                       *, window: int = 6) -> str:
    """Top examples of one atom as HTML: each a snippet of its prompt, the token highlighted.
    ``atom``: one of ``ex``'s atoms (default: its first, the atom it was computed for)."""
    if ex is not None and atom is None and ex.sizes.get("atom"):
        atom = int(ex["atom"].values[0])
    if ex is None or acts is None or atom not in ex["atom"].values:
        return "<div class='itda-atom'>No dictionary yet.</div>"
    one = ex.sel(atom=atom)
    tokens = acts["token"].values
    mask = acts["mask"].values

    def snippet(p: int, q: int, strength: float) -> str:
        n = int(mask[p].sum())
        lo, hi = max(0, q - window), min(n, q + window + 1)
        parts = []
        for j in range(lo, hi):
            tok = html.escape(theme.show_token(str(tokens[p, j])))
            if j == q:
                alpha = 0.25 + 0.75 * strength
                parts.append(f"<mark style='background: rgba(230, 120, 20, {alpha:.2f})'>{tok}</mark>")
            else:
                parts.append(f"<span>{tok}</span>")
        return "".join(parts)

    sp, sq = int(one["source_prompt"]), int(one["source_pos"])
    head = (f"<div class='itda-atom' data-atom='{atom}'><b>Atom {atom}</b> — source token "
            f"<code>{html.escape(theme.show_token(str(one['source_token'].item())))}</code> "
            f"(prompt {sp}, position {sq}); used by {int(one['n_uses'])} tokens."
            f"<div class='itda-snippet itda-source'>source: {snippet(sp, sq, 1.0)}</div>")
    coefs = one["coefficient"].values
    top = np.nanmax(np.abs(coefs)) if np.isfinite(coefs).any() else 1.0
    rows = []
    for r in range(one.sizes["rank"]):
        c = coefs[r]
        if not np.isfinite(c):
            continue
        p, q = int(one["prompt"][r]), int(one["pos"][r])
        rows.append(f"<tr><td>{r + 1}</td><td>{c:.3g}</td>"
                    f"<td class='itda-snippet'>{snippet(p, q, abs(c) / top)}</td></tr>")
    table = ("<table class='itda-examples'><thead><tr><th>rank</th><th>coefficient</th>"
             f"<th>context (token highlighted)</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
             if rows else "<p>No token of the probing set uses this atom.</p>")
    return head + table + "</div>"


_CSS = """
table.itda-examples { border-collapse: collapse; font-size: 13px; margin-top: 6px; }
table.itda-examples td, table.itda-examples th { padding: 2px 8px; border-bottom: 1px solid #ddd;
  text-align: left; }
.itda-snippet span, .itda-snippet mark { font-family: monospace; padding: 0 1px; }
.itda-source { margin: 4px 0; }
"""


# -- the view --------------------------------------------------------------------------------------

class ITDAView(View):
    """ITDA dictionary of one layer, live under tau, with an atom browser and layer similarity.

    Parameters
    ----------
    model : explorer.Model
    other : explorer.Model, optional
        The second model of the similarity heatmap (same tokenizer). Default: a copy of
        ``model`` with relative Gaussian weight noise of strength ``noise``; a remote model
        has no weights here to copy, so without ``other`` its page shows no heatmap and
        says why.
    background : bool, optional
        Compute in a worker thread (default when served) or inline (tests, notebooks).
    """

    probe_text = param.String(default=DEFAULT_PROBE_TEXT, label="Probing prompts",
                              doc="One prompt a line; their tokens' activations build the dictionary.")
    layer = index_choice("Layer", doc="Layer whose resid_post is decomposed.")
    tau = param.Number(default=0.3, bounds=(0.01, 0.95), step=0.01, label="tau",
                       doc="A token becomes an atom when its relative reconstruction error exceeds "
                           "tau: lower tau, more atoms and less error.")
    l0 = param.Integer(default=8, bounds=(1, 64), label="L0 (matching-pursuit steps)",
                       doc="At most this many atoms reconstruct a token.")
    atom = index_choice("Atom", doc="The atom shown in the browser (0 = the first token added).")
    method = param.Selector(default="itda", objects=list(SIMILARITY_METHODS), label="Similarity measure",
                            doc="How two layers are compared: itda (Jaccard of their ITDA atom labels), "
                                "cka (linear CKA) or svcca (SVCCA).")
    noise = param.Number(default=0.05, bounds=(0.0, 0.5), step=0.01, label="Second model: weight noise",
                         doc="Relative Gaussian noise on the weights of the second model, a copy of "
                             "this one (when no second model is given).")
    compare = param.Event(label="Compare layers with a second model",
                          doc="Trace the second model on the probing prompts and compare every layer "
                              "of the two (tens of seconds for SmolLM2 on a CPU; the status under "
                              "the button says which step runs); then the heatmap follows the settings.")

    comparing = param.Boolean(default=False, precedence=-1,
                              doc="The layer comparison is asked for (the compare button): it is "
                                  "computed and follows the settings; a link carries it")
    sweep = shown_dataset()
    examples = shown_dataset()
    similarity = shown_dataset()
    activations = shown_dataset()
    summary = param.String(default="", precedence=-1, doc="Size, error, L0 and FVE of the dictionary.")
    similarity_status = param.String(default="", precedence=-1, doc="What the comparison is doing or did.")
    n_atoms = param.Integer(default=0, precedence=-1)
    shown = param.ClassSelector(class_=Provenance, default=None, allow_None=True, precedence=-1,
                                doc="What the shown dictionary and atom were computed on.")
    sweep_shown = param.ClassSelector(class_=Provenance, default=None, allow_None=True,
                                      precedence=-1, doc="What the tau curves were measured on.")
    similarity_shown = param.ClassSelector(class_=Provenance, default=None, allow_None=True,
                                           precedence=-1,
                                           doc="What the layer comparison was computed on.")
    similarity_running = param.Boolean(default=False, precedence=-1,
                                       doc="A layer comparison is in flight.")
    refused = param.Boolean(default=False, precedence=-1,
                            doc="The page refused its last input before computing (an empty "
                                "probing set); the message says why.")

    notify_title = "ITDA"
    link_params = ("probe_text", "layer", "tau", "l0", "atom", "method", "noise", "comparing")

    def scope(self) -> Scope:
        """Its own probing prompts (the shown dictionary's), on the unedited model."""
        n = (len(self.shown.prompts) if self.shown is not None
             else len(self.probe_text.splitlines()))
        return Scope(on=f"its own probing prompts ({n}, editable under *Probing prompts*), "
                        "not your prompt",
                     edits="not applicable: the dictionary and the layer similarity are built "
                           "from the unedited model's activations (and a noised copy of it)")
    failed_status = "Last run failed: {message}"
    wait_timeout = 300

    def __init__(self, model: explorer.Model, *, other: explorer.Model | None = None,
                 background: bool | None = None, **params: Any):
        layer = params.pop("layer", model.spec.n_layers // 2)
        super().__init__(background=background, **params)
        self._model = model
        self._fixed_other = other
        self.bound_layer("layer", layer, model.spec.n_layers)
        # a remote model's weights are on the server: no perturbed copy to compare with
        self._no_sibling = bool(getattr(model, "remote", False)) and other is None
        if other is not None or self._no_sibling:
            self.param.noise.precedence = -1
        self.similarity_status = (
            "No second model: a remote model has no weights on this machine to perturb into "
            "one. Pass another model (local or remote) as `other` to compare layers."
            if self._no_sibling else
            "Not computed yet: press the button to trace a second model and compare its layers.")
        # its caches (`View.cached`): "activations", "sweeps", "similarities" and "others"
        # (the perturbed copy of the model: one at a time, it is a whole model's weights)
        self._itda: ITDA | None = None
        self.runner("run", self._show_result)
        self.runner("sweep", self._show_sweep, progress=True)
        self.runner("similarity", self._show_similarity, heavy=True)
        self._started = 0.0
        self.param.watch(self._request_run, list(_RUN_PARAMS))
        self.param.watch(self._request_examples, "atom")
        self.param.watch(self._request_compare, "compare")
        self.param.watch(self._request_similarity, [*_SIMILARITY_PARAMS, "comparing"])
        self._request_run()

    @property
    def dictionary(self) -> ITDA | None:
        """The dictionary currently shown."""
        return self._itda

    # -- the shown results' records ------------------------------------------------------------
    def _record(self, p: dict[str, Any], prompts: Sequence[str], atom: int) -> Provenance:
        return dictionary_record("itda", self._model.spec.name, prompts, method="itda",
                                 request={"layer": int(p["layer"]), "tau": float(p["tau"]),
                                          "l0": int(p["l0"]), "atom": int(atom)})

    def _prompts_now(self) -> tuple[str, ...]:
        # an empty box is a request too (refused): it differs from every shown record
        return tuple(line for line in self.probe_text.splitlines() if line.strip()) or ("",)

    def shown_provenance(self) -> Provenance | None:
        """The shown dictionary's record (`shown`)."""
        return self.shown

    def requested_provenance(self) -> Provenance:
        """What the page would compute from its current controls."""
        return self._record(self._run_params(), self._prompts_now(), self.atom)

    def _similarity_request(self, p: dict[str, Any], prompts: Sequence[str]) -> Provenance:
        fixed = self._fixed_other
        return similarity_record(self._model.spec.name, prompts, method=p["method"],
                                 tau=float(p["tau"]), l0=int(p["l0"]),
                                 noise=None if fixed is not None else float(p["noise"]),
                                 other=fixed.spec.name if fixed is not None else None)

    def stale_note(self) -> str:
        """Empty while the shown dictionary is of the current controls; else what it was
        computed on, what changed since and what the page is doing about it."""
        if self.shown is None:
            return ""
        return dictionary_stale_text(self.shown, self.requested_provenance(),
                                     state=stale_state(self.running, self.error,
                                                       refused=self.refused))

    def similarity_state(self) -> str:
        """What the page is doing about a layer comparison older than the controls: it
        recomputes (the comparison, or the dictionary it follows), refused the new probing
        set, its recompute failed, or else the button (`compare`) updates it."""
        following = self.comparing and self.running          # the dictionary it follows
        return recompute_state(running=self.similarity_running or following,
                               refused=self.refused, failed=bool(self.error),
                               action=self.param.compare.label)

    def similarity_stale_note(self) -> str:
        """Empty while the shown layer comparison is of the current controls; else what it
        was computed on (its record), what changed since and `similarity_state`."""
        if self.similarity_shown is None:
            return ""
        wanted = self._similarity_request(self._run_params(), self._prompts_now())
        return dictionary_stale_text(self.similarity_shown, wanted, state=self.similarity_state())

    # -- computation -------------------------------------------------------------------------
    def _run_params(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _RUN_PARAMS + _SIMILARITY_PARAMS}

    def _request_run(self, *events: Any) -> None:
        self._started = time.perf_counter()
        self._submit_run()

    def _request_examples(self, *events: Any) -> None:
        if self._itda is None or self.activations is None:
            return
        self._submit_run()

    def _submit_run(self) -> None:
        """Compute the dictionary of the current controls; an empty probing set is refused
        before computing (its message shows, the shown dictionary stays)."""
        p = self._run_params()
        p["atom"] = self.atom
        try:
            probe_prompts(p["probe_text"])
        except InputError as exc:
            self.cancel("run")
            self.refused = True
            self.show_error(exc)
            return
        self.param.update(running=True, refused=False)
        self.submit("run", lambda token: self._compute(p, token))

    def _request_sweep(self, p: dict[str, Any], acts: xr.Dataset) -> None:
        """The tau curves of the shown layer and L0 (from the cache, or measured with progress)."""
        key = (tuple(probe_prompts(p["probe_text"])), p["layer"], p["l0"])
        record = dictionary_record("itda", self._model.spec.name, key[0], method="itda_tau_sweep",
                                   request={"layer": int(p["layer"]), "l0": int(p["l0"])})
        sweep = self.cache_get("sweeps", key)
        if sweep is not None:
            if self.sweep is not sweep:
                self._show_sweep((sweep, record))
            return

        def job(token: CancelToken) -> tuple[xr.Dataset, Provenance]:
            out = itda_tau_sweep(acts, taus=TAU_GRID, l0=p["l0"], layer=p["layer"], min_pos=MIN_POS,
                                 progress=self.progress_fn(token))
            return self.cache_put("sweeps", key, out), record

        self.submit("sweep", job)

    def _request_compare(self, *events: Any) -> None:
        if self.comparing:                # pressed again: compared again (else on the change)
            self._request_similarity()
        self.comparing = not self._no_sibling

    def _request_similarity(self, *events: Any) -> None:
        """Compare the layers with the second model's, once the button has been pressed."""
        if not self.comparing or self._no_sibling or self.activations is None:
            return
        # the shown dictionary's prompts, tau and L0 (the activations are of those prompts)
        p = {**self._run_params(), **{k: v for k, v in dict(self.shown.request).items()
                                      if k in ("tau", "l0")}}
        acts, prompts = self.activations, list(self.shown.prompts)
        record = self._similarity_request(p, prompts)

        def job(token: CancelToken) -> tuple[xr.Dataset, float, Provenance]:
            try:
                return compare(token)
            except Cancelled:
                raise
            except Exception:
                self.post(similarity_running=False,
                          similarity_status="The comparison failed (the message above says "
                                            "why)." + (" The previous one is still shown."
                                                       if self.similarity is not None else ""))
                raise

        def compare(token: CancelToken) -> tuple[xr.Dataset, float, Provenance]:
            started = time.perf_counter()

            def step(i: int, what: str) -> None:
                self.post(similarity_status=f"Comparing layers ({i}/3): {what} "
                                            f"({time.perf_counter() - started:.0f} s so far)…")

            step(1, "copying the model with weight noise")
            other = self._other(p["noise"])
            token.check()
            sim_key = (tuple(prompts), p["method"], other.spec.weights,
                       (p["tau"], p["l0"]) if p["method"] == "itda" else None)
            sim = self.cache_get("similarities", sim_key)
            if sim is None:
                step(2, "tracing the second model")
                other_acts = self._traced(other, prompts)
                token.check()
                step(3, f"{p['method']} of every pair of layers")
                sim = layer_similarity(acts, other_acts, method=p["method"], tau=p["tau"], l0=p["l0"],
                                       min_pos=MIN_POS)
                self.cache_put("similarities", sim_key, sim, limit=16)
            return sim, time.perf_counter() - started, record

        self.similarity_running = True
        self.submit("similarity", job)

    def _other(self, noise: float) -> explorer.Model:
        if self._fixed_other is not None:
            return self._fixed_other
        return self.cached("others", noise,                   # one copy of the weights at most
                           lambda: perturbed_copy(self._model, scale=noise, seed=1), limit=0)

    def _traced(self, model: explorer.Model, prompts: list[str]) -> xr.Dataset:
        key = (model.spec.name, model.spec.weights, tuple(prompts))
        return self.cached("activations", key,
                           lambda: trace(model, prompts, sites=("resid_post",), progress=False),
                           limit=6)

    def _compute(self, p: dict[str, Any], token: CancelToken) -> dict[str, Any]:
        """The dictionary at the chosen tau and its atom: what the page shows first."""
        prompts = probe_prompts(p["probe_text"])
        acts = self._traced(self._model, prompts)
        token.check()
        itda = ITDA(tau=p["tau"], l0=p["l0"]).fit(acts, layer=p["layer"], min_pos=MIN_POS)
        rec = itda_reconstruction(itda, acts, layer=p["layer"], min_pos=MIN_POS)
        atom = min(max(0, p["atom"]), itda.n_atoms - 1)
        ex = itda_atom_examples(itda, acts, k=5, atoms=[atom], layer=p["layer"], min_pos=MIN_POS)
        token.check()
        return {"p": p, "acts": acts, "itda": itda, "rec": rec, "examples": ex, "atom": atom,
                "record": self._record(p, prompts, atom)}

    # -- reproducibility ---------------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """The library calls of the shown results (`itda_recipe`; before the first result,
        of the current settings)."""
        shown = self.shown or self._record(self._run_params(), probe_prompts(self.probe_text),
                                           self.atom)
        compared = self.similarity_shown if self.similarity is not None else None
        return itda_recipe(self._model.spec.name, shown, compared)

    def export_manifest(self) -> dict[str, Any]:
        """`View.export_manifest`, with the layer comparison's record once one is shown."""
        out = super().export_manifest()
        if self.similarity is not None and self.similarity_shown is not None:
            out["similarity_provenance"] = self.similarity_shown.to_dict()
        return out

    def export_datasets(self) -> dict[str, xr.Dataset]:
        """The page's Datasets, each carrying the record of what it was computed on (JSON,
        in its attrs' ``page_provenance``)."""
        return with_records(super().export_datasets(), {
            "examples": self.shown, "activations": self.shown, "sweep": self.sweep_shown,
            "similarity": self.similarity_shown})

    # -- results (on the session's event loop when served) -----------------------------------
    def _show_result(self, out: dict[str, Any]) -> None:
        self._itda = out["itda"]
        rec, itda = out["rec"], out["itda"]
        seconds = time.perf_counter() - self._started
        summary = (f"{itda.n_atoms} atoms from {itda.n_tokens_seen_} tokens · mean error "
                   f"{float(rec['mean_error']):.3f} · mean L0 {float(rec['mean_l0']):.2f} · "
                   f"FVE {float(rec['fve']):.3f} · built in {itda.fit_seconds_ * 1000:.0f} ms")
        self.param.atom.bounds = (0, max(0, itda.n_atoms - 1))
        with param.parameterized.discard_events(self):
            self.atom = out["atom"]
        self.param.update(examples=out["examples"], activations=out["acts"], n_atoms=itda.n_atoms,
                          summary=summary, error="", running=False,
                          shown=dataclasses.replace(out["record"], computed_at=computed_at_now()),
                          status=f"{self._model.spec.name} · layer {out['p']['layer']} · {seconds:.2f} s")
        self._request_sweep(out["p"], out["acts"])
        self._request_similarity()                  # cached unless the data or ITDA's tau changed

    def _show_sweep(self, out: tuple[xr.Dataset, Provenance]) -> None:
        sweep, record = out
        self.param.update(sweep=sweep, sweep_shown=dataclasses.replace(
            record, computed_at=computed_at_now()))

    def _show_similarity(self, out: tuple[xr.Dataset, float, Provenance]) -> None:
        sim, seconds, record = out
        self.param.update(similarity=sim, similarity_status=f"Compared in {seconds:.1f} s.",
                          similarity_running=False,
                          similarity_shown=dataclasses.replace(record,
                                                               computed_at=computed_at_now()))

    # -- layout ------------------------------------------------------------------------------
    def controls(self) -> pn.Column:
        widgets = {
            "probe_text": {"type": pn.widgets.TextAreaInput, "rows": 6, "auto_grow": True},
            "layer": {"type": pn.widgets.IntSlider, "throttled": True},
            "tau": {"type": pn.widgets.FloatSlider, "throttled": True},
            "l0": {"type": pn.widgets.IntSlider, "throttled": True},
            "atom": {"type": pn.widgets.IntInput},
        }
        return pn.Column(*labelled_controls(self, widgets), width=theme.SIZES["controls_width"],
                         css_classes=["itda-controls"])

    def similarity_controls(self) -> pn.Column:
        """The second model's settings and the button, above the heatmap they change."""
        widgets = {"method": {"type": pn.widgets.RadioButtonGroup, "color": "primary", "variant": "outline"}}
        if self.param.noise.precedence is None or self.param.noise.precedence >= 0:
            widgets["noise"] = {"type": pn.widgets.FloatSlider, "throttled": True}
        button = pn.widgets.Button.from_param(self.param.compare, color="primary",
                                              description=self.param.compare.doc, disabled=self._no_sibling,
                                              width=300, margin=(8, 10, 5, 10))
        return pn.Column(pn.Row(*[pn.Column(w, width=280) for w in labelled_controls(self, widgets)]),
                         button, css_classes=["itda-similarity-controls"], sizing_mode="stretch_width")

    def __panel__(self) -> pn.viewable.Viewable:
        spinner = self.busy_spinner()
        status = theme.status_line(self.param.status)
        summary = pn.pane.Markdown(self.param.summary, css_classes=["itda-summary"])
        heading = pn.pane.Markdown(pn.bind(dictionary_heading, self.param.shown),
                                   css_classes=["itda-heading"], sizing_mode="stretch_width")
        inputs = [self.param[n] for n in ("shown", "running", "error", "refused", *_RUN_PARAMS,
                                          "atom")]
        stale = stale_box("itda-stale", self.stale_note, inputs)
        sim_inputs = [self.param[n] for n in ("similarity_shown", "similarity_running", "running",
                                              "error", "refused", "probe_text", "tau", "l0",
                                              *_SIMILARITY_PARAMS)]
        sim_stale = stale_box("itda-similarity-stale", self.similarity_stale_note,
                                    sim_inputs)
        bar = self.progress_bar(height=10)
        curves = pn.pane.HoloViews(pn.bind(plot_tau_curves, self.param.sweep, self.param.tau),
                                   sizing_mode="stretch_width", css_classes=["itda-curves"])
        caption = pn.pane.Markdown(pn.bind(tau_caption, self.param.sweep_shown),
                                   styles={"color": "#555"}, sizing_mode="stretch_width",
                                   css_classes=["itda-curves-caption"])
        atoms = pn.pane.HTML(pn.bind(atom_examples_html, self.param.examples, self.param.activations),
                             stylesheets=[_CSS], sizing_mode="stretch_width", css_classes=["itda-atoms"])
        shown = pn.bind(lambda sim: sim is not None, self.param.similarity)
        heat = pn.pane.HoloViews(pn.bind(plot_similarity, self.param.similarity,
                                         rec=self.param.similarity_shown), visible=shown,
                                 sizing_mode="stretch_width", css_classes=["itda-similarity"])
        sim_status = pn.pane.Markdown(self.param.similarity_status, styles={"color": "#555"},
                                      sizing_mode="stretch_width", css_classes=["itda-similarity-status"])
        sim_caption = pn.pane.Markdown(pn.bind(similarity_caption, self.param.similarity,
                                               self.param.similarity_shown),
                                       styles={"color": "#555"}, sizing_mode="stretch_width",
                                       css_classes=["itda-similarity-caption"])
        return pn.Row(self.controls(),
                      pn.Column(pn.Row(spinner, status, align="center"), paper_panel("itda", self),
                                heading, stale, summary, bar, curves, caption,
                                pn.pane.Markdown("#### Atom browser"), atoms,
                                pn.pane.Markdown("#### Layer similarity with a second model"),
                                self.similarity_controls(), sim_status, sim_stale, heat,
                                sim_caption,
                                sizing_mode="stretch_width"),
                      sizing_mode="stretch_width")


serve(__name__, ITDAView, title=f"{theme.TITLE}: ITDA dictionaries", intro="itda")
