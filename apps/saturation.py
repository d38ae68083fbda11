"""Saturation events page: when does a model fix each of its top-k tokens?

Lioubashevski et al. (ICML 2025), "Looking Beyond the Top-1: Transformers Determine Top
Tokens in Order": read every layer through the logit lens; the layer from which the final
rank-j token stays at rank j is its saturation layer s_j, and s_1 < s_2 < ... tends to
hold. The page runs `explorer.analyses.saturation.saturation_analysis` over the shipped
corpus (cached in the activation store) and shows, from that one result:

* the text as a token strip coloured by s_1; a click shows the token's layer x rank table
  of lens top-k strings with saturation markers and its staircase of s_1..s_k;
* a k slider (1-10), the strict Kendall tau histogram with its permutation null;
* the task probe's balanced accuracy per layer against a random-feature control;
* the early-exit Pareto plot, theta sliders for the softmax-margin and cosine baselines,
  markers for the probe and the oracle;
* an intervention panel: a pair of tokens, an injection layer, the new s_1 (runs the model);
* a toggle between the trained weights and a random init of the same architecture;
* the prompt's token view (the gallery's sidebar prompt): s_1..s_k of each of its tokens as a
  position x rank heatmap and, with workspace edits (`SaturationView.edits`, e.g. an ablated
  head), the same for the edited model below it, titled with the edits, the cells whose
  saturation layer moved outlined. Above it the prompt's tokens as a strip: a click selects
  or deselects that token position (`SaturationView.selected_positions`, in the gallery the
  workspace's: ``P5``), and the selected positions' columns are outlined dashed on both
  heatmaps.
"""
from __future__ import annotations

import weakref
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._paper import paper_panel
from apps._controls import caption, index_choice, labelled, tip
from apps._page_provenance import ShownRecord
from apps._positions import PagePositions
from apps._provenance import one_line
from apps._result_cache import DiskResults
from apps._server import BoundedCache
from apps._recipe import EDITS, MODEL, Call, Expr, Let, Note, Recipe, Ref, Step
from apps._saturation_corpus import (CorpusPart, OPEN_BUDGET_S, _WEIGHTS, _note,
                                     estimated_seconds, pareto_caption, pareto_markers,
                                     plot_pareto, plot_probe_accuracy, plot_tau_histogram,
                                     probe_caption, tau_caption, tau_histogram_data)
from apps._saturation_detail import (DETAIL_GLYPHS, DetailPart, _NO_DETAIL, _RANK_TABLE_OPTS,
                                     _STAIRCASE_OPTS, detail_columns, detail_data, detail_header,
                                     empty_detail, plot_rank_table, plot_staircase,
                                     rank_table_elements, steps_mid)
from apps._saturation_injection import InjectionPart, plot_intervention
from apps._saturation_prompt import (LABELLED_POSITIONS, PROMPT_RANKS, PromptPart, changed_cells,
                                     edited_title, plot_prompt_saturation, prompt_caption,
                                     prompt_saturation, prompt_table)
from apps._saturation_strip import TokenStrip, strip_tokens
from apps._view import Scope, View, serve, shown_dataset, workspace_edits, workspace_positions
from explorer._checks import ExplorerError
from explorer.analyses import saturation as sat
from explorer.models import token_text

__all__ = ["SaturationView", "TokenStrip", "detail_data", "detail_columns", "detail_header",
           "plot_rank_table", "plot_staircase", "plot_tau_histogram", "plot_probe_accuracy",
           "plot_pareto", "plot_intervention", "tau_caption",
           "probe_caption", "pareto_caption", "estimated_seconds", "OPEN_BUDGET_S",
           "prompt_table", "plot_prompt_saturation", "LABELLED_POSITIONS", "changed_cells",
           "prompt_caption", "edited_title", "PROMPT_RANKS", "strip_tokens", "tau_histogram_data",
           "pareto_markers", "prompt_saturation", "rank_table_elements", "steps_mid",
           "empty_detail", "DETAIL_GLYPHS"]

hv.extension("bokeh", logo=False)

