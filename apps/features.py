"""Feature dashboards: browse a dictionary's features the way Neuronpedia shows them.

A dictionary (an ITDA dictionary of real activations, or the TopK SAE baseline the ITDA page
compares it with) is trained on the shipped prose corpus (`datasets/corpus`) at one layer's
residual stream and kept in the activation store, so only the first visit with given settings
trains it. For the selected feature the page shows its top-activating corpus contexts (the
activating token outlined, every token shaded by the feature's activation on it), the
histogram of its activations, its activation on each token of the workspace prompt, and its
logit effects: the decoder direction through the unembedding, W_U d, its most promoted and
suppressed tokens. The search box finds features by a token they fire on or promote. *Steer
with this feature* adds the decoder direction as a `Steer` edit to the workspace, so every page
runs the steered model. *Select this feature* adds the shown feature to the workspace's
selection (``L5.F123``: the layer and the index), where it travels in links and states; a
feature selected there (typed in the sidebar, or from a link) is shown here, at its layer. Every text on the page is written from the shown results' attrs and
the page's record of them (`FeaturesView.shown`, a `Provenance`): the dictionary's settings,
the feature and the prompt. The dictionary reads the clean model, so the record holds no
edits: a workspace edit leaves what the page shows current.
"""
from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Callable
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._controls import index_choice
from apps._page_provenance import outdated_markdown, recompute_state
from apps._provenance import Provenance, computed_at_now, one_line
from apps._recipe import MODEL, Call, Recipe, Ref
from apps._server import BoundedCache
from apps._session import CancelToken
from apps._view import STATIC_TOOLS, Scope, View, serve, shown_dataset, workspace_edits
from explorer import components as comp
from explorer._checks import InputError
from explorer.analyses import feature_dashboards as F
from explorer.analyses.saturation.corpus import corpus_chunks, load_corpus
from explorer.interventions import Edit

__all__ = ["FeaturesView", "contexts_html", "prompt_html", "plot_histogram",
           "plot_logit_effects", "search_html", "index_caption", "dashboard_title",
           "CHUNK_TOKENS"]

CHUNK_TOKENS = 128
"""The corpus is cut into prompts of at most this many tokens (at paragraph breaks)."""

_TEXTS = BoundedCache(max_items=8)   # (model name, corpus tokens) -> the corpus prompts

hv.extension("bokeh", logo=False)


# -- pure functions: Datasets in, HTML / HoloViews out -------------------------------------

def _shade(value: float, top: float) -> str:
    """Background of a token by a feature's activation (orange; blue where negative)."""
    if not np.isfinite(value) or value == 0 or top <= 0:
        return "transparent"
    a = min(1.0, abs(value) / top) * 0.85
    return f"rgba(230, 120, 20, {a:.2f})" if value > 0 else f"rgba(40, 110, 220, {a:.2f})"


def _feature_name(ds: xr.Dataset) -> str:
    kind = {"itda": "ITDA atom", "sae": "SAE latent"}.get(str(ds.attrs.get("kind")), "feature")
    return f"{kind} {ds.attrs.get('feature')} (L{ds.attrs.get('layer')} {ds.attrs.get('site')})"


def contexts_html(top: xr.Dataset | None) -> str:
    """The top-activating contexts: one line each, its activation, the activating token
    outlined, every token shaded by the feature's activation on it (hover: the value)."""
    if top is None:
        return "<div class='features-contexts'>No feature shown yet.</div>"
    peak = float(np.nanmax(np.abs(top.context_activation.values))) if top.sizes["rank"] else 0
    rows = []
    for r in range(top.sizes["rank"]):
        parts = []
        for j, o in enumerate(top.offset.values.tolist()):
            tok = str(top.context_token.values[r, j])
            if not tok:
                continue
            v = float(top.context_activation.values[r, j])
            style = f"background: {_shade(v, peak)};"
            if o == 0:
                style += " outline: 2px solid #b35900; font-weight: bold;"
            parts.append(f"<span class='features-token' style='{style}' title='{v:.3f}'>"
                         f"{html.escape(theme.show_token(tok))}</span>")
        rows.append(f"<div class='features-context'><code>{float(top.activation[r]):.3f}"
                    f"</code> {''.join(parts)} <span style='color:#888'>(text "
                    f"{int(top.token_prompt[r])}, position {int(top.token_pos[r])})</span></div>")
    if not rows:
        rows = ["<div>This feature is zero on every corpus token.</div>"]
    return (f"<div class='features-contexts'><b>Top activations of {_feature_name(top)}</b>"
            f"{''.join(rows)}</div>")


