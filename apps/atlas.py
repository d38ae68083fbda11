"""Head atlas page: every per-head score this session has computed, one heatmap and one table.

The scores are `explorer.head_atlas` of what the session's pages hold (in the gallery: ICL
heads' induction and FV scores, Knowledge conflicts' context / memory scores, Circuits' EAP
edge mass per head, ...) plus what the page computes itself: attention statistics and the
direct logit attribution of the top token against the second (`dla`, and `dla_edited` under
edits) on the workspace prompt, and, on request, induction scores. Clicking a cell of the heatmap
or a row of the table selects that head (`selected`, in the gallery the workspace selection);
the workspace's selected heads (`highlighted`) are outlined. The table sorts and filters, and
exports as CSV.

The page's own scores land with their record (`ShownRecord.shown_record`: the prompt, the
workspace edits and the induction settings they were computed with). The heading, status and
scope lines, the export and the code are written from it; in the gallery, a page not in view
keeps its scores when the workspace prompt or edits change, and a note says what they were
computed on until the page, opened again, recomputes them. The selection only outlines heads
(drawn at once): the record carries the heads outlined and a new selection marks nothing stale.
"""
from __future__ import annotations

import dataclasses
import html
import io
import json
from collections.abc import Callable, Sequence
from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._attention_trace import trace_patterns
from apps._controls import check_selected_component
from apps._heads_heatmap import head_cell, heads_heatmap, on_head_click
from apps._page_provenance import ShownRecord, edits_words, result_heading
from apps._provenance import Provenance, one_line
from apps._recipe import EDITS, MODEL, Call, Let, Note, Recipe, Ref, Step
from apps._view import Scope, View, serve, workspace_edits, workspace_selection
from explorer import components
from explorer._checks import InputError
from explorer.analyses.answer_dla import answer_logit_attribution
from explorer.head_atlas import atlas_table, head_atlas, head_scores_of
from explorer.interventions import Edit
from explorer.trace import trace as trace_sites
from explorer.workspace import edit_label

__all__ = ["AtlasView", "plot_score", "provenance_markdown", "collect_results", "atlas_csv",
           "edited_induction_scores", "atlas_heading", "own_scores_words", "MAX_TOKENS",
           "INDUCTION"]

hv.extension("bokeh", logo=False)

MAX_TOKENS = 256
"""The longest prompt the page traces for its attention statistics."""

INDUCTION = (8, 20)
"""The page's induction scores: this many repeated random sequences of this many tokens."""

SIGNED = ("fv_score", "ablation_effect", "dla")
"""Scores with a sign (drawn with a diverging map centred on 0)."""


# -- pure functions ----------------------------------------------------------------------

def _signed(name: str, values: np.ndarray) -> bool:
    """Draw with the diverging map: a signed score, or values on both sides of 0."""
    finite = values[np.isfinite(values)]
    if not finite.size:
        return False
    return name.startswith(SIGNED) or bool(finite.min() < 0 < finite.max())


def plot_score(atlas: xr.Dataset | None, score: str | None,
               highlighted: Sequence[str] = ()) -> hv.Element:
    """One score as a layer x head heatmap (layer 0 on top), the highlighted heads outlined."""
    if atlas is None or not score or score not in atlas:
        # fixed-size (it sits in a fixed-size pane): a responsive text would be 0 px wide
        return hv.Text(0.5, 0.5, "No per-head scores yet").opts(
            xaxis=None, yaxis=None, toolbar=None, width=360, height=200, xlim=(0, 1), ylim=(0, 1))
    da = atlas[score].transpose("layer", "head")
    values = da.values.astype(np.float64)
    return heads_heatmap(values, name="score", label=score, signed=_signed(score, values),
                         title=f"{score} (edited model)" if da.attrs.get("edits") else score,
                         highlighted=highlighted, fixed=True)


