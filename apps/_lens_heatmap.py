"""The logit lens page's heatmap as pure functions: the plot of a lens result (clean, edited
or a preview), its titles and captions, the cells an edit moved, and the column updates
that redraw a drawn heatmap in place (`heatmap_updates`, `_update_source`)."""
from __future__ import annotations

import functools
import hashlib
import html
from collections.abc import Sequence
from typing import Any

import holoviews as hv
import numpy as np
import xarray as xr

from apps import theme
from apps._lens_tables import _LABEL_CHARS, _text_colors, lens_table, steering_summary
from apps._positions import column_boxes, position_outlines, shown_positions
from apps._view import STATIC_TOOLS

__all__ = ["is_preview", "lens_title", "edited_title", "extra_labels", "edited_caption",
           "answer_line",
           "moved_cells", "plot_lens_heatmap", "plot_shape", "lens_tokens", "plot_positions",
           "heatmap_columns", "heatmap_updates", "lens_digest", "details_html"]

hv.extension("bokeh", logo=False)


def is_preview(ds: xr.Dataset | None) -> bool:
    """Whether a lens result is a preview (`explorer.logit_lens` ``preview_vocab``)."""
    return ds is not None and ds.attrs.get("params", {}).get("readout") == "preview"


def lens_title(ds: xr.Dataset, *, clean: bool = False) -> str:
    """The heatmap's title; a preview's says so. ``clean``: the page also shows an edited
    lens, and this one (without the workspace edits) is titled "clean"."""
    what = steering_summary(ds.attrs.get("edits", []))
    if is_preview(ds):
        return f"PREVIEW (exact on release) · {'clean · ' if clean else ''}{what}"
    if clean:
        return f"clean · {what}" if what != "unedited" else "clean: no workspace edits"
    return f"Logit lens: top-1 token · {what}"


_TITLE_EDITS = 2  # workspace edits named in the edited heatmap's title (all in its caption)


def edited_title(ds: xr.Dataset, labels: list[str]) -> str:
    """The edited heatmap's title: ``edited: ablate L1.H0 (zero)`` (the caption says more)."""
    shown = ", ".join(labels[:_TITLE_EDITS])
    if len(labels) > _TITLE_EDITS:
        shown += f" +{len(labels) - _TITLE_EDITS} more"
    what = steering_summary(ds.attrs.get("edits", []))
    return f"edited: {shown}" + ("" if what == "unedited" else " + the steering")


def extra_labels(ds: xr.Dataset | None) -> list[str]:
    """The workspace edits an edited lens result carries (their one-line labels)."""
    return list(ds.attrs.get("workspace_edits", [])) if ds is not None else []


def edited_caption(clean: xr.Dataset | None, edited: xr.Dataset | None, *, prompt: int = 0) -> str:
    """Under the edited heatmap: every workspace edit, and how many cells' top-1 token moved."""
    if edited is None:
        return ""
    labels = extra_labels(edited)
    steering = steering_summary(edited.attrs.get("edits", []))
    text = ("Edited run, same prompt" + ("" if steering == "unedited" else f", {steering}")
            + ", with " + "; then ".join(f"`{html.escape(t)}`" for t in labels) + ".")
    moved = moved_cells(clean, edited, prompt=prompt)
    if moved is not None:
        n = int(edited.isel(prompt=prompt).mask.sum()) * edited.sizes["layer"]
        text += (f" The top-1 token differs from the clean lens in {len(moved)} of {n} cells "
                 "(outlined).")
    return text


def _percent(p: float) -> str:
    return f"{100 * p:.1f} %" if p >= 0.001 else f"{100 * p:.2g} %"


def answer_line(edited: xr.Dataset | None) -> str:
    """Above the edited heatmap: the clean run's answer (its top-1 after the prompt's last
    token) and its probability clean and edited, read from the edited result's ``answer``
    attribute (`apps._lens_tables.answer_probabilities`); '' without one."""
    answer = edited.attrs.get("answer") if edited is not None else None
    if not answer:
        return ""
    def quoted(token: str) -> str:
        return f"<code>{html.escape(repr(token))}</code>"
    text = (f"Answer {quoted(answer['answer'])} (the clean run's top-1 after the last token, "
            f"position {answer['position']}): <b>{_percent(answer['clean_prob'])}</b> clean → "
            f"<b>{_percent(answer['edited_prob'])}</b> edited")
    if answer["edited_top_id"] != answer["answer_id"]:
        text += (f"; the edited run's top-1 is {quoted(answer['edited_top'])} "
                 f"({_percent(answer['edited_top_prob'])})")
    return text + "."