def prompt_html(on_prompt: xr.Dataset | None, prompt: str = "") -> str:
    """The workspace prompt's tokens shaded by the feature's activation on each (hover: the
    value); marked outdated when ``prompt`` is not the one it was computed on."""
    if on_prompt is None:
        return "<div class='features-prompt'>No prompt activation yet.</div>"
    values = on_prompt.activation.values[0]
    peak = float(np.abs(values).max()) if values.size else 0.0
    toks = "".join(
        f"<span class='features-token' style='background: {_shade(float(v), peak)}' "
        f"title='position {i}: {float(v):.3f}'>{html.escape(theme.show_token(str(t)))}</span>"
        for i, (t, v) in enumerate(zip(on_prompt.token.values, values)))
    stale = ""
    if prompt and on_prompt.attrs.get("prompt") != prompt:
        stale = ("<div class='features-stale' style='color:#a33'><b>Outdated</b>: computed on "
                 f"{html.escape(repr(on_prompt.attrs.get('prompt', '')))}.</div>")
    n_active = int((values != 0).sum())
    return (f"<div class='features-prompt'>{stale}<b>{_feature_name(on_prompt)} on your "
            f"prompt</b>: nonzero on {n_active} of {values.size} tokens, peak "
            f"{float(values.max()) if values.size else 0:.3f}.<div>{toks}</div></div>")


def dashboard_title(shown: Provenance | None) -> str:
    """The dashboards' heading from their record: the dictionary, the feature, the prompt."""
    if shown is None:
        return ""
    r = dict(shown.request)
    kind, layer, tokens, _ = r["dictionary"]
    name = {"itda": "ITDA atom", "sae": "SAE latent"}.get(kind, "feature")
    return (f"**{name} {r['feature']}** of the {kind.upper()} dictionary at layer {layer} "
            f"({tokens} corpus tokens) · on "
            f"{html.escape(one_line(shown.prompts[0]), quote=False)} ({shown.model})")


def plot_histogram(hist: xr.Dataset | None) -> hv.Element:
    """The feature's nonzero activations over the corpus, as a histogram."""
    if hist is None:
        return theme.placeholder("Training the dictionary…", height=260)
    edges = np.append(hist.left.values, hist.right.values[-1])
    n_act, n_tok = hist.attrs["n_active"], hist.attrs["n_tokens"]
    return hv.Histogram((edges, hist.token_count.values), kdims=["activation"],
                        vdims=["tokens"]).opts(
        title=f"{n_act} of {n_tok} tokens nonzero",
        color=theme.ACCENT, line_color=None, xlabel="activation", ylabel="tokens",
        responsive=True, height=260, min_width=300, default_tools=STATIC_TOOLS,
        tools=["hover"], toolbar="above", fontsize=theme.font_sizes())


def plot_logit_effects(effects: xr.Dataset | None) -> hv.Element:
    """The most promoted (red) and suppressed (blue) tokens of W_U d, one bar each."""
    if effects is None:
        return theme.placeholder("Training the dictionary…", height=300)
    up = [(theme.show_token(str(t)), float(v)) for t, v in
          zip(effects.promoted_token.values, effects.promoted_logit.values)]
    down = [(theme.show_token(str(t)), float(v)) for t, v in
            zip(effects.suppressed_token.values, effects.suppressed_logit.values)]
    rows = [(f"{i + 1}. {t}", v, "promoted") for i, (t, v) in enumerate(up)] + \
           [(f"{i + 1}. {t} ", v, "suppressed") for i, (t, v) in enumerate(reversed(down))]
    lim = max([abs(v) for _, v, _ in rows] + [1e-9])
    colours = {"promoted": theme.SIGNED_CMAP[-30], "suppressed": theme.SIGNED_CMAP[30]}
    return hv.Bars(rows, kdims=["token"], vdims=["logit", "effect"]).opts(
        invert_axes=True, color=hv.dim("effect").categorize(colours), show_legend=False,
        title="Logit effect W_U·d", xlabel="", ylabel="logit",
        ylim=(-lim * 1.05, lim * 1.05), responsive=True, height=max(260, 16 * len(rows) + 80),
        min_width=300, default_tools=STATIC_TOOLS, tools=["hover"], toolbar="above",
        fontsize=theme.font_sizes())


