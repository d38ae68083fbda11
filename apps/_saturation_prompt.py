"""The saturation page's token view of the user's prompt: s_1..s_k of each of its tokens as a
position x rank heatmap, clean and (with workspace edits) edited, the moved cells
outlined, the selected positions' columns outlined dashed."""
from __future__ import annotations

import dataclasses
import html
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
from apps._page_provenance import result_heading
from apps._positions import column_boxes, position_caption, position_outlines, shown_positions
from apps._provenance import Provenance
from apps._result_cache import cached_note
from apps._saturation_corpus import _note
from apps._saturation_strip import _NEVER_COLOR
from apps._session import CancelToken
from explorer._checks import check_prompts
from explorer.analyses import saturation as sat
from explorer.interventions import Edit, edit_from_dict

__all__ = ["PROMPT_RANKS", "prompt_table", "changed_cells", "edited_title", "prompt_caption",
           "LABELLED_POSITIONS", "plot_prompt_saturation", "prompt_saturation", "PromptPart",
           "saturation_heading", "METHOD"]

hv.extension("bokeh", logo=False)


PROMPT_RANKS = 10
"""Ranks the prompt's saturation layers are computed for (the k slider shows up to them)."""


_TITLE_EDITS = 2  # workspace edits named in the edited heatmap's title (all in its caption)

METHOD = "saturation layers"  # the method of the token view's records (`Provenance.method`)


_PROMPT_TOOLS = ["save", "reset"]


def prompt_table(ds: xr.Dataset, k: int, decode: Any) -> pd.DataFrame:
    """One row per (position, rank) of a one-prompt `saturation_layers` result: the heatmap's
    input. Columns ``pos``, ``rank`` (1-based), ``input`` (the token at ``pos``), ``final``
    (the output's rank-j token there), ``s`` (its saturation layer; NaN: never), ``label``
    (the layer, or "never"), ``fg`` (a text colour readable on the cell)."""
    one = ds.isel(prompt=0)
    n = int(one.mask.values.sum())
    k = min(k, ds.sizes["rank"])
    s = one.sat_layer.values[:n, :k].astype(int)                          # [pos, k]
    final = one.final_token_id.values[:n, :k]
    labels = decode(final)
    inputs = theme.show_tokens(one.token.values[:n])
    vals = np.where(s < 0, np.nan, s).astype(float).ravel()
    top = max(1, ds.sizes["layer"] - 1)
    return pd.DataFrame({
        "pos": np.repeat(np.arange(n), k), "rank": np.tile(np.arange(1, k + 1), n),
        "input": np.repeat(np.array(inputs, dtype=object), k),
        "final": [labels[int(t)] for t in final.ravel()], "s": vals,
        "label": ["never" if v < 0 else str(v) for v in s.ravel()],
        "fg": theme.text_colors(vals, theme.CMAPS["magnitude"], 0.0, float(top))}).astype(
        {"input": object, "final": object, "label": object, "fg": object})


def changed_cells(clean: xr.Dataset | None, edited: xr.Dataset | None,
                  k: int) -> list[tuple[int, int]] | None:
    """(pos, rank) (rank 1-based) of every cell whose saturation layer differs between two
    one-prompt results of the same tokens; None when they cannot be compared."""
    if clean is None or edited is None:
        return None
    a, b = clean.isel(prompt=0), edited.isel(prompt=0)
    n = int(a.mask.values.sum())
    if n != int(b.mask.values.sum()) or not np.array_equal(a.token_id.values[:n],
                                                           b.token_id.values[:n]):
        return None
    k = min(k, clean.sizes["rank"], edited.sizes["rank"])
    moved = a.sat_layer.values[:n, :k] != b.sat_layer.values[:n, :k]
    return [(int(p), int(r) + 1) for p, r in zip(*np.nonzero(moved))]


def _final_moved(clean: xr.Dataset, edited: xr.Dataset, k: int) -> int:
    """Cells whose final rank-j token differs (same tokens assumed)."""
    n = int(clean.mask.values[0].sum())
    return int((clean.final_token_id.values[0, :n, :k]
                != edited.final_token_id.values[0, :n, :k]).sum())


def saturation_heading(prov: Provenance) -> str:
    """The line over the prompt's heatmaps: the shown token view's prompt, model, weights and
    workspace edits (``Saturation layers of 'The cat' (tiny-llama, trained weights), clean and
    with 1 workspace edit``)."""
    weights = dict(prov.request).get("weights", "trained")
    return result_heading("Saturation layers", prov, detail=f"{weights} weights")


def edited_title(labels: Sequence[str]) -> str:
    """The edited heatmap's title: ``edited: ablate L1.H0 (zero)`` (the caption lists all)."""
    shown = ", ".join(labels[:_TITLE_EDITS])
    if len(labels) > _TITLE_EDITS:
        shown += f" +{len(labels) - _TITLE_EDITS} more"
    return f"edited: {shown}"