_SHIPPED_CHUNKS = BoundedCache(max_items=8)   # (model name, corpus tokens) -> its prompts


class SaturationView(DetailPart, CorpusPart, PromptPart, ShownRecord, InjectionPart, DiskResults,
                     View):
    """Saturation events over the shipped corpus, for the trained or a random-init model.

    Parameters
    ----------
    model : explorer.Model
    texts : list of str, optional
        Prompts to analyse instead of the shipped corpus (cut to ``n_tokens``).
    store : ActivationStore or None, optional
        Cache of results (default: the user's store; None when it cannot be used).
    background : bool, optional
        Compute in a worker thread (default when served) or inline (notebooks, tests).
    analysis_options : dict, optional
        Passed to `saturation_analysis` (e.g. ``n_permutations``, ``n_pairs``).
    result : xarray.Dataset, optional
        A computed `saturation_analysis` result to show instead of running the analysis
        (until ``weights`` or ``n_tokens`` change).
    compute_on_open : bool, optional
        Run the analysis as the page opens; default: when its result is in the store or it
        is estimated under `OPEN_BUDGET_S` seconds (`estimated_seconds`), else on the
        *Analyse* button.
    """

    weights = param.Selector(default="trained", objects=list(_WEIGHTS), label="Weights",
                             doc="The model's trained weights or a random init of the same "
                                 "architecture (the paper finds ordering in both).")
    n_tokens = param.Integer(default=1024, bounds=(64, 50_000), label="Corpus tokens analysed",
                             doc="Tokens of the shipped corpus run through the analysis.")
    text = index_choice("Text", doc="Which text (chunk) of the corpus the token strip shows.")
    k = param.Integer(default=5, bounds=(1, 10), label="Top-k",
                      doc="Ranks shown in the detail and used by the order test.")
    selected = param.Integer(default=-1, precedence=-1, doc="Clicked token position.")
    selected_positions = workspace_positions(doc="Selected token positions of the prompt "
                                                 "(0-based; the workspace's in the gallery), "
                                                 "outlined on its heatmaps.")
    theta_margin = param.Number(default=0.5, bounds=(0.0, 1.0), step=0.02, label="Margin θ",
                                doc="Softmax-margin exit threshold: exit once p1 − p2 ≥ θ.")
    theta_cosine = param.Number(default=0.99, bounds=(0.5, 1.0), step=0.0005, label="Cosine θ",
                                doc="State-saturation exit threshold: exit once "
                                    "cos(h_l, h_l−1) ≥ θ.")
    against = param.Selector(default="full model", objects=["full model", "true next token"],
                             label="Early-exit accuracy against",
                             doc="What an early exit must match to count as right: the full "
                                 "model's prediction or the text's true next token.")
    pair = index_choice("Intervention pair",
                        doc="Early/late-saturating token pair for the intervention.")
    inj_layer = index_choice("Injection layer",
                             doc="Block after which the early token's residual replaces the "
                                 "late token's (the intervention plot).")

    prompt = param.String(default="The capital of France is", label="Prompt",
                          doc="Prompt whose tokens' saturation layers s_1..s_k the page shows "
                              "(the gallery's sidebar prompt), clean and with the edits.")

    result = shown_dataset()
    intervention = param.Dict(default=None, allow_None=True, precedence=-1)
    edits = workspace_edits(doc="Workspace edits (intervention records): with any, a second "
                                "heatmap shows the prompt's saturation layers with them applied.")
    prompt_result = shown_dataset(doc="`saturation_layers` of the prompt, unedited.")
    result_note = param.String(default="", precedence=-1,
                               doc="Where the shown token view comes from when it is the "
                                   "result cache (`apps._result_cache.cached_note`); else ''.")
    prompt_edited = shown_dataset(doc="The same with `edits` applied; None without edits.")

    notify_title = "Saturation"
    page_slug = "saturation"
    described = ("prompt_result", "prompt_edited")
    failed_status = "Last run failed: {message}"
    link_params = ("weights", "n_tokens", "text", "k", "theta_margin", "theta_cosine", "against",
                   "pair", "inj_layer")

    def scope(self) -> Scope:
        """The corpus (its statistics: the shown result's tokens) and your prompt (the shown
        token view's, `shown_record`); the edits apply to the prompt's token view only."""
        corpus = "your texts" if self._texts is not None else "the shipped corpus"
        n = (self.result.attrs.get("summary", {}).get("n_tokens")
             if self.result is not None else None)
        tokens = f"{n} tokens" if n is not None else f"{self.n_tokens} tokens, to analyse"
        shown = self.shown_record
        prompt = f" {one_line(shown.prompts[0])}" if shown is not None else ""
        return Scope(on=f"{corpus} ({tokens}) for the statistics; your prompt{prompt} "
                        "for its token view",
                     edits="applied to your prompt's token view (a second heatmap); not "
                           "applicable to the corpus statistics: they are the unedited "
                           "model's, cached once per model")

    def __init__(self, model: explorer.Model, *, texts: list[str] | None = None,
                 store: Any = "default", background: bool | None = None,
                 analysis_options: dict[str, Any] | None = None,
                 result: xr.Dataset | None = None, compute_on_open: bool | None = None,
                 **params: Any):
        super().__init__(background=background, **params)
        self._model = model
        self._texts = texts
        self._options = dict(analysis_options or {})
        if store == "default":
            try:
                store = explorer.ActivationStore()
            except ExplorerError:
                store = None
        self._store = store
        self._labels: dict[int, str] = {}
        self.runner("analysis", self._show_result, heavy=True)   # a corpus: waits its turn
        self.runner("intervention", self._show_intervention, busy=False)
        self.runner("prompt", self._show_prompt)
        n_layers = model.spec.n_layers
        self.param.inj_layer.bounds = (0, max(0, n_layers - 2))
        self.param.watch(self._request_run, ["weights", "n_tokens"])
        self.param.watch(self._request_intervention, ["inj_layer"])
        self.param.watch(self._pair_changed, ["pair"])
        self.param.watch(self._text_changed, ["text"])
        # the click path: a fixed header pane and the detail plots' data sources, updated
        # in place (no new Bokeh model, so no re-walk of the document's models)
        self._header = pn.pane.HTML(_NO_DETAIL, sizing_mode="stretch_width",
                                    css_classes=["sat-detail-header"])
        self._columns = detail_columns(empty_detail(n_layers))
        self._sources: dict[str, list[weakref.ref]] = {g: [] for g in DETAIL_GLYPHS}
        # the "click a token" hints drawn in the empty detail plots: (source, its text data)
        self._hint_sources: list[tuple[weakref.ref, dict[str, Any]]] = []
        self._detail_row: pn.Row | None = None
        self._strip_widget: TokenStrip | None = None
        # the prompt's tokens: one strip for the page's life, a click toggles a position
        self._position_links = PagePositions(self, self.prompt_tokens,
                                             refresh_on="prompt_result",
                                             css_class="sat-prompt-tokens")
        self._positions = self._position_links.strip
        self.param.watch(self._send_detail, ["result", "text", "selected", "k"])
        self._run_button = pn.widgets.Button(
            color="primary", sizing_mode="stretch_width",
            description="Run the logit lens over the corpus and every analysis of the page "
                        "(cached in the activation store: the next open is instant).")
        self._run_button.on_click(lambda *_: self._request_run())
        self._name_button()
        self.param.watch(self._name_button, ["n_tokens"])
        self.param.watch(self._request_prompt, ["prompt", "edits", "weights"])
        self._request_prompt()
        if result is not None:
            self._show_result((self.weights, result, 0.0))
        elif compute_on_open or (compute_on_open is None and self._estimate() <= OPEN_BUDGET_S):
            self._request_run()
        elif compute_on_open is None and self._show_cached():
            pass
        else:
            self.status = (f"Press **Analyse** to run the analysis over {self.n_tokens:,} tokens "
                           f"(about {self._estimate():.0f} s on a CPU; then cached).")

    # -- model and data ---------------------------------------------------------------------
    def current_model(self) -> explorer.Model:
        """The trained model or its random-init twin (built once, seeded)."""
        if self.weights == "trained":
            return self._model
        seed = 0
        return self.cached("twin", seed, lambda: sat.random_init_twin(self._model, seed=seed))

    def texts(self) -> list[str]:
        """The corpus prompts: the page's own texts cut into chunks, or the shipped corpus's,
        cut once per model and size for the whole process (the cut tokenises the corpus, about
        0.2 CPU s on SmolLM2, and every page open looks its result up)."""
        if self._texts is not None:
            return sat.corpus_chunks(self._model, self._texts, max_tokens=self.n_tokens)
        key = (self._model.spec.name, int(self.n_tokens))
        if key not in _SHIPPED_CHUNKS:
            _SHIPPED_CHUNKS[key] = sat.corpus_chunks(self._model, sat.load_corpus(),
                                                     max_tokens=self.n_tokens)
        return list(_SHIPPED_CHUNKS[key])

    def decode(self, ids: Any) -> dict[int, str]:
        """Visible token strings for ids (cached)."""
        out = {}
        for i in np.asarray(ids).reshape(-1).tolist():
            i = int(i)
            if i not in self._labels:
                self._labels[i] = (theme.show_token(token_text(self._model.tokenizer, i))
                                   if i >= 0 else "∅")
            out[i] = self._labels[i]
        return out

    # -- the analysis -------------------------------------------------------------------------


    def show_error(self, exc: BaseException) -> None:
        super().show_error(exc)
        self._run_button.disabled = False

    # -- reproducibility ------------------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """The page's calls as records: the corpus analysis behind the strip, the order test,
        probe, early exit and injection, and the prompt's token view clean and edited."""
        s = "explorer.analyses.saturation"
        k = min(PROMPT_RANKS, self._model.vocab_size)
        layers = {"k": k, "rank_cap": min(self._model.vocab_size, max(50, k)),
                  "sample_positions": 0}
        corpus = self._texts if self._texts is not None else Call(None, f"{s}.load_corpus")
        steps: list[Step] = [
            Call("texts", f"{s}.corpus_chunks", (MODEL, corpus), {"max_tokens": self.n_tokens}),
            Call("result", f"{s}.saturation_analysis", (MODEL, Ref("texts")), self._options,
                 "strip, tau, probe, exit"),
            Let("text", self.text), Let("k", self.k),
            Expr("n", "int(result.mask.isel(prompt=text).sum())"),
            Expr("strip", "result.sat_layer.isel(prompt=text, pos=slice(0, n), rank=0)",
                 "s_1; -1: never")]
        if self.selected >= 0:
            steps.append(Call("clicked", "result.isel", (), {
                "prompt": Ref("text"), "pos": self.selected, "rank": Ref("slice(0, k)")},
                "the rank table and staircase"))
        pairs = self.pairs()
        if pairs and self.intervention is not None:
            pt, e, l = pairs[min(self.pair, len(pairs) - 1)]
            steps.append(Call("injection", f"{s}.inject_residual",
                              (MODEL, Ref(f"texts[{int(pt)}]")),
                              {"source_pos": e, "target_pos": l, "layer": self.inj_layer}))
        steps += [Note(),
                  Call("clean", f"{s}.saturation_layers", (MODEL, [Ref("prompt")]), layers),
                  Expr("shown", "clean.sat_layer.isel(prompt=0, rank=slice(0, k))",
                       "[pos, rank]; -1: never")]
        prompt, edits = self.shown_prompt_inputs()
        if edits:
            steps += [Call("edited", f"{s}.saturation_layers", (MODEL, [Ref("prompt")]),
                           {**layers, "edits": EDITS}),
                      Expr("edited_shown", "edited.sat_layer.isel(prompt=0, rank=slice(0, k))"),
                      Expr("changed", "shown != edited_shown", "the outlined cells")]
        twin = None if self.weights == "trained" else Call(
            "model", f"{s}.random_init_twin", (MODEL,), {"seed": 0}, "the random-init weights")
        return Recipe(model=self._model.spec.name, transform=twin, edits=edits,
                      inputs={"prompt": prompt}, steps=steps, aliases={s: "sat"})

    # -- the prompt's token view ----------------------------------------------------------------


    # -- the prompt's token positions ------------------------------------------------------


    # -- intervention -------------------------------------------------------------------------


    # -- panes ----------------------------------------------------------------------------------


    def _status(self) -> pn.Column:
        """The base's progress bar, shown while a run is in flight (`running`), over the
        status line: Markdown (the status names buttons in bold), the error after a ⚠."""
        def line(status: str, error: str, running: bool) -> str:
            if error:
                return f"⚠ {error}"
            return status or "Analysing the corpus…" if running else status

        bar = self.progress_bar(visible=self.param.running, active=self.param.running, height=12)
        text = pn.pane.Markdown(pn.bind(line, self.param.status, self.param.error,
                                        self.param.running), css_classes=["sat-status"],
                                sizing_mode="stretch_width")
        return pn.Column(bar, text, sizing_mode="stretch_width")

    def controls(self) -> pn.Column:
        p = self.param

        def group(name: str) -> pn.Column:
            return labelled(pn.widgets.RadioButtonGroup.from_param(
                p[name], color="primary", variant="outline",
                sizing_mode="stretch_width"), p[name].label, p[name].doc)

        def slider(name: str, kind: Any = pn.widgets.IntSlider, **kw: Any) -> pn.viewable.Viewable:
            return tip(kind.from_param(p[name], sizing_mode="stretch_width", **kw), p[name].doc)

        own_prompt = []
        if p.prompt.precedence is None or p.prompt.precedence >= 0:  # not driven by a sidebar
            own_prompt = [tip(pn.widgets.TextInput.from_param(
                p.prompt, placeholder="Enter a prompt and press Enter",
                sizing_mode="stretch_width"), p.prompt.doc)]
        return pn.Column(
            *own_prompt,
            group("weights"),
            tip(pn.widgets.IntInput.from_param(p.n_tokens, step=256, sizing_mode="stretch_width"),
                 p.n_tokens.doc),
            self._run_button,
            slider("text", throttled=True),
            slider("k", css_classes=["sat-k"]),
            slider("theta_margin", pn.widgets.FloatSlider, css_classes=["sat-theta-margin"]),
            slider("theta_cosine", pn.widgets.FloatSlider, format="0.0000",
                   css_classes=["sat-theta-cosine"]),
            group("against"),
            slider("pair", throttled=True),
            slider("inj_layer", throttled=True, css_classes=["sat-inj-layer"]),
            width=theme.SIZES["controls_width"])

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Row(
            self.controls(),
            pn.Column(
                self._status(), paper_panel("saturation", self),
                pn.pane.Markdown("### The prompt's tokens: saturation layers s_1..s_k"),
                self.heading_pane("sat-prompt-heading"),
                caption(self.param.result_note, "sat-result-note", margin=(0, 10),
                        visible=pn.bind(bool, self.param.result_note)),
                self.stale_box("sat-prompt-stale", ["prompt", "edits", "weights", "busy",
                                                    "error"]),
                _note("Cell (token, rank j): the layer from which the model's final rank-j "
                         "token at that position holds rank j (grey: never; the number in the "
                         f"cell up to {LABELLED_POSITIONS} tokens, else hover). With workspace "
                         "edits the edited run follows below, its changed cells outlined."),
                self._positions, self._position_caption,
                self._prompt_view,
                pn.pane.Markdown("### Corpus text, coloured by s_1"),
                _note("Each token coloured by the layer its top-1 prediction saturates at "
                         "(dark: early, yellow: late, grey: never). **Click a token** for its "
                         "layer × rank table of lens predictions (outlined: saturated) and its "
                         "staircase s_1..s_k, just below."),
                self._strip, self._header, self._detail_plots(),
                self._histogram, self._probe, self._pareto, self._intervention,
                sizing_mode="stretch_width"),
            sizing_mode="stretch_width")

    def page(self) -> pn.template.FastListTemplate:
        """The view in the app template (standalone serving)."""
        return theme.page([self.__panel__()], title="Saturation events")


serve(__name__, SaturationView, title="Saturation events", intro="saturation")