def provenance_markdown(atlas: xr.Dataset | None) -> str:
    """One line per score: its method, how it was reduced to the head, its parameters."""
    if atlas is None or not atlas.data_vars:
        return ""
    lines = ["**Where each score comes from**", ""]
    for name, da in atlas.data_vars.items():
        a = da.attrs
        params = a.get("params", "")
        try:
            short = ", ".join(f"{k}={v}" for k, v in json.loads(params).items()
                              if v is not None and not isinstance(v, (list, dict)))[:160]
        except (TypeError, ValueError):
            short = ""
        what = a.get("description") or a.get("source", "")
        edited = ""
        if a.get("edits"):
            edited = f"; on the model with {html.escape(a.get('edit_labels') or 'edits')}"
        lines.append(f"- `{name}`: {html.escape(str(a.get('method', '')))}"
                     f"{' — ' + html.escape(what) if what else ''}"
                     f"{' (' + html.escape(short) + ')' if short else ''}{edited}")
    return "\n".join(lines)


def atlas_heading(prov: Provenance) -> str:
    """The line over the atlas, from the record of the page's own scores: ``This page's
    attention statistics and attribution of 'The cat' (tiny-llama), with 1 workspace edit;
    induction on 8 repeated random sequences of 20 tokens``."""
    out = result_heading("This page's attention statistics and attribution", prov, clean=False)
    induction = dict(prov.request).get("induction")
    if induction:
        n, half, edits = induction
        under = f" under {edits_words(len(edits))}" if edits else ""
        out += f"; induction on {n} repeated random sequences of {half} tokens{under}"
    return out


def own_scores_words(prov: Provenance | None) -> str:
    """The status line's tail: the workspace edits the page's own scores were computed
    under (their record), or ''."""
    if prov is None or not prov.edits:
        return ""
    return f"; this page's scores under {edits_words(len(prov.edits))}"


def collect_results(values: Sequence[Any]) -> list[xr.Dataset]:
    """The Datasets among ``values`` that hold per-head scores (anything `head_atlas` reads),
    each once; attention traces are left out (the page traces the workspace prompt itself)."""
    out: list[xr.Dataset] = []
    seen: set[int] = set()
    for ds in values:
        if not isinstance(ds, xr.Dataset) or id(ds) in seen or "attn_pattern" in ds:
            continue
        if "layer" not in ds.dims and "edge" not in ds.dims:
            continue
        shape = ds.attrs.get("model_spec", {})
        n_layers = shape.get("n_layers", ds.sizes.get("layer", ds.attrs.get("n_layers", 0)))
        n_heads = shape.get("n_heads", ds.sizes.get("head", ds.attrs.get("n_heads", 0)))
        try:
            if not n_layers or not n_heads or not head_scores_of(ds, int(n_layers), int(n_heads)):
                continue
        except (ValueError, KeyError, TypeError):
            continue
        seen.add(id(ds))
        out.append(ds)
    return out


def edited_induction_scores(model: explorer.Model, edits: Sequence[Edit], *, n_sequences: int = 8,
                            half_len: int = 20) -> xr.Dataset:
    """`induction_scores` (Olsson et al. 2022; Yin & Steinhardt, ICML 2025) on the model with
    ``edits`` applied: the same repeated random-token sequences, their attention patterns
    traced under the edits. Without edits it is `induction_scores` itself."""
    from explorer.analyses.icl_heads import induction_score_from_patterns, induction_scores

    clean = induction_scores(model, n_sequences=n_sequences, half_len=half_len)
    if not edits:
        return clean
    ids = clean["sequence_ids"].values                                  # [sequence, pos]
    patterns = trace_sites(model, ids.tolist(), sites="attn_pattern", edits=list(edits),
                           batch_size=len(ids), progress=False).attn_pattern.values
    params = clean.attrs.get("params", {})
    params = json.loads(params) if isinstance(params, str) else dict(params)
    measure = params.get("measure", "mul")
    edited = clean.copy()
    edited["induction_score"] = (("layer", "head"),
                                 induction_score_from_patterns(patterns, ids, measure))
    edited.attrs = {**clean.attrs, "edits": [e.to_dict() for e in edits],
                    "workspace_edits": [edit_label(e) for e in edits]}
    return edited


def atlas_csv(atlas: xr.Dataset) -> str:
    """The atlas table as CSV text (one row per head)."""
    return atlas_table(atlas).to_csv(index=False, float_format="%.6g")


# -- the view ----------------------------------------------------------------------------