def prompt_caption(clean: xr.Dataset | None, edited: xr.Dataset | None, k: int) -> str:
    """Under the edited heatmap: every workspace edit, and how many cells moved."""
    if clean is None or edited is None:
        return ""
    labels = list(edited.attrs.get("workspace_edits", []))
    text = ("Edited run, same prompt, with " + "; then ".join(
        f"`{html.escape(t)}`" for t in labels) + ".")
    moved = changed_cells(clean, edited, k)
    if moved is not None:
        k = min(k, clean.sizes["rank"])
        cells = int(clean.mask.values[0].sum()) * k
        text += (f" The saturation layer differs from the clean run in {len(moved)} of {cells} "
                 f"cells (outlined); the final rank-j token itself in "
                 f"{_final_moved(clean, edited, k)}.")
    return text


LABELLED_POSITIONS = 24
"""Up to this many prompt tokens the prompt heatmap writes each cell's layer in it; past it
the cells are narrower than a two-digit label (the plot's frame is ~430 px wide in a 1280 px
window: 18 px a cell at 24 tokens), which ran together, so the colour and the hover carry it."""


def plot_prompt_saturation(ds: xr.Dataset | None, k: int, decode: Any, *, title: str,
                           changed: Sequence[tuple[int, int]] = (),
                           positions: Sequence[int] = ()) -> hv.Element:
    """Position x rank heatmap of a one-prompt result: cell (pos, j) is the layer from which
    the output's rank-j token at ``pos`` holds rank j (s_j; grey: never); ``changed`` cells
    are outlined, the selected ``positions``' columns outlined dashed. Hover names the input
    token and the final rank-j token. Cells carry their layer as text up to
    `LABELLED_POSITIONS` tokens."""
    if ds is None:
        return theme.placeholder("Computing the prompt's saturation layers…", height=200)
    table = prompt_table(ds, k, decode)
    n_layers = ds.sizes["layer"]
    n = int(table["pos"].max()) + 1 if len(table) else 0
    k = int(table["rank"].max()) if len(table) else k
    ticks = [(i, t) for i, t in enumerate(theme.show_tokens(ds.token.values[0, :n]))]
    sizes = theme.SIZES
    height = sizes["cell_height"] * k + 150
    heat = hv.HeatMap(table, ["pos", "rank"], ["s", "input", "final", "label"]).opts(
        cmap=theme.CMAPS["magnitude"], clim=(0, max(1, n_layers - 1)), colorbar=True,
        clabel="saturation layer", clipping_colors={"NaN": _NEVER_COLOR},
        xticks=ticks, yticks=list(range(1, k + 1)), invert_yaxis=True,
        xrotation=45 if n > 8 else 0, xlabel="position (input token)", ylabel="rank (1 = top)",
        title=title, tools=["hover"], line_color="white", line_width=0.5,
        hover_tooltips=[("input", "@pos: @input"), ("rank", "@rank"), ("final token", "@final"),
                        ("saturation layer", "@label")],
        responsive=True, height=height, toolbar="above", default_tools=_PROMPT_TOOLS,
        active_tools=[], padding=0, fontsize={"title": f"{sizes['title_font_pt']}pt"})
    labels = hv.Labels(table, ["pos", "rank"], ["label", "fg"]).opts(
        text_color="fg", text_font_size=f"{sizes['label_font_pt']}pt",
        default_tools=_PROMPT_TOOLS)
    plot = heat * labels if n <= LABELLED_POSITIONS else heat
    if changed:
        plot *= hv.Rectangles([(p - 0.5, r - 0.5, p + 0.5, r + 0.5) for p, r in changed]).opts(
            fill_alpha=0, line_color=theme.ACCENT, line_width=3, default_tools=_PROMPT_TOOLS)
    shown = shown_positions(positions, n)
    if shown:
        plot *= position_outlines(column_boxes(shown, 0.5, k + 0.5)).opts(
            default_tools=_PROMPT_TOOLS)
    # no active scroll zoom: the wheel keeps scrolling the page
    return plot.opts(responsive=True, height=height, active_tools=[],
                     xlim=(-0.5, n - 0.5), ylim=(0.5, k + 0.5))


def prompt_saturation(model: explorer.Model, prompt: str, *,
                      edits: Sequence[Edit] = ()) -> xr.Dataset:
    """The page's token view of one prompt: `saturation_layers` over `PROMPT_RANKS` ranks
    (no probe sample), with ``edits`` applied in the trace."""
    k = min(PROMPT_RANKS, model.vocab_size)
    return sat.saturation_layers(model, [prompt], k=k, rank_cap=min(model.vocab_size, max(50, k)),
                                 sample_positions=0,
                                 edits=list(edits), progress=False)