def search_html(found: xr.Dataset | None) -> str:
    """The search's results: features that fire on the token, and that promote it."""
    if found is None:
        return ""
    parts = []
    for how in found.how.values.tolist():
        row = found.sel(how=how)
        items = [f"<code>{int(f)}</code> ({float(s):.2f})"
                 for f, s in zip(row.feature.values, row.score.values) if int(f) >= 0]
        parts.append(f"<div><b>{html.escape(how)}</b> "
                     f"{html.escape(repr(found.attrs['query']))}: "
                     f"{', '.join(items) if items else 'none in the corpus'}</div>")
    return f"<div class='features-search-results'>{''.join(parts)}</div>"


def index_caption(index: xr.Dataset | None, cached: bool | None, seconds: float | None) -> str:
    """What the dictionary is, from its attrs: kind, layer, size, corpus tokens and where it
    came from (trained now, or read from the store)."""
    if index is None:
        return ""
    kind = {"itda": "ITDA dictionary", "sae": "TopK SAE"}[str(index.attrs["kind"])]
    settings = ", ".join(f"{k}={v}" for k, v in dict(index.attrs["settings"]).items())
    where = ("read from the activation cache" if cached else
             f"trained on this visit in {index.attrs['seconds']:.1f} s and cached for the "
             "next ones")
    shown = f"; shown in {seconds:.1f} s" if seconds is not None else ""
    return (f"{kind} ({settings}) at layer {index.attrs['layer']} {index.attrs['site']}: "
            f"{index.sizes['feature']} features over {index.attrs['n_tokens']} corpus tokens "
            f"({len(index.attrs['texts'])} texts of the shipped corpus); {where}{shown}.")


# -- the view ----------------------------------------------------------------------------

