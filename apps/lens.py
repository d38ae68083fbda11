"""Logit lens page: what each layer would predict, and how a steering vector changes it.

With workspace edits (`LensView.edits`: the session's edit stack, e.g. an ablated head), a
second heatmap below the first shows the lens of the same prompt with those edits applied
(after the page's own steering, which both runs share), titled "edited: ..."; the first is
then titled "clean". A line above them gives the clean run's answer (its top-1 after the last
token) and its probability clean and edited (`apps._lens_heatmap.answer_line`). A prompt wider
than the page scrolls sideways in the heatmaps' own box, the colour bar left of the layers.

The logit lens (nostalgebraist 2020, "interpreting GPT: the logit lens") reads each layer's
residual stream through the final norm and the unembedding. The steering vector is the
difference of mean activations of two sets of contrast prompts, added to one layer's
residual stream at every position (Turner et al. 2023, "Steering Language Models With
Activation Engineering", arXiv:2308.10248).
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._lens_drawing import DrawingPart
from apps._lens_heatmap import (_DETAILS_CSS, _update_source, answer_line, details_html,
                                edited_caption, extra_labels, heatmap_columns, heatmap_updates,
                                is_preview, lens_tokens, moved_cells, plot_lens_heatmap,
                                plot_positions, plot_shape)
from apps._lens_preview import PreviewPart
from apps._lens_state import STATE_FORMAT, StatePart, _RUN_PARAMS
from apps._lens_text import LensRecordPart, lens_params
from apps._lens_tables import (MAX_LENS_TOKENS, answer_probabilities, check_lens_prompt,
                               contrast_prompts, contrast_vector, lens_grid_table, lens_table,
                               steering_summary)
from apps._page_provenance import ShownRecord
from apps._positions import PagePositions, position_caption
from apps._preview_slot import PreviewSlot
from apps._provenance import Provenance, one_line
from apps._recipe import MODEL, Call, Expr, Let, Recipe, Ref, Step
from apps._session import CancelToken
from apps._view import STATIC_TOOLS, Scope, View, serve, workspace_edits, workspace_positions
from explorer._checks import InputError
from explorer.interventions import Edit
from explorer.lens import preview_vocabulary
from explorer.lens_preview import (compatible_base, preview_forward_reason, preview_threads,
                                   steered_lens_preview)

__all__ = ["LensView", "lens_table", "plot_lens_heatmap", "heatmap_columns", "plot_shape",
           "heatmap_updates", "is_preview", "lens_tokens", "plot_positions", "contrast_vector",
           "check_lens_prompt", "MAX_LENS_TOKENS", "lens_grid_table",
           "STATE_FORMAT", "edited_caption", "moved_cells"]


_TOOLS = STATIC_TOOLS

hv.extension("bokeh", logo=False)


# -- analysis glue (xarray in, xarray/pandas out; no Panel) --------------------------------


# -- the view ------------------------------------------------------------------------------


class LensView(LensRecordPart, ShownRecord, DrawingPart, PreviewPart, StatePart, View):
    """Logit lens of a prompt, live under a steering vector set by sliders.

    Parameters
    ----------
    model : explorer.Model
    background : bool, optional
        Compute in a worker thread (default when served) or inline (default in notebooks
        and tests).
    **params
        Initial values of the parameters below.
    """

    prompt = param.String(default="The capital of France is",
                          doc="Prompt whose residual stream is read at every layer.")
    contrast_a = param.String(default="I love you. You are wonderful.", label="Contrast prompts A",
                              doc="One prompt a line. The steering vector points from the mean "
                                  "activation of B towards that of A (first tokens left out).")
    contrast_b = param.String(default="I hate you. You are terrible.", label="Contrast prompts B",
                              doc="One prompt a line; the other end of the steering vector.")
    steer_layer = param.Integer(default=0, bounds=(0, None), label="Steering layer",
                                doc="Layer whose resid_post gets α × (mean A − mean B) at every "
                                    "position.")
    alpha = param.Number(default=0.0, bounds=(-10.0, 10.0), step=0.5, label="Steering strength α",
                         doc="Multiple of the steering vector added; 0 runs the model unedited.")
    k = param.Integer(default=5, bounds=(1, 20), label="Top-k tokens",
                      doc="Tokens listed per cell in the hover tooltip.")

    result = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1,
                                 doc="The last good lens result (kept while a new one computes).")
    preview = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1,
                                  doc="The preview drawn while the steering slider moves; None "
                                      "once the exact result of the released value is in.")
    plot_version = param.Integer(default=0, precedence=-1,
                                 doc="Bumped when the heatmap must be built anew (a new shape).")
    edits = workspace_edits(doc="Workspace edits (intervention records): with any, a second "
                                "heatmap shows the lens with them applied after the steering.")
    selected_positions = workspace_positions(doc="Selected token positions of the prompt "
                                                 "(0-based; the workspace's in the gallery), "
                                                 "outlined on the heatmaps.")
    edited_result = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                        precedence=-1,
                                        doc="The lens with `edits` (and the steering) applied; "
                                            "None without workspace edits.")

    notify_title = "Logit lens"
    page_slug = "lens"
    described = ("result", "preview", "edited_result")
    failed_status = "Last run failed: {message}"
    wait_timeout = 120
    link_params = ("contrast_a", "contrast_b", "steer_layer", "alpha", "k")

    def scope(self) -> Scope:
        """Your prompt (the shown lens's, `shown_record`) and the contrast prompts of the
        steering vector; the workspace's edits are applied in a second heatmap."""
        shown = self.shown_record
        prompt = f" {one_line(shown.prompts[0])}" if shown is not None else ""
        return Scope(on=f"your prompt{prompt} (at most {MAX_LENS_TOKENS} tokens), steered by "
                        "the contrast prompts A − B",
                     edits="applied (a second heatmap: the lens with the workspace's edits)")

    def __init__(self, model: explorer.Model, *, background: bool | None = None, **params: Any):
        steer_layer = params.pop("steer_layer", model.spec.n_layers // 3)
        super().__init__(background=background, **params)
        self._model = model
        self.bound_layer("steer_layer", steer_layer, model.spec.n_layers)
        # its caches (`View.cached`): "clean" the prompt's clean run (one), "steering
        # vectors" (contrast A, contrast B, layer) -> [d_model]
        self._runner = self.runner("run", self._show_result)
        self._started = 0.0
        # the preview path: one job at a time, only the newest waiting request kept
        self.runner("preview", self._show_preview, busy=False, counted=False)
        self.runner("warm", self._show_preview, busy=False)   # `_warm_preview`
        self._slot = PreviewSlot(self._submit_preview)
        self._seq = 0            # request counter (previews and exact runs)
        self._exact_seq = 0      # the newest exact request: older previews are not drawn
        self.preview_runs = 0    # previews computed (tests and the bench read it)
        self._candidates: tuple[Any, tuple, np.ndarray] | None = None  # the last preview's
        self._alpha_slider: pn.widgets.FloatSlider | None = None
        # the prompt's tokens: a click toggles a position (the workspace's in the gallery)
        self._position_links = PagePositions(self, lambda: lens_tokens(self.result),
                                             refresh_on="result", css_class="lens-prompt-tokens",
                                             empty="the prompt has not been read yet.")
        self._positions = self._position_links.strip
        self.param.watch(self._positions_changed, ["selected_positions"])
        # the drawn heatmap's data sources, filled in place for results of the same shape
        self._sources: dict[str, list[weakref.ref]] = {"heat": [], "labels": []}
        self._figures: list[weakref.ref] = []
        self._plot_panes: list[weakref.ref] = []
        self._lines: list[weakref.ref] = []   # the drawn steering line (a Bokeh Span)
        self._drawn_shape: tuple | None = None
        self.param.watch(self._request_run, [*_RUN_PARAMS, "edits"])
        self.param.watch(self._draw, ["result", "preview"])
        self.run_once_loaded(self._request_run)

    @property
    def model(self) -> explorer.Model:
        return self._model

    # -- computation ---------------------------------------------------------------------
    def _run_params(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _RUN_PARAMS}

    def _request_run(self, *events: Any) -> None:
        if not self._page_loaded:  # changes before the page is up coalesce into its first run
            return
        self._mark_preview_ready(False)
        p = self._run_params()
        self.running = True
        self._started = time.perf_counter()
        self._seq += 1
        self._exact_seq = self._seq
        self._slot.drop_pending()          # previews asked for before this are stale
        extra = list(self.edits)
        record = self.lens_record(p, extra)
        self.submit("run", lambda token: (record, *self._compute(p, token, extra)))

    # -- the preview while the steering slider moves ------------------------------------


    def _compute_preview(self, p: dict[str, Any], token: CancelToken) -> xr.Dataset:
        """The lens at ``p``, previewed: the layers before the edit copied from the last
        exact result, the later ones re-run in plain torch from the clean run and read
        over candidate tokens (`explorer.lens_preview.steered_lens_preview`); where that
        forward does not cover the model, `explorer.logit_lens` ``preview_vocab``."""
        check_lens_prompt(self._model, p["prompt"])
        edits = self.edits_for(p)
        last = self.result
        if not edits and last is not None and not last.attrs["edits"] \
                and last.attrs["params"]["prompts"] == [p["prompt"]] \
                and last.sizes["rank"] == p["k"]:
            return last  # the unedited lens is already exact
        token.check()
        # alpha 0 after a steered exact result: the unedited lens, previewed as a zero
        # steering from the same layer (the preview forward runs it as fast as any move)
        forward = edits or [explorer.Steer(layer=p["steer_layer"],
                                           vector=self._steering_vector(p), alpha=0.0)]
        resume = self._clean_run(p["prompt"]) if not self._model.remote else None
        token.check()
        if resume is not None and preview_forward_reason(self._model, forward) is None \
                and compatible_base(last, p["prompt"], p["k"], min(e.layer for e in forward)):
            vocab = self._preview_candidates(last, forward)
            self.preview_runs += 1
            out = steered_lens_preview(self._model, p["prompt"], k=p["k"], edits=forward,
                                       clean=resume, base=last, candidates=vocab)
            if not edits:
                out.attrs["edits"] = []
            return out
        resume = resume if edits else None
        shown = [ds for ds in (self.result, self.preview) if ds is not None
                 and ds.attrs["params"]["prompts"] == [p["prompt"]]]
        directions = [np.sign(e.alpha) * np.asarray(e.vector) for e in edits]
        vocab = preview_vocabulary(self._model, results=shown, directions=directions)
        token.check()
        self.preview_runs += 1
        return explorer.logit_lens(self._model, p["prompt"], k=p["k"], edits=edits, resume=resume,
                                   rank_cap=p["k"], unembed_dtype="auto", preview_vocab=vocab)

    def _preview_candidates(self, base: xr.Dataset, edits: list[explorer.Steer]) -> np.ndarray:
        """`preview_vocabulary` of the exact result and the steering direction, kept while
        they stay the same (every move of one drag reads the same candidates)."""
        signs = tuple(float(np.sign(e.alpha)) for e in edits)
        key = (signs, tuple(e.vector for e in edits))
        if self._candidates is not None and self._candidates[0] is base \
                and self._candidates[1] == key:
            return self._candidates[2]
        vocab = preview_vocabulary(self._model, results=[base], directions=[
            s * np.asarray(e.vector) for s, e in zip(signs, edits)])
        self._candidates = (base, key, vocab)
        return vocab


    def _steering_vector(self, p: dict[str, Any]) -> np.ndarray:
        a, b = contrast_prompts(p["contrast_a"]), contrast_prompts(p["contrast_b"])
        for name, prompts in (("contrast_a", a), ("contrast_b", b)):
            if not prompts:
                raise InputError(f"`{name}` needs at least one prompt to steer with; got none.")
        key = (tuple(a), tuple(b), p["steer_layer"])
        return self.cached("steering vectors", key,
                           lambda: contrast_vector(self._model, a, b, p["steer_layer"]), limit=16)

    def edits_for(self, p: dict[str, Any] | None = None) -> list[explorer.Steer]:
        """The intervention records of the current (or given) parameters."""
        p = p or self._run_params()
        if p["alpha"] == 0:
            return []
        return [explorer.Steer(layer=p["steer_layer"], vector=self._steering_vector(p),
                               alpha=p["alpha"])]

    def _clean_run(self, prompt: str) -> Any:
        return self.cached("clean", prompt, lambda: explorer.clean_run(self._model, prompt),
                           limit=0)        # the last prompt's only

    def _compute(self, p: dict[str, Any], token: CancelToken,
                 extra: list[Edit] | None = None) -> tuple[dict, xr.Dataset, xr.Dataset | None]:
        """The lens at ``p`` (with its steering) and, with ``extra`` (workspace edits), the
        lens with the steering and then ``extra`` applied, for the same prompt.

        Runs at one torch thread like the preview (`preview_threads`): with two threads
        every product ends in an OpenMP barrier, and on a 2-core machine whose cores other
        work also takes, a thread waits out the other's time slice: SmolLM2, 16 tokens,
        steering at layer 10, load 10: 1.6-2.4 s at 1 thread, 8.4-10.3 s at 2 (2026-12-07).
        """
        with preview_threads():
            return self._compute_exact(p, token, extra)

    def _compute_exact(self, p: dict[str, Any], token: CancelToken,
                       extra: list[Edit] | None) -> tuple[dict, xr.Dataset, xr.Dataset | None]:
        check_lens_prompt(self._model, p["prompt"])
        edits = self.edits_for(p)
        token.check()
        # a remote model reduces the lens inside its trace; locally, an edit resumes at its
        # layer from the clean run; "auto" takes the bfloat16 screen where this CPU has
        # native bfloat16 (about half the unembedding's cost) and exact float32 elsewhere
        remote = self._model.remote
        resume = self._clean_run(p["prompt"]) if (edits and not remote) else None
        token.check()
        ds = explorer.logit_lens(self._model, p["prompt"], k=p["k"], edits=edits, resume=resume,
                                 rank_cap=p["k"], unembed_dtype="auto")
        edited = None
        if extra:
            from explorer.workspace import edit_label

            token.check()
            resume = None if remote else self._clean_run(p["prompt"])
            edited = explorer.logit_lens(self._model, p["prompt"], k=p["k"],
                                         edits=[*edits, *extra], resume=resume,
                                         rank_cap=p["k"], unembed_dtype="auto")
            edited.attrs["workspace_edits"] = [edit_label(e) for e in extra]
            token.check()
            edited.attrs["answer"] = answer_probabilities(self._model, p["prompt"], edits, extra,
                                                          resume=resume)
        return p, ds, edited

    # -- results (on the session's event loop when served) -------------------------------
    def _show_result(self, out: tuple[Provenance, dict, xr.Dataset, xr.Dataset | None]) -> None:
        record, p, ds, edited = out
        seconds = time.perf_counter() - self._started
        n = len(extra_labels(edited))
        more = "" if edited is None else f" · edited: {n} workspace edit{'s' if n > 1 else ''}"
        self.param.update(result=ds, edited_result=edited, preview=None, error="", running=False,
                          shown_record=self.stamped(record),
                          status=f"{self._model.spec.name} · {steering_summary(ds.attrs['edits'])}"
                                 f"{more} · {seconds:.2f} s")
        self._warm_preview()


    def _error_note(self) -> str:
        return " The previous result is still shown." if self.result is not None else ""

    def cancel(self, name: str | None = None) -> None:
        """Stop waiting for the run in flight; its result is discarded."""
        was_running = self.running
        super().cancel(name)
        if name in (None, "preview", "warm"):
            self._slot.reset()
        if was_running:
            self.param.update(running=False, status="Cancelled; showing the previous result.")

    # -- reproducibility -----------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """The shown heatmap's lens (its record's prompt, steering and top-k: `lens_params`)
        and, with workspace edits, the edited lens below it, as records."""
        shown = self.shown_record
        p = self._run_params() if shown is None else lens_params(shown, self._run_params())
        extra = self._shown_extra_edits(p)
        k, layer = p["k"], p["steer_layer"]
        inputs: dict[str, Any] = {"prompt": p["prompt"]}
        steps: list[Step] = []
        if p["alpha"] == 0:
            steps.append(Let("steer", [], "steering strength 0: the model unedited"))
        else:
            inputs.update(a=contrast_prompts(p["contrast_a"]), b=contrast_prompts(p["contrast_b"]),
                          steer_layer=layer)
            for side in ("a", "b"):              # the mean resid_post over contrast prompts
                ds = f"ds_{side}"
                steps += [
                    Call(ds, "explorer.trace", (MODEL, Ref(side)),
                         {"sites": ("resid_post",), "layers": [Ref("steer_layer")]}),
                    Expr(f"keep_{side}", f"{ds}.mask & (({ds}.pos > 0) | ({ds}.mask.sum('pos') "
                         "== 1))", "the first token left out (its attention-sink norm would "
                         "swamp the difference)"),
                    Expr(f"mean_{side}", f"{ds}.resid_post.sel(layer=steer_layer)"
                         f".where(keep_{side}).mean(('prompt', 'pos')).values")]
            steps += [Expr("vector", "(mean_a - mean_b).astype('float32')"),
                      Let("steer", [Call(None, "explorer.Steer", (), {
                          "layer": Ref("steer_layer"), "vector": Ref("vector"),
                          "alpha": float(p["alpha"])})])]
        lens = {"k": k, "rank_cap": k, "unembed_dtype": "auto"}
        steps.append(Call("lens", "explorer.logit_lens", (MODEL, Ref("prompt")),
                          {**lens, "edits": Ref("steer")}))
        if extra:
            steps.append(Call("edited", "explorer.logit_lens", (MODEL, Ref("prompt")),
                              {**lens, "edits": Ref("[*steer, *edits]")}, "the workspace's edits"))
        steps.append(Expr("top", "lens.top_token.isel(prompt=0, rank=0)",
                          "the heatmap: [pos, layer]"))
        return Recipe(model=self._model.spec.name, edits=extra, inputs=inputs, steps=steps)

    # -- drawing ---------------------------------------------------------------------------


    # -- the prompt's token positions ------------------------------------------------------


    # -- page data export ----------------------------------------------------------------

    # -- session export / import ---------------------------------------------------------


    # -- layout ----------------------------------------------------------------------------
    def controls(self) -> pn.Column:
        """The widgets: prompts, steering, top-k, export/import."""
        widgets = {  # sliders apply on release (value_throttled), not while dragging
            "prompt": {"type": pn.widgets.TextInput, "placeholder": "Enter a prompt and press Enter"},
            "contrast_a": {"type": pn.widgets.TextAreaInput, "auto_grow": True, "rows": 2},
            "contrast_b": {"type": pn.widgets.TextAreaInput, "auto_grow": True, "rows": 2},
            "steer_layer": {"type": pn.widgets.IntSlider, "throttled": True},
            "k": {"type": pn.widgets.IntSlider, "throttled": True},
        }
        params = pn.Param(self, parameters=list(widgets), widgets=widgets, show_name=False,
                          sizing_mode="stretch_width")
        layer_at = next(i for i, w in enumerate(params.layout)
                        if getattr(w, "name", None) == self.param.steer_layer.label)
        params.layout.insert(layer_at + 1, self.alpha_slider())
        download = pn.widgets.FileDownload(callback=self._state_file, filename="lens-state.json",
                                           label="Export state (JSON)",
                                           sizing_mode="stretch_width")
        upload = pn.widgets.FileInput(accept=".json,application/json", multiple=False,
                                      sizing_mode="stretch_width")
        upload.param.watch(self._upload_state, "value")
        return pn.Column(params, pn.layout.Divider(), download,
                         pn.pane.Markdown("Import state (JSON):", margin=(0, 10)), upload,
                         width=theme.SIZES["controls_width"], css_classes=["lens-controls"])


    def __panel__(self) -> pn.viewable.Viewable:
        spinner = pn.indicators.LoadingSpinner(value=self.param.busy, visible=self.param.busy,
                                               size=theme.SIZES["spinner"], color="primary")
        cancel = pn.widgets.Button(label="Cancel", color="default", width=90,
                                   disabled=self.param.running.rx.not_())
        cancel.on_click(lambda _event: self.cancel())
        plot = pn.pane.HoloViews(pn.bind(self._plot, self.param.plot_version),
                                 sizing_mode="stretch_width", css_classes=["lens-plot"])
        self._plot_panes.append(weakref.ref(plot))
        edited = self._edited_panes()
        details = pn.pane.HTML(pn.bind(details_html, self.param.result),
                               stylesheets=[_DETAILS_CSS], sizing_mode="stretch_width")
        caption = pn.pane.Markdown(
            pn.bind(lambda ds, sel: position_caption(sel, lens_tokens(ds)), self.param.result,
                    self.param.selected_positions),
            styles={"color": "#555", "font-size": "0.9em"}, margin=(0, 10),
            css_classes=["lens-positions-caption"])
        status = self.status_text("lens-status")
        answer = pn.pane.HTML(pn.bind(answer_line, self.param.edited_result),
                              visible=self.param.edited_result.rx.is_not(None),
                              css_classes=["lens-answer"], sizing_mode="stretch_width",
                              margin=(0, 10))
        return pn.Row(
            self.controls(),
            pn.Column(pn.Row(spinner, cancel, status, align="center"),
                      self.heading_pane("lens-heading"),
                      self.stale_box("lens-stale", ["prompt", "edits", "running", "error", "k",
                                                    "steer_layer", "alpha", "contrast_a",
                                                    "contrast_b"]),
                      self._positions,
                      caption, answer,
                      # a wide prompt's heatmap (56 px a token) scrolls sideways in its box,
                      # not the page: the boxes around it may be narrower than the plot
                      pn.Column(plot, edited, sizing_mode="stretch_width", scroll="x-auto",
                                css_classes=["lens-scroll"], styles={"min-width": "0"}),
                      details, sizing_mode="stretch_width", styles={"min-width": "0"}),
            sizing_mode="stretch_width",
        )


serve(__name__, LensView, title=f"{theme.TITLE}: logit lens", intro="lens")