class AtlasView(ShownRecord, View):
    """Every per-head score of the session in one [layer, head] atlas.

    Parameters
    ----------
    model : explorer.Model
    sources : callable, optional
        Returns the Datasets other pages computed (the gallery passes its pages' results);
        `set_sources` sets it later.
    background : bool, optional
    **params
    """

    notify_title = "Head atlas"
    page_slug = "atlas"
    described = ("atlas",)
    failed_status = "Last run failed: {message}"
    wait_timeout = 300

    prompt = param.String(default="The capital of France is", label="Prompt",
                          doc="Prompt whose attention statistics the atlas holds.")
    score = param.Selector(default=None, objects=[], label="Score",
                           doc="The per-head score drawn as a heatmap.")
    selected = param.String(default="", label="Selected head",
                            doc="The head last clicked (L<layer>.H<head>).")
    highlighted = workspace_selection(doc="Components outlined (the workspace selection).")
    atlas = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1,
                                doc="The head atlas shown.")
    own = param.List(default=[], precedence=-1,
                     doc="Results the page computed itself (attention statistics, induction).")
    own_induction = param.Boolean(
        default=False, precedence=-1,
        doc="The page's own induction scores are in the atlas (Add induction scores): they "
            "follow the workspace's edits; a link carries it, and a page given it scores them; "
            "off, their column leaves the atlas (on again, it comes back)")
    edits = workspace_edits(doc="Workspace edits: the page's own scores (attention statistics of "
                                "the prompt, induction scores) are computed on the model with "
                                "them applied.")

    link_params = ("own_induction", "score")

    def __init__(self, model: explorer.Model, *, sources: Callable[[], Sequence[Any]] | None = None,
                 background: bool | None = None, **params: Any):
        super().__init__(background=background, **params)
        self._model = model
        self._sources = sources
        self._trace: xr.Dataset | None = None
        self._dla: xr.Dataset | None = None    # direct logit attribution of the top token
        self._induction: xr.Dataset | None = None
        self._shown_edits: list[Edit] = []   # the edits of the shown trace (its record's)
        self.runner("trace", self._got_trace)
        self.runner("induction", self._got_induction)
        self.param.watch(self._request_trace, ["prompt", "edits"])
        self.param.watch(self._edits_changed, ["edits"])
        self.param.watch(self._check_selected, ["selected"])
        self.param.watch(self._own_induction_set, ["own_induction"])
        self.run_once_loaded(self._opened)

    def scope(self) -> Scope:
        """Your prompt (the shown scores', `shown_record`) for attention statistics, repeated
        random tokens (induction), and the other pages' scores as those pages computed them;
        edits apply to the page's own."""
        shown = self.shown_record
        prompt = f" {one_line(shown.prompts[0])}" if shown is not None else ""
        return Scope(on=f"your prompt{prompt} (at most {MAX_TOKENS} tokens) for the attention "
                        "statistics"
                        " and direct logit attribution, repeated random tokens for induction, and the scores other pages "
                        "computed (each on its page's inputs)",
                     edits="applied to the attention statistics, attribution and induction scores "
                           "this page "
                           "computes; other pages' scores as their pages computed them")

    # -- the record of the page's own scores -----------------------------------------------
    def _induction_request(self, edits: list[Edit]) -> tuple | None:
        from explorer.workspace import edit_label

        if not self.own_induction:
            return None
        return (*INDUCTION, tuple(edit_label(e) for e in edits))

    def requested_provenance(self) -> Provenance:
        """What the page would compute now: the workspace's (else its own) prompt and edits,
        and the induction scores once asked for."""
        prompt, edits = self.current_inputs()
        return self.record("head atlas", prompt, edits,
                           request={"induction": self._induction_request(edits)})

    def shown_provenance(self) -> Provenance | None:
        """The shown scores' record, with the heads outlined (drawn from the selection)."""
        rec = super().shown_provenance()
        return None if rec is None else dataclasses.replace(
            rec, selection=tuple(self.highlighted))

    def heading(self, prov: Provenance) -> str:
        return atlas_heading(prov)

    def shown_induction(self) -> xr.Dataset | None:
        """The page's own induction scores the atlas shows: the last ones scored while
        `own_induction` is on, else None (kept aside, they come back when it is turned on
        again under the same edits)."""
        return self._induction if self.own_induction else None

    def _with_induction(self) -> None:
        """The shown record with the induction scores the atlas now shows (their edits, from
        the result's attrs), or without any."""
        rec, ds = self.shown_record, self.shown_induction()
        if rec is None:
            return
        request = {k: v for k, v in rec.request if k != "induction"}
        if ds is not None:
            request["induction"] = (*INDUCTION,
                                    tuple(str(t) for t in ds.attrs.get("workspace_edits", [])))
        self.shown_record = dataclasses.replace(rec, request=tuple(sorted(request.items())))

    def set_sources(self, sources: Callable[[], Sequence[Any]] | None) -> None:
        """Where the other pages' results come from; the atlas is rebuilt from them."""
        self._sources = sources
        self.refresh()

    # -- the atlas -------------------------------------------------------------------------
    def results(self) -> list[xr.Dataset]:
        """What the atlas is built from: the pages' results, then the page's own."""
        pages = collect_results(list(self._sources())) if self._sources is not None else []
        own = [ds for ds in (self._trace, self._dla, self.shown_induction()) if ds is not None]
        return pages + own

    def refresh(self, *_: Any) -> None:
        """Rebuild the atlas from the current results."""
        try:
            atlas = head_atlas(self.results(), model=self._model)
        except (InputError, ValueError, TypeError) as exc:
            self.show_error(exc)
            return
        names = list(atlas.data_vars)
        self.param.score.objects = names
        score = self.score if self.score in names else (names[0] if names else None)
        self.param.update(atlas=atlas, score=score)
        edited = own_scores_words(self.shown_record)
        self.status = (f"{len(names)} per-head score{'s' if len(names) != 1 else ''} of "
                       f"{self._model.spec.name} ({atlas.sizes['layer']} layers × "
                       f"{atlas.sizes['head']} heads){self.refresh_status_names()}{edited}")

    # -- reproducibility -------------------------------------------------------------------
    def export_tables(self) -> dict[str, pd.DataFrame]:
        """The atlas as the page's table: a row per head, its component name and scores."""
        return {"atlas": atlas_table(self.atlas)} if self.atlas is not None else {}

    def code_recipe(self) -> Recipe:
        """The atlas the page shows as records: the page's own trace (and induction scores)
        of the shown record's prompt and edits (before one, the page's), then
        `explorer.head_atlas`; the other pages' Datasets are read from their exports."""
        prompt, edits = self.prompt, list(self.edits)
        if self.shown_record is not None:
            prompt, edits = self.shown_record.prompts[0], list(self._shown_edits)
        edited = {"edits": EDITS} if edits else {}
        steps: list[Step] = [Let("results", [
            Call(None, "explorer.trace", (MODEL, [prompt]),
                 {"sites": ("attn_pattern",), **edited}),
            Call(None, "explorer.analyses.answer_dla.answer_logit_attribution",
                 (MODEL, prompt), edited)])]
        induction = self.shown_induction()
        if induction is not None:
            steps.append(Call(None, "results.append", (Call(
                None, "apps.atlas.edited_induction_scores",
                (MODEL, EDITS if induction.attrs.get("edits") else []),
                {"n_sequences": INDUCTION[0], "half_len": INDUCTION[1]}),)))
        pages = collect_results(list(self._sources())) if self._sources is not None else []
        if pages:
            steps += [Note(f"and the {len(pages)} Dataset(s) other pages computed, from their "
                           "'Export page data' zips, e.g.:"),
                      Note("results.append(xr.open_dataset('scores.nc'))")]
        steps += [Call("atlas", "explorer.head_atlas", (Ref("results"),), {"model": MODEL},
                       "[layer, head]"),
                  Call("table", "explorer.head_atlas.atlas_table", (Ref("atlas"),))]
        return Recipe(model=self._model.spec.name, steps=steps, aliases={"xarray": "xr"},
                      imports=["xarray"] if pages else [], edits=edits)

    def _request_trace(self, *_: Any) -> None:
        if not self._page_loaded:
            return
        prompt, model, edits = self.prompt, self._model, list(self.edits)
        record = self.record("head atlas", prompt, edits)
        self.running = True

        def job(token: Any) -> tuple[xr.Dataset, xr.Dataset, Provenance, list[Edit]]:
            patterns = trace_patterns(model, prompt, edits, max_tokens=MAX_TOKENS,
                                      check=token.check, limit="the atlas traces")
            token.check()
            return (patterns, answer_logit_attribution(model, prompt, edits=edits), record,
                    edits)

        self.submit("trace", job)

    def _got_trace(self, result: tuple[xr.Dataset, xr.Dataset, Provenance, list[Edit]]) -> None:
        self._trace, self._dla, record, self._shown_edits = result
        self.param.update(error="", running=False, shown_record=self.stamped(record))
        self._with_induction()
        self.refresh()

    def add_induction(self, *_: Any) -> None:
        """Score every head for induction on repeated random tokens (Olsson et al. 2022),
        on the model with the workspace's edits (`own_induction`; pressed again, rescored)."""
        if self.own_induction:
            self._score_induction()
        else:
            self.own_induction = True      # `_own_induction_set` scores them

    def _own_induction_set(self, event: Any) -> None:
        """On: the induction column, scored unless the scores kept aside are of the current
        edits. Off: the column leaves the atlas (and its record)."""
        if not self._page_loaded:
            return
        if event.new and not self._kept_induction_fits():
            self._score_induction()
        else:                  # off, a scoring in flight lands aside
            self._with_induction()
            self.refresh()

    def _kept_induction_fits(self) -> bool:
        """Whether the induction scores kept aside were scored under the current edits."""
        ds = self._induction
        return ds is not None and list(ds.attrs.get("edits", [])) == [
            e.to_dict() for e in self.edits]

    def _opened(self) -> None:
        """The page is up: its trace, and its own induction scores when asked for before."""
        self._request_trace()
        if self.own_induction:
            self._score_induction()

    def _score_induction(self) -> None:
        model, edits = self._model, list(self.edits)
        self.running = True
        self.status = "scoring induction heads…" + (" (under the workspace's edits)" if edits else "")
        self.submit("induction", lambda token: edited_induction_scores(
            model, edits, n_sequences=INDUCTION[0], half_len=INDUCTION[1]))

    def _edits_changed(self, *_: Any) -> None:
        if self.own_induction and self._page_loaded:
            self._score_induction()   # the induction column follows the edits too

    def _got_induction(self, ds: xr.Dataset) -> None:
        # Named by where it comes from when another page's induction scores are already in the
        # atlas (the atlas only uses the tag on a clash): "induction_score_random_8x20", not
        # "induction_score_3" (the result's index).
        params = ds.attrs.get("params", {})
        params = json.loads(params) if isinstance(params, str) else dict(params)
        ds = ds.copy()
        ds.attrs["task"] = (f"random_{params.get('n_sequences', '?')}x"
                            f"{params.get('half_len', '?')}")
        self._induction = ds
        self.param.update(error="", running=False)
        self._with_induction()
        self.refresh()

    def refresh_status_names(self) -> str:
        """Which induction column is which, when the atlas has two (the status line's tail)."""
        atlas = self.atlas
        if atlas is None or self.shown_induction() is None:
            return ""
        own = [n for n in atlas.data_vars if n.startswith("induction_score_random_")]
        if not own or "induction_score" not in atlas:
            return ""
        return (f"; {own[0]}: this page's (repeated random tokens), induction_score: "
                "another page's")

    # -- selection -------------------------------------------------------------------------
    def _check_selected(self, event: Any) -> None:
        check_selected_component(self, self._model.spec, event)

    def select(self, layer: int, head: int) -> None:
        """Select head ``(layer, head)``."""
        self.selected = str(components.head(self._model.check_layer(layer),
                                            self._model.check_head(head)))

    def _heat_tapped(self, x: Any = None, y: Any = None, **_: Any) -> None:
        cell = head_cell(x, y, self.atlas)
        if cell is not None:
            self.select(*cell)

    def _row_clicked(self, event: Any) -> None:
        table = self._table_frame()
        if event.row is not None and 0 <= event.row < len(table):
            self.selected = str(table.iloc[event.row]["component"])

    # -- layout ----------------------------------------------------------------------------
    def _table_frame(self, atlas: xr.Dataset | None = None, highlighted: Sequence[str] = ()) -> pd.DataFrame:
        atlas = self.atlas if atlas is None else atlas
        if atlas is None:
            return pd.DataFrame({"component": [], "layer": [], "head": []})
        table = atlas_table(atlas)
        table.insert(1, "selected", table["component"].isin(list(highlighted)))
        return table

    def _heatmap(self, atlas: xr.Dataset | None, score: str | None,
                 highlighted: Sequence[str]) -> hv.Element:
        return on_head_click(plot_score(atlas, score, highlighted), self._heat_tapped)

    def _csv(self) -> io.StringIO:
        return io.StringIO(atlas_csv(self.atlas) if self.atlas is not None else "")

    def __panel__(self) -> pn.viewable.Viewable:
        spinner = self.busy_spinner()
        status = self.status_text("atlas-status")
        alert = pn.pane.Alert(self.param.error, alert_type="danger",
                              visible=self.param.error.rx.bool(), sizing_mode="stretch_width")
        refresh = pn.widgets.Button(label="Refresh from pages", color="primary", width=180,
                                    align="end", css_classes=["atlas-refresh"])
        refresh.on_click(self.refresh)
        induction = pn.widgets.Button(label="Add induction scores", width=190, align="end",
                                      css_classes=["atlas-induction"])
        induction.on_click(self.add_induction)
        download = pn.widgets.FileDownload(callback=self._csv, filename="head_atlas.csv",
                                           label="Export CSV", width=130, align="end",
                                           css_classes=["atlas-csv"])
        score = pn.widgets.Select.from_param(self.param.score, width=240)
        picked = pn.widgets.TextInput.from_param(self.param.selected, width=140)
        # a fresh plot per change (not a DynamicMap): its size and colour map follow the score
        heat_pane = pn.pane.HoloViews(pn.bind(self._heatmap, self.param.atlas, self.param.score,
                                              self.param.highlighted),
                                      sizing_mode="fixed", css_classes=["atlas-heatmap"],
                                      linked_axes=False)
        table = pn.widgets.Tabulator(
            pn.bind(self._table_frame, self.param.atlas, self.param.highlighted),
            show_index=False, pagination="local", page_size=15, header_filters=True,
            disabled=True, layout="fit_columns", sizing_mode="stretch_width",
            titles=pn.bind(column_titles, self.param.atlas), stylesheets=[_WRAPPED_TITLES],
            widths={"selected": 96, "layer": 72, "head": 70},
            configuration={"columnDefaults": {"headerWordWrap": True,
                                              "minWidth": _MIN_COLUMN_PX}},
            css_classes=["atlas-table"], formatters=pn.bind(self._formatters, self.param.atlas))
        table.on_click(self._row_clicked)
        provenance = pn.pane.Markdown(pn.bind(provenance_markdown, self.param.atlas),
                                      css_classes=["atlas-provenance"], sizing_mode="stretch_width")
        return pn.Column(
            pn.Row(spinner, status, align="center"),
            alert,
            self.heading_pane("atlas-heading"),
            self.stale_box("atlas-stale", ["prompt", "edits", "running", "error"]),
            pn.Row(score, picked, sizing_mode="stretch_width"),
            pn.Row(refresh, induction, download, sizing_mode="stretch_width"),
            pn.Row(heat_pane, provenance, sizing_mode="stretch_width"),
            table,
            sizing_mode="stretch_width")

    @staticmethod
    def _formatters(atlas: xr.Dataset | None) -> dict[str, Any]:
        from bokeh.models.widgets.tables import NumberFormatter

        scores = list(atlas.data_vars) if atlas is not None else []
        return {"selected": {"type": "tickCross", "crossElement": False},
                **{name: NumberFormatter(format="0.0000") for name in scores}}


_WRAPPED_TITLES = """
.tabulator .tabulator-col .tabulator-col-title {
  white-space: normal !important; overflow-wrap: normal !important; word-break: normal !important;
  hyphens: none; text-overflow: clip !important;
}
"""
"""Column titles wrap on the spaces of `column_titles` only, never inside a word; columns are
at least `_MIN_COLUMN_PX` wide, so the longest word of a title fits."""

_MIN_COLUMN_PX = 112


def column_titles(atlas: xr.Dataset | None) -> dict[str, str]:
    """The table's column titles: score names with spaces for underscores, so they wrap."""
    names = list(atlas.data_vars) if atlas is not None else []
    return {name: name.replace("_", " ") for name in names}


serve(__name__, AtlasView, title=f"{theme.TITLE}: head atlas", intro="atlas")