class FeaturesView(View):
    """Dashboards of a dictionary's features over the shipped corpus and the prompt.

    Parameters
    ----------
    model : explorer.Model
    background : bool, optional
    store : explorer.ActivationStore, optional
        Where trained dictionaries are kept (default ``$EXPLORER_CACHE``).
    **params
    """

    notify_title = "Feature dashboards"
    failed_status = "Last run failed: {message}"
    wait_timeout = 600

    prompt = param.String(default="The capital of France is", label="Prompt",
                          doc="Prompt whose tokens show the feature's activation.")
    kind = param.Selector(default="itda", objects=list(F.KINDS), label="Dictionary",
                          doc="ITDA (atoms of real activations) or the TopK SAE baseline.")
    layer = param.Integer(default=None, allow_None=True, bounds=(0, None), label="Layer",
                          doc="Layer whose residual stream (resid_post) the dictionary reads.")
    corpus_tokens = param.Integer(default=2048, bounds=(64, 40000), label="Corpus tokens",
                                  doc="Tokens of the shipped corpus the dictionary is trained on "
                                      "and its contexts come from.")
    tau = param.Number(default=0.3, bounds=(0.01, 0.95), label="ITDA tau",
                       doc="ITDA adds an atom where the relative error exceeds tau.")
    n_latents = param.Integer(default=1024, bounds=(16, 8192), label="SAE latents",
                              doc="Latents of the SAE baseline.")
    feature = index_choice("Feature", doc="The feature shown (an atom or latent index).")
    query = param.String(default="", label="Find features",
                         doc="A token (e.g. ' bread'): features that fire on it in the corpus "
                             "or promote it through the unembedding.")
    alpha = param.Number(default=None, allow_None=True, label="Steering strength",
                         doc="Multiple of the decoder direction a steering edit adds (empty: "
                             "the feature's largest corpus activation).")
    edits = workspace_edits(doc="Workspace edits; Steer with this feature adds one. The "
                                "dictionary and its activations read the clean model.")
    index = shown_dataset(doc="The dictionary and its corpus codes.")
    contexts = shown_dataset()
    histogram = shown_dataset()
    effects = shown_dataset()
    on_prompt = shown_dataset()
    found = shown_dataset()
    cached = param.Boolean(default=None, allow_None=True, precedence=-1,
                           doc="Whether the dictionary came from the store.")
    seconds = param.Number(default=None, allow_None=True, precedence=-1,
                           doc="Seconds from the request to the first dashboard.")
    shown = param.ClassSelector(class_=Provenance, default=None, allow_None=True, precedence=-1,
                                doc="What the shown dashboards were computed on.")
    selected_features = param.List(default=[], item_type=str, precedence=-1,
                                   doc="The workspace's selected features (L5.F123): the newest "
                                       "one selected is shown, at its layer; *Select this "
                                       "feature* adds the shown one.")

    link_params = ("kind", "layer", "corpus_tokens", "feature")

    def __init__(self, model: explorer.Model, *, background: bool | None = None,
                 store: Any = None, **params: Any):
        super().__init__(background=background, **params)
        self._model = model
        self._store = store
        self._push_edit: Callable[[Edit], Any] | None = None
        self._started = 0.0
        self.param.layer.bounds = (0, model.spec.n_layers - 1)
        if self.layer is None:
            self.layer = model.spec.n_layers // 2
        self.runner("index", self._got_index, progress=True)
        self.runner("dashboard", self._got_dashboard, busy=False)
        self.param.watch(self._request_index, ["kind", "layer", "corpus_tokens", "tau",
                                               "n_latents"])
        self.param.watch(self._request_dashboard, ["feature", "prompt"])
        self.param.watch(self._search, ["query"])
        self.param.watch(self._follow_selection, ["selected_features"])
        self.run_once_loaded(self._request_index)

    def scope(self) -> Scope:
        """The shipped corpus and your prompt; the edits do not apply (clean model)."""
        return Scope(on=f"the shipped corpus ({self.corpus_tokens} tokens) and your prompt",
                     edits="not applicable: the dictionary reads the clean model (Steer with "
                           "this feature adds an edit)")

    def set_edit_sink(self, push: Callable[[Edit], Any] | None) -> None:
        """Where *Steer with this feature* sends its edit (the gallery: the workspace)."""
        self._push_edit = push

    # -- computation -----------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """`feature_index`'s settings for the current parameters."""
        out: dict[str, Any] = {"kind": self.kind, "layer": int(self.layer)}
        if self.kind == "itda":
            out.update(tau=float(self.tau), l0=8)
        else:
            out.update(n_latents=int(self.n_latents), k=16, max_epochs=10)
        return out

    def request_provenance(self, feature: int | None = None) -> Provenance:
        """The record of what the page computes from its current inputs (the dictionary's
        settings, the feature, the prompt); no edits: the dictionary reads the clean model."""
        s = self.settings()
        dictionary = (s["kind"], s["layer"], int(self.corpus_tokens),
                      tuple(sorted((k, v) for k, v in s.items() if k not in ("kind", "layer"))))
        return Provenance(page="features", model=self._model.spec.name, prompts=(self.prompt,),
                          request=(("dictionary", dictionary),
                                   ("feature", int(self.feature if feature is None
                                                   else feature))))

    def shown_provenance(self) -> Provenance | None:
        """The shown dashboards' record (`shown`)."""
        return self.shown

    def requested_provenance(self) -> Provenance:
        return self.request_provenance()

    def waiting_state(self) -> str:
        """The end of the stale note (`ShownResult.stale_note`): whether the page is
        recomputing or failed (it recomputes as each input changes: there is no Compute
        button)."""
        return recompute_state(running=self.running, failed=bool(self.error))

    def stale_markdown(self, *_: Any) -> str:
        """The stale note as the page shows it ('' while the dashboards are of the inputs)."""
        return outdated_markdown(self.stale_note())

    def _record(self, wanted: Provenance, dash: dict[str, xr.Dataset]) -> Provenance:
        """``wanted`` with the feature the dashboards show (a feature past the dictionary's
        last is shown as its last) and the time."""
        request = dict(wanted.request) | {"feature": int(dash["contexts"].attrs["feature"])}
        return dataclasses.replace(wanted, request=tuple(sorted(request.items())),
                                   computed_at=computed_at_now())

    def texts(self) -> list[str]:
        """The corpus prompts the dictionary is trained on (cut once per model and size: the
        cut tokenises the whole shipped corpus, about 1.5 s of one core)."""
        key = (self._model.spec.name, int(self.corpus_tokens))
        if key not in _TEXTS:
            _TEXTS[key] = corpus_chunks(self._model, load_corpus(), chunk_tokens=CHUNK_TOKENS,
                                        max_tokens=self.corpus_tokens)
        return list(_TEXTS[key])

    def _request_index(self, *events: Any) -> None:
        if not self._page_loaded:
            return
        model, store, settings = self._model, self._store, self.settings()
        texts = self.texts()
        feature, prompt = self.feature, self.prompt
        wanted = self.request_provenance()
        self.running = True
        self._started = time.perf_counter()
        self.status = (f"Reading or training the {settings['kind'].upper()} dictionary on "
                       f"{self.corpus_tokens} corpus tokens (the first time takes a while; it "
                       "is cached afterwards)…")

        def job(token: CancelToken) -> tuple:
            index, cached = F.cached_feature_index(model, texts, store=store,
                                                   progress=self.progress_fn(token), **settings)
            token.check()
            return index, cached, wanted, self._dashboard(model, index, feature, prompt)

        self.submit("index", job)

    @staticmethod
    def _dashboard(model: explorer.Model, index: xr.Dataset, feature: int,
                   prompt: str) -> dict[str, xr.Dataset]:
        feature = min(int(feature), index.sizes["feature"] - 1)
        return {"contexts": F.top_activating_contexts(index, feature, k=12),
                "histogram": F.feature_histogram(index, feature),
                "effects": F.feature_logit_effects(model, index, feature, k=10),
                "on_prompt": F.feature_on_prompt(model, index, prompt, [feature])}

    def _got_index(self, result: tuple) -> None:
        index, cached, wanted, dash = result
        seconds = time.perf_counter() - self._started
        self.param.feature.bounds = (0, index.sizes["feature"] - 1)
        feature = int(dash["contexts"].attrs["feature"])
        with param.parameterized.discard_events(self):
            self.feature = feature
        self.param.update(index=index, cached=cached, seconds=seconds, error="", running=False,
                          found=None, shown=self._record(wanted, dash), **dash,
                          status=f"{index.sizes['feature']} features · "
                                 f"{'from the cache' if cached else 'trained now'} · first "
                                 f"dashboard in {seconds:.1f} s")

    def _request_dashboard(self, *events: Any) -> None:
        if self.index is None or not self._page_loaded:
            return
        model, index, feature, prompt = self._model, self.index, self.feature, self.prompt
        # dashboards of the shown dictionary (a new one is on its way when the settings moved)
        wanted = Provenance(page="features", model=model.spec.name, prompts=(prompt,),
                            request=(("dictionary", dict(self.shown.request)["dictionary"]),
                                     ("feature", int(feature))))
        self.submit("dashboard", lambda token: (
            wanted, self._dashboard(model, index, feature, prompt)))

    def _got_dashboard(self, result: tuple) -> None:
        wanted, dash = result
        self.param.update(error="", shown=self._record(wanted, dash), **dash)

    def _search(self, *events: Any) -> None:
        if self.index is None or not self.query.strip():
            self.found = None
            return
        try:
            found = F.search_features(self._model, self.index, self.query, k=8)
        except InputError as exc:
            self.show_error(exc)
            return
        self.found = found
        first = [int(f) for how in ("fires on", "promotes")
                 for f in found.feature.sel(how=how).values[:1] if int(f) >= 0]
        if first:
            self.feature = first[0]

    def steer(self, *events: Any) -> Edit | None:
        """Add the shown feature's decoder direction as a `Steer` edit (to the workspace in
        the gallery, else to the page's own edits)."""
        if self.index is None or self.shown is None:
            return None
        # the shown dashboards' feature (of the shown dictionary, `index`): the widget may
        # already name another whose dashboards are still computing
        feature = int(dict(self.shown.request)["feature"])
        try:
            edit = F.feature_steering_edit(self.index, feature, alpha=self.alpha)
        except InputError as exc:
            self.show_error(exc)
            return None
        if self._push_edit is not None:
            return self._push_edit(edit)
        self.edits = [*self.edits, edit]
        return edit

    def shown_feature(self) -> str | None:
        """The shown dashboards' feature in the selection's spelling (``L5.F123``)."""
        if self.shown is None:
            return None
        request = dict(self.shown.request)
        return str(comp.Feature(int(request["dictionary"][1]), int(request["feature"])))

    def select_shown(self, *events: Any) -> str | None:
        """Add the shown feature to the selection (the workspace's, in the gallery)."""
        name = self.shown_feature()
        if name is not None and name not in self.selected_features:
            self.selected_features = [*self.selected_features, name]
        return name

    def _follow_selection(self, event: Any) -> None:
        """A feature newly selected (in the workspace; selected again, it moves to the end) is
        shown: its layer's dictionary, then the feature; one past the shown dictionary's last
        is refused with the count. A deselection changes nothing shown."""
        old, new = list(event.old or []), list(event.new or [])
        if not new or len(new) < len(old) or (old and new[-1] == old[-1]):
            return
        self.show_selected(new[-1])

    def show_selected(self, name: str) -> None:
        """Show the feature ``name`` (``L5.F12``; other kinds of selection are not this
        page's): its layer's dictionary, then the feature; one past the shown dictionary's
        last is refused with the count."""
        try:
            f = comp.parse_feature(name)
        except comp.ComponentError:
            return
        if f.layer != self.layer:
            self.param.feature.bounds = (0, None)     # the new dictionary's size is not known
            with param.parameterized.discard_events(self):
                self.feature = f.index                # read by the index job
            self.layer = f.layer
            return
        n = None if self.index is None else int(self.index.sizes["feature"])
        if n is not None and f.index >= n:
            self.show_error(InputError(f"{f}: the layer-{f.layer} dictionary shown has {n} "
                                       f"features (F0..F{n - 1})."))
            return
        self.feature = f.index

    def _error_note(self) -> str:
        return " The last dashboards are still shown." if self.index is not None else ""

    # -- reproducibility -------------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """The dictionary (cached) and the shown feature's dashboards as library calls (of
        the shown record's inputs once dashboards are shown)."""
        s, f, prompt, tokens = self.settings(), int(self.feature), self.prompt, self.corpus_tokens
        if self.shown is not None:
            r = dict(self.shown.request)
            kind, layer, tokens, rest = r["dictionary"]
            s, f, prompt = {"kind": kind, "layer": layer, **dict(rest)}, r["feature"], \
                self.shown.prompts[0]
        lib = "explorer.analyses.feature_dashboards"
        return Recipe(model=self._model.spec.name, steps=[
            Call("texts", "explorer.analyses.saturation.corpus.corpus_chunks",
                 (MODEL, Call(None, "explorer.analyses.saturation.corpus.load_corpus")),
                 {"chunk_tokens": CHUNK_TOKENS, "max_tokens": tokens}),
            Call("index, cached", f"{lib}.cached_feature_index", (MODEL, Ref("texts")), s,
                 "trained once, then read from the activation cache"),
            Call("contexts", f"{lib}.top_activating_contexts", (Ref("index"), f), {"k": 12}),
            Call("histogram", f"{lib}.feature_histogram", (Ref("index"), f)),
            Call("effects", f"{lib}.feature_logit_effects", (MODEL, Ref("index"), f),
                 {"k": 10}),
            Call("on_prompt", f"{lib}.feature_on_prompt", (MODEL, Ref("index"), prompt, [f]))])

    # -- layout ----------------------------------------------------------------------------
    def __panel__(self) -> pn.viewable.Viewable:
        settings = pn.Param(self, parameters=["kind", "layer", "corpus_tokens", "tau",
                                              "n_latents"], show_name=False,
                            widgets={"layer": {"type": pn.widgets.IntInput},
                                     "corpus_tokens": {"type": pn.widgets.IntInput,
                                                       "step": 1024}},
                            default_layout=pn.Row, css_classes=["features-settings"])
        feature = pn.widgets.IntInput.from_param(self.param.feature, width=140,
                                                 css_classes=["features-feature"])
        query = pn.widgets.TextInput.from_param(self.param.query, placeholder="e.g. bread",
                                                width=200, css_classes=["features-search"])
        alpha = pn.widgets.FloatInput.from_param(self.param.alpha, width=140,
                                             placeholder="largest activation")
        steer = pn.widgets.Button(label="Steer with this feature", color="primary",
                                  css_classes=["features-steer"], align="end",
                                  description="Add the feature's decoder direction, times the "
                                              "strength, to the layer's residual stream as a "
                                              "workspace edit.")
        steer.on_click(self.steer)
        select = pn.widgets.Button(label="Select this feature", color="light", align="end",
                                   css_classes=["features-select"],
                                   description="Add the shown feature (L<layer>.F<index>) to "
                                               "the workspace's selection.")
        select.on_click(self.select_shown)
        alert = pn.pane.Alert(self.param.error, alert_type="danger",
                              visible=self.param.error.rx.bool(), css_classes=["features-error"],
                              sizing_mode="stretch_width")
        text = {"styles": {"font-size": "0.95em"}, "sizing_mode": "stretch_width"}
        inputs = [self.param[n] for n in ("shown", "prompt", "kind", "layer", "corpus_tokens",
                                          "tau", "n_latents", "feature")]
        return pn.Column(
            pn.Row(self.busy_spinner(), self.status_text("features-status"), align="center"),
            self.progress_bar(sizing_mode="stretch_width"),
            alert, settings,
            pn.pane.Markdown(pn.bind(index_caption, self.param.index, self.param.cached,
                                     self.param.seconds), css_classes=["features-caption"],
                             styles={"color": "#444", "font-size": "0.9em"},
                             sizing_mode="stretch_width"),
            pn.Row(feature, query, alpha, steer, select),
            pn.pane.HTML(pn.bind(search_html, self.param.found), **text),
            pn.pane.Markdown(pn.bind(dashboard_title, self.param.shown),
                             css_classes=["features-title"], sizing_mode="stretch_width"),
            pn.pane.Markdown(pn.bind(self.stale_markdown, *inputs), visible=pn.bind(
                lambda *_: bool(self.stale_note()), *inputs), css_classes=["features-stale"],
                styles={"color": "#a33"}, sizing_mode="stretch_width"),
            pn.pane.HTML(pn.bind(prompt_html, self.param.on_prompt), **text),
            pn.FlexBox(
                pn.pane.HTML(pn.bind(contexts_html, self.param.contexts),
                             styles={"font-size": "0.9em", "flex": "1 1 0"}, min_width=420),
                pn.Column(
                    pn.pane.HoloViews(pn.bind(plot_histogram, self.param.histogram),
                                      sizing_mode="stretch_width",
                                      css_classes=["features-histogram"]),
                    pn.pane.HoloViews(pn.bind(plot_logit_effects, self.param.effects),
                                      sizing_mode="stretch_width",
                                      css_classes=["features-effects"]),
                    min_width=380, styles={"flex": "1 1 0"}),
                sizing_mode="stretch_width"),
            sizing_mode="stretch_width")


serve(__name__, FeaturesView, title=f"{theme.TITLE}: feature dashboards", intro="features")