def moved_cells(clean: xr.Dataset | None, edited: xr.Dataset | None, *,
                prompt: int = 0) -> list[tuple[int, int]] | None:
    """(pos, layer) of every cell whose top-1 token differs between two lens results of the
    same tokens and layers; None when they cannot be compared."""
    if clean is None or edited is None or plot_shape(clean, prompt=prompt)[:2] != plot_shape(
            edited, prompt=prompt)[:2]:
        return None
    a, b = clean.isel(prompt=prompt), edited.isel(prompt=prompt)
    real = a.mask.values
    moved = a.top_token_id.values[real, :, 0] != b.top_token_id.values[real, :, 0]
    pos, layers = a.pos.values[real], a.layer.values
    return [(int(pos[i]), int(layers[j])) for i, j in zip(*np.nonzero(moved))]


def plot_lens_heatmap(ds: xr.Dataset | None, *, prompt: int = 0, title: str | None = None,
                      steer_line: int | None = None) -> hv.Overlay | hv.Element:
    """Layer x position heatmap of the lens's top-1 probability, the top-1 token in each cell.

    Hover lists the top-k tokens with ids and probabilities. ``None`` gives a placeholder.
    A preview's title starts with "PREVIEW". Each steer edit's layer gets a dashed line at
    its lower edge; with ``steer_line`` (the page's steering layer) one line is drawn there
    instead, hidden while ``ds`` carries no steer edit, so a steered and an unsteered
    result draw the same figure (a slider move from 0 updates it in place).
    """
    if ds is None:
        return hv.Text(0, 0, "Computing the logit lens…").opts(
            xaxis=None, yaxis=None, toolbar=None, responsive=True,
            height=theme.SIZES["plot_min_height"])
    table = lens_table(ds, prompt=prompt)
    one = ds.isel(prompt=prompt)
    real = one.mask.values
    ticks = list(zip(one.pos.values[real].tolist(), theme.show_tokens(one.token.values[real])))
    layers = one.layer.values.tolist()
    k = one.sizes["rank"]
    n_pos = len(ticks)
    hover = [("input", "@pos: @input"), ("layer", "@layer")] + [
        (f"#{r + 1}", f"@tok{r}  (id @id{r})  @p{r}{{0.0%}}") for r in range(k)]
    sizes = theme.SIZES
    height = max(sizes["plot_min_height"], sizes["cell_height"] * len(layers) + 140)
    edits = ds.attrs.get("edits", [])
    title = lens_title(ds) if title is None else title
    vdims = ["top_prob", "input"] + [c for r in range(k) for c in (f"tok{r}", f"id{r}", f"p{r}")]
    heat = hv.HeatMap(table, ["pos", "layer"], vdims).opts(
        # the colour bar left of the layers: a wide prompt's heatmap scrolls sideways in its
        # box, and the bar stays in view at the start of it
        cmap=theme.PROBABILITY_CMAP, clim=(0.0, 1.0), colorbar=True, colorbar_position="left",
        clabel="top-1 probability", xticks=ticks, yticks=layers,
        xrotation=45 if n_pos > 8 else 0, xlabel="position (input token)", ylabel="layer",
        title=title, tools=["hover"], hover_tooltips=hover, line_color="white", line_width=0.5,
        responsive=True, height=height, min_width=max(sizes["plot_min_width"], 56 * n_pos),
        fontsize={"title": f"{sizes['title_font_pt']}pt", "labels": f"{sizes['axis_font_pt']}pt",
                  "xticks": f"{sizes['axis_font_pt']}pt", "yticks": f"{sizes['label_font_pt']}pt"},
        # the toolbar on the right: above, it sat over the start of the title
        toolbar="right", default_tools=STATIC_TOOLS, active_tools=[], padding=0,
    )
    labels = hv.Labels(table, ["pos", "layer"], ["label", "text_color"]).opts(
        text_color="text_color", text_font_size=f"{sizes['label_font_pt']}pt",
        default_tools=STATIC_TOOLS)
    overlay = heat * labels
    steers = [e["layer"] for e in edits if e.get("kind") == "steer"]
    line = {"color": theme.ACCENT, "line_width": 3, "line_dash": "dashed"}
    if steer_line is not None:
        overlay *= hv.HLine(steer_line - 0.5).opts(visible=bool(steers), **line)
        steers = [layer for layer in steers if layer != steer_line]
    for layer in steers:  # the steered layer's lower edge: rows from here up carry the edit
        overlay *= hv.HLine(layer - 0.5).opts(**line)
    # no active scroll zoom: the wheel keeps scrolling the page
    return overlay.opts(responsive=True, height=height, active_tools=[])