class PromptPart:
    """The prompt's token view of `SaturationView`, clean and edited."""

    def prompt_record(self, prompt: str, edits: Sequence[Edit], weights: str) -> Provenance:
        """The record of the prompt's token view of ``prompt`` with ``edits``."""
        return self.record(METHOD, prompt, edits, request={"weights": weights})

    def requested_provenance(self) -> Provenance:
        """What the token view would compute now: the workspace's (else the page's) prompt
        and edits, the page's weights."""
        return self.prompt_record(*self.current_inputs(), self.weights)

    def heading(self, prov: Provenance) -> str:
        return saturation_heading(prov)

    def shown_prompt_inputs(self) -> tuple[str, list[Edit]]:
        """The prompt and edits of the shown token view (its record, the edited run's
        attrs); before one, the page's."""
        shown = self.shown_record
        if shown is None:
            return self.prompt, list(self.edits)
        edited = self.prompt_edited
        edits = [] if edited is None else [edit_from_dict(d)
                                           for d in edited.attrs.get("edits", [])]
        return shown.prompts[0], edits

    def recomputing(self) -> bool:
        """Whether the prompt's token view is being recomputed (the corpus runs apart)."""
        return self._runners["prompt"].running

    def _request_prompt(self, *events: Any) -> None:
        """Saturation layers of the prompt, clean and (with workspace edits) edited: from
        the result cache at once when it holds them (`apps._result_cache`), else computed
        and stored there."""
        prompt, weights, edits = self.prompt, self.weights, list(self.edits)
        record = self.prompt_record(prompt, edits, weights)
        parts, hit = self.stored_result("prompt", record,
                                        {"edits": [e.to_dict() for e in edits]})
        if hit is not None and "clean" in hit.datasets:
            self.cancel("prompt")
            self._show_prompt((record, hit.datasets["clean"], hit.datasets.get("edited")),
                              cached_at=hit.computed_at)
            return

        def job(token: CancelToken) -> tuple[Provenance, xr.Dataset, xr.Dataset | None]:
            check_prompts(prompt)
            model = self.current_model()
            clean = self.cached("prompt clean", (weights, prompt),
                                lambda: prompt_saturation(model, prompt), limit=8)
            token.check()
            edited = None
            if edits:
                from explorer.workspace import edit_label

                edited = prompt_saturation(model, prompt, edits=edits)
                edited.attrs["workspace_edits"] = [edit_label(e) for e in edits]
            shown = self.stamped(record)
            self.store_result(parts, {"clean": clean, "edited": edited},
                              computed_at=shown.computed_at)
            return shown, clean, edited

        self.submit("prompt", job)

    def _show_prompt(self, out: tuple[Provenance, xr.Dataset, xr.Dataset | None], *,
                     cached_at: str = "") -> None:
        """Show a token view: its stamped record, clean and edited results (``cached_at``:
        read from the result cache, computed then)."""
        shown, clean, edited = out
        if cached_at:
            shown = dataclasses.replace(shown, computed_at=cached_at)
        self.param.update(prompt_result=clean, prompt_edited=edited, shown_record=shown,
                          result_note=cached_note(cached_at) if cached_at else "")

    def prompt_tokens(self) -> list[str]:
        """The prompt's tokens as shown (those of the last prompt result; [] before one)."""
        ds = self.prompt_result
        if ds is None:
            return []
        n = int(ds.mask.values[0].sum())
        return theme.show_tokens(ds.token.values[0, :n])

    def toggle_position(self, pos: int) -> None:
        """Select token position ``pos`` of the prompt, or deselect it (a click on it)."""
        self._position_links.toggle(pos)

    @param.depends("prompt_result", "selected_positions")
    def _position_caption(self):
        return _note(position_caption(self.selected_positions, self.prompt_tokens()))

    @param.depends("prompt_result", "prompt_edited", "k", "selected_positions")
    def _prompt_view(self):
        """The prompt's s_1..s_k heatmap; with edits, the edited one below, titled with them."""
        clean, edited = self.prompt_result, self.prompt_edited
        k = self.k
        if edited is None:
            title = f"Saturation layers of the prompt's tokens, top-{k}"
        else:
            title = f"clean: no workspace edits · top-{k}"
        # linked_axes=False: the rank axis is not the detail table's (Panel links the axes
        # of every HoloViews pane in a page that share a dimension name)
        positions = list(self.selected_positions)
        panes = [pn.pane.HoloViews(plot_prompt_saturation(clean, k, self.decode, title=title,
                                                          positions=positions),
                                   sizing_mode="stretch_width", linked_axes=False,
                                   css_classes=["sat-prompt-clean"])]
        if edited is not None:
            moved = changed_cells(clean, edited, k) or []
            labels = list(edited.attrs.get("workspace_edits", []))
            marker = ",".join(f"{p}:{r}" for p, r in moved)
            panes += [
                pn.pane.HoloViews(plot_prompt_saturation(edited, k, self.decode,
                                                         title=edited_title(labels),
                                                         changed=moved, positions=positions),
                                  sizing_mode="stretch_width", linked_axes=False,
                                  css_classes=["sat-prompt-edited"]),
                pn.pane.HTML(f'<span data-sat-prompt-moved="{marker}"></span>', height=0,
                             margin=0),
                _note(prompt_caption(clean, edited, k))]
        return pn.Column(*panes, sizing_mode="stretch_width")