def plot_shape(ds: xr.Dataset | None, *, prompt: int = 0) -> tuple | None:
    """What fixes the heatmap's axes and glyphs: tokens, layers, k and the steering line.
    Results of the same shape are drawn by replacing the plot's data in place."""
    if ds is None:
        return None
    one = ds.isel(prompt=prompt)
    steer = tuple(e["layer"] for e in ds.attrs.get("edits", []) if e.get("kind") == "steer")
    return (tuple(one.token.values[one.mask.values].tolist()), tuple(one.layer.values.tolist()),
            int(one.sizes["rank"]), steer)


def lens_tokens(ds: xr.Dataset | None, *, prompt: int = 0) -> list[str]:
    """The prompt's real tokens as the heatmap's x axis shows them ([] without a result)."""
    if ds is None:
        return []
    one = ds.isel(prompt=prompt)
    return theme.show_tokens(one.token.values[one.mask.values])


def plot_positions(ds: xr.Dataset | None, positions: Sequence[int], *,
                   prompt: int = 0) -> hv.Rectangles | None:
    """Dashed outlines of the selected token positions' columns (every layer) on
    `plot_lens_heatmap`; None when none of them is in the prompt. Position ``P<i>`` is the
    prompt's i-th real token (its x is that token's ``pos``)."""
    if ds is None:
        return None
    one = ds.isel(prompt=prompt)
    xs = one.pos.values[one.mask.values]
    shown = shown_positions(positions, len(xs))
    if not shown:
        return None
    layers = one.layer.values
    return position_outlines(column_boxes([int(xs[p]) for p in shown],
                                          float(layers.min()) - 0.5, float(layers.max()) + 0.5))


def _as_text(values: np.ndarray) -> list[str]:
    """Numbers as HoloViews' hover columns show them (``%.5g``; ids as integers)."""
    values = np.asarray(values)
    if values.dtype.kind in "iu":
        return values.astype(str).tolist()
    return np.char.mod("%.5g", values.astype(float)).tolist()


def heatmap_columns(ds: xr.Dataset, *, prompt: int = 0) -> dict[str, dict[str, Any]]:
    """The ``ColumnDataSource.data`` HoloViews gives the heatmap (``"heat"``) and its labels
    (``"labels"``) for ``ds``: what a same-shape update writes into the drawn plot."""
    t = lens_table(ds, prompt=prompt)
    n = len(t)
    heat: dict[str, Any] = {"pos": t["pos"].to_numpy(), "layer": t["layer"].to_numpy(),
                            "zvalues": t["top_prob"].to_numpy(), "width": np.ones(n),
                            "height": np.ones(n), "top_prob": _as_text(t["top_prob"].to_numpy()),
                            "input": list(t["input"])}
    for r in range(ds.sizes["rank"]):
        heat[f"tok{r}"] = list(t[f"tok{r}"])
        heat[f"id{r}"] = _as_text(t[f"id{r}"].to_numpy())
        heat[f"p{r}"] = _as_text(t[f"p{r}"].to_numpy())
    labels = {"pos": t["pos"].to_numpy(), "layer": t["layer"].to_numpy(),
              "label": list(t["label"]), "text_color": list(t["text_color"])}
    return {"heat": heat, "labels": labels}


_SHAPE_COLUMNS = {"heat": ("pos", "layer", "width", "height", "input"),
                  "labels": ("pos", "layer")}
"""The heatmap's data columns fixed by `plot_shape` (the same for every result of a shape)."""


@functools.lru_cache(maxsize=65536)
def _shown_token(token: str) -> tuple[str, str]:
    """A token as shown in the hover (`theme.show_token`) and as a cell's short label."""
    s = theme.show_token(token)
    return s, (s if len(s) <= _LABEL_CHARS else s[:_LABEL_CHARS - 1] + "…")


def heatmap_updates(ds: xr.Dataset, *, prompt: int = 0) -> dict[str, dict[str, Any]]:
    """The columns of `heatmap_columns` that change between results of one `plot_shape`
    (top-1 probability, tokens, ids, probabilities, labels and their colours), built
    straight from the arrays: what a slider move sends to the drawn plot."""
    one = ds.isel(prompt=prompt)
    real = one.mask.values                                               # [pos]
    k = one.sizes["rank"]
    probs = one.top_prob.values[real].reshape(-1, k)                     # [pos*layer, rank]
    ids = one.top_token_id.values[real].reshape(-1, k)
    toks = one.top_token.values[real].reshape(-1, k)
    shown = [[_shown_token(t) for t in row] for row in toks.tolist()]
    top = probs[:, 0].astype(float)
    heat: dict[str, Any] = {"zvalues": top, "top_prob": _as_text(top)}
    for r in range(k):
        heat[f"tok{r}"] = [row[r][0] for row in shown]
        heat[f"id{r}"] = _as_text(ids[:, r])
        heat[f"p{r}"] = _as_text(probs[:, r].astype(float))
    labels = {"label": [row[0][1] for row in shown], "text_color": list(_text_colors(top))}
    return {"heat": heat, "labels": labels}


_PATCH_SHARE = 0.5
"""A column whose cells changed in at most this share is patched cell by cell."""


def _update_source(source: Any, columns: dict[str, Any]) -> None:
    """Write ``columns`` into a drawn ``source``, sending only what changed: columns equal
    to the drawn ones are skipped, a column with few changed cells (a drag: the layers
    before the edit, and most tokens, stay) goes as a patch of those cells, the others
    whole, in one change event each."""
    whole: dict[str, Any] = {}
    patches: dict[str, list[tuple[int, Any]]] = {}
    for name, new in columns.items():
        old = source.data.get(name)
        if old is None or len(old) != len(new):
            whole[name] = new
            continue
        changed = np.flatnonzero(np.asarray(old, dtype=object) != np.asarray(new, dtype=object))
        if len(changed) == 0:
            continue
        if len(changed) <= _PATCH_SHARE * len(new):
            values = np.asarray(new, dtype=object)[changed].tolist()   # plain Python values
            patches[name] = list(zip(changed.tolist(), values))
        else:
            whole[name] = new
    if whole:
        source.data.update(whole)
    if patches:
        source.patch(patches)


def lens_digest(ds: xr.Dataset) -> str:
    """A short fingerprint of a lens result (changes whenever the displayed cells do)."""
    h = hashlib.sha1(np.ascontiguousarray(ds.top_token_id.values).tobytes())
    h.update(np.round(np.nan_to_num(ds.top_prob.values), 4).tobytes())
    return h.hexdigest()[:12]


def details_html(ds: xr.Dataset | None, *, prompt: int = 0) -> str:
    """The model's prediction after the last input token (final layer, top-k) as a table."""
    if ds is None:
        return "<div class='lens-details'>No result yet.</div>"
    one = ds.isel(prompt=prompt)
    last = int(np.flatnonzero(one.mask.values)[-1])
    cell = one.isel(pos=last, layer=-1)
    rows = "".join(
        f"<tr><td>{r + 1}</td><td><code>{html.escape(theme.show_token(str(t)))}</code></td>"
        f"<td>{int(i)}</td><td>{p:.1%}</td></tr>"
        for r, (t, i, p) in enumerate(zip(cell.top_token.values, cell.top_token_id.values,
                                          cell.top_prob.values)))
    prompt_text = ds.attrs.get("params", {}).get("prompts", [""])[prompt]
    inputs = theme.show_tokens(one.token.values[one.mask.values])
    tokens = " ".join(f"<code>{html.escape(t)}</code>" for t in inputs)
    return (
        f"<div class='lens-details' data-lens-digest='{lens_digest(ds)}' "
        f"data-prompt='{html.escape(prompt_text, quote=True)}'>"
        f"<b>Next-token prediction</b> after <code>{html.escape(inputs[last])}</code> "
        f"(final layer, {html.escape(steering_summary(ds.attrs.get('edits', [])))})"
        "<table class='lens-topk'><thead><tr><th>rank</th><th>token</th><th>id</th>"
        f"<th>probability</th></tr></thead><tbody>{rows}</tbody></table>"
        f"<div class='lens-tokens'>Input tokens: {tokens}</div></div>"
    )


_DETAILS_CSS = """
table.lens-topk { border-collapse: collapse; margin: 6px 0; font-size: 13px; }
table.lens-topk th, table.lens-topk td { padding: 2px 10px; text-align: left;
  border-bottom: 1px solid #ddd; }
.lens-tokens code, table.lens-topk code { background: #f3f3f3; padding: 0 3px; }
"""
