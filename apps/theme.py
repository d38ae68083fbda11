"""The one theme of every page: template, colour maps, sizes, token display, notifications.

Every page is a Panel ``FastListTemplate`` built by `page`; every plot takes its colours
from `CMAPS` by the quantity it shows, so the same quantity has the same colour on every
page: probabilities and other magnitudes on a perceptually uniform sequential map, signed
scores on a diverging map centred on 0, categories on a colour-blind safe palette
(colorcet, Kovesi 2015, "Good colour maps: how to design them", arXiv:1509.03700).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import colorcet as cc
import panel as pn

__all__ = [
    "TITLE",
    "ACCENT",
    "CMAPS",
    "PROBABILITY_CMAP",
    "MAGNITUDE_CMAP",
    "SIGNED_CMAP",
    "CATEGORICAL",
    "SIZES",
    "Design",
    "enable_extension",
    "bokeh_theme",
    "no_overlap_policy",
    "NestedLayoutFix",
    "page",
    "show_token",
    "show_tokens",
    "text_colors",
    "format_bytes",
    "notify",
]

log = logging.getLogger(__name__)

TITLE = "Explorer"

# -- colour ---------------------------------------------------------------------------
# Sequential, light (low) to dark (high): an empty cell reads as "nothing there".
PROBABILITY_CMAP: list[str] = list(cc.palette["fire"][::-1])
MAGNITUDE_CMAP: list[str] = list(cc.palette["bmy"])
# Diverging, centred on 0: blue negative, white 0, red positive. Plots set symmetric limits.
SIGNED_CMAP: list[str] = list(cc.palette["coolwarm"])
# Categorical, colour-blind safe (glasbey extension of matplotlib's category10).
CATEGORICAL: list[str] = list(cc.palette["glasbey_category10"])

CMAPS: dict[str, list[str]] = {
    "probability": PROBABILITY_CMAP,  # top-token probability, attention weight
    "magnitude": MAGNITUDE_CMAP,      # norms, scores >= 0
    "signed": SIGNED_CMAP,            # contributions, effects, logit differences
    "categorical": CATEGORICAL,       # heads, layers, classes
}

ACCENT = CATEGORICAL[0]

# -- sizes (pixels) -------------------------------------------------------------------
SIZES: dict[str, int] = {
    "sidebar_width": 320,
    "controls_width": 300,
    "cell_height": 22,       # one heatmap row (a layer)
    "cell_min_width": 56,    # one heatmap column (a position)
    "plot_min_height": 320,
    "plot_min_width": 480,
    "label_font_pt": 8,
    "axis_font_pt": 10,
    "title_font_pt": 12,
    "spinner": 28,
}

# -- tokens ---------------------------------------------------------------------------
_VISIBLE = str.maketrans({" ": "·", "\n": "↵", "\t": "⇥", "\r": "␍", "\u00a0": "⍽"})


def show_token(token: str) -> str:
    """A token as the model sees it, with spaces ('·'), newlines ('↵'), tabs ('⇥') visible.

    Other control characters read as ``\\xNN``; the empty string reads as '∅'.

    >>> show_token(" Paris"), show_token("\\n\\n"), show_token("")
    ('·Paris', '↵↵', '∅')
    """
    if token == "":
        return "∅"
    out = str(token).translate(_VISIBLE)
    if any(ord(c) < 32 or ord(c) == 127 for c in out):
        out = "".join(f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c for c in out)
    return out


def show_tokens(tokens: Iterable[str]) -> list[str]:
    """`show_token` of each token."""
    return [show_token(t) for t in tokens]


def _luminance(hex_color: str) -> float:
    """Relative luminance (WCAG 2) of a '#rrggbb' colour."""
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def text_colors(values: Sequence[float], cmap: Sequence[str], low: float = 0.0,
                high: float = 1.0) -> list[str]:
    """Black or white per value: whichever reads better on the value's cell colour."""
    out = []
    n = len(cmap)
    span = (high - low) or 1.0
    for v in values:
        if v != v:  # NaN: an empty (white) cell
            out.append("black")
            continue
        i = min(n - 1, max(0, int((float(v) - low) / span * (n - 1))))
        out.append("black" if _luminance(cmap[i]) > 0.18 else "white")
    return out


def format_bytes(n: int) -> str:
    """'1.5 MB' style size."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"  # pragma: no cover


# -- page -----------------------------------------------------------------------------

# The labels of one axis, in any tick order: sorted along the axis (by their boxes on the
# screen), the first kept, then each that starts at least `min_distance` px after the last kept.
# Bokeh's own NoOverlap walks the ticks in the order given and measures a signed distance, so
# ticks listed high to low (a heatmap's layers top-down) all but the first hid.
_NO_OVERLAP_JS = """
const ids = [...indices]
if (ids.length < 2)
  return ids
const spread = (values) => Math.max(...values) - Math.min(...values)
const along_x = spread(ids.map((i) => bboxes[i].left + bboxes[i].right)) >=
                spread(ids.map((i) => bboxes[i].top + bboxes[i].bottom))
const lo = along_x ? (i) => bboxes[i].left : (i) => bboxes[i].top
const hi = along_x ? (i) => bboxes[i].right : (i) => bboxes[i].bottom
const first = ids[0]
ids.sort((a, b) => lo(a) - lo(b))
if (ids[ids.length - 1] === first)
  ids.reverse()
const kept = [ids[0]]
for (const i of ids.slice(1)) {
  const last = kept[kept.length - 1]
  if (Math.max(lo(i) - hi(last), lo(last) - hi(i)) >= min_distance)
    kept.push(i)
}
return kept
"""


def no_overlap_policy() -> Any:
    """A fresh tick-label policy: labels that would collide are hidden, whatever the tick order.

    A function, not a model: Bokeh calls a themed default that is a function once per axis,
    so every axis (in every document) gets its own policy model.
    """
    from bokeh.models import CustomLabelingPolicy

    return CustomLabelingPolicy(code=_NO_OVERLAP_JS, args={"min_distance": 5},
                                tags=["explorer-no-overlap"])


def with_tick_label_policy(bokeh_json: dict[str, Any]) -> dict[str, Any]:
    """A Bokeh theme's JSON with every axis (numeric, log, categorical) on `no_overlap_policy`.

    The theme is the document's, so it reaches every plot of every page, whatever
    ``hooks`` or options a page sets; a page that must show every label of an axis sets
    the axis' own ``major_label_policy`` (or rotates the labels, which the policy keeps when they fit).
    """
    attrs = dict(bokeh_json.get("attrs", {}))
    # Keyed by the two concrete axis families (linear, log, datetime are ContinuousAxis),
    # not "Axis": HoloViews copies the theme's "Axis" entries onto each axis as values.
    for name in _AXIS_FAMILIES:
        attrs[name] = {**attrs.get(name, {}), "major_label_policy": no_overlap_policy}
    return {**bokeh_json, "attrs": attrs}


_AXIS_FAMILIES = ("ContinuousAxis", "CategoricalAxis")


def bokeh_theme(style: Any = None) -> Any:
    """The Bokeh theme of every plot: the Fast design's, with non-colliding tick labels."""
    from bokeh.themes import Theme

    style = style if style is not None else pn.theme.fast.DEFAULT_STYLE
    return Theme(json=with_tick_label_policy(style.create_bokeh_theme()))


class _FastDefaultTheme(pn.theme.fast.FastDefaultTheme):
    @property
    def bokeh_theme(self) -> Any:
        return bokeh_theme(self.style)


class _FastDarkTheme(pn.theme.fast.FastDarkTheme):
    @property
    def bokeh_theme(self) -> Any:
        return bokeh_theme(self.style)


class Fast(pn.theme.Fast):
    """Panel's Fast design without its web font, so pages load nothing from outside the server.

    Its Bokeh theme (`bokeh_theme`) gives every axis a no-overlap tick-label policy
    (`no_overlap_policy`).
    Named ``Fast`` on purpose: Panel finds a design's bundled files under its class name.
    """

    _resources = {key: value for key, value in pn.theme.Fast._resources.items() if key != "font"}
    _themes = {"default": _FastDefaultTheme, "dark": _FastDarkTheme}


Design = Fast


FONT = "system-ui, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"


def font_sizes() -> dict[str, str]:
    """HoloViews ``fontsize`` option from `SIZES`: the same text sizes on every plot."""
    return {"title": f"{SIZES['title_font_pt']}pt", "labels": f"{SIZES['axis_font_pt']}pt",
            "xticks": f"{SIZES['label_font_pt']}pt", "yticks": f"{SIZES['label_font_pt']}pt"}


PLOT_TOOLS = ["save", "pan", "wheel_zoom", "box_zoom", "reset"]
"""The toolbar of the pages' zoomable plots."""


def step_marker(steps: Sequence[float], step: float | None) -> Any:
    """A dashed vertical line at training step ``step`` (the first of ``steps`` when None)."""
    import holoviews as hv

    return hv.VLine(float(step if step is not None else steps[0])).opts(
        color="black", line_dash="dashed", line_width=1.2)


def placeholder(text: str, *, height: int = 320) -> Any:
    """A plot-sized text element shown where a plot will appear (no run yet, computing)."""
    import holoviews as hv

    return hv.Text(0.5, 0.5, text).opts(xaxis=None, yaxis=None, toolbar=None, height=height,
                                        responsive=True, xlim=(0, 1), ylim=(0, 1))


def enable_extension() -> None:
    """Load the Panel extensions every page needs, with notifications on.

    HoloViews' own Bokeh renderer (plots shown without Panel, ``hv.render``) gets the same
    Bokeh theme as the pages, so tick labels never collide there either.
    """
    import holoviews as hv

    pn.extension(notifications=True, design=Design, sizing_mode="stretch_width")
    hv.renderer("bokeh").theme = bokeh_theme()


class NestedLayoutFix(pn.custom.JSComponent):
    """An invisible element that makes BokehJS lay out plots nested at any depth.

    BokehJS (3.x) computes the canvas layout of a plot inside a CSS-laid-out container
    (a HoloViews ``Layout``'s GridPlot) only down to the grandchildren of a layout root:
    ``LayoutDOMView._propagate_layout`` visits one level and stops. A GridPlot one level
    deeper (a page in the gallery's main column, next to another plot) is never laid out:
    its figures keep a 0 x 0 frame and show a toolbar and scraps of axis text. On first
    render this replaces ``_propagate_layout`` with one that descends the whole tree (the
    same rule at every level), then lays out every root again. Idempotent per page.
    """

    _esm = """
export function render({ view }) {
  let proto = Object.getPrototypeOf(view)
  while (proto != null && !Object.prototype.hasOwnProperty.call(proto, "_propagate_layout"))
    proto = Object.getPrototypeOf(proto)
  if (proto != null && !proto._explorer_nested_layout) {
    proto._propagate_layout = function () {
      for (const child of this.layoutable_views) {
        if (child.layout == null)
          child._compute_layout()
        else
          child._propagate_layout()
      }
    }
    proto._explorer_nested_layout = true
    const index = window.Bokeh != null ? window.Bokeh.index : null
    if (index != null) {
      for (const root of index.all_views()) {
        if (root.is_layout_root && typeof root.invalidate_layout === "function")
          root.invalidate_layout()
      }
    }
  }
  const el = document.createElement("span")
  el.className = "nested-layout-fix"
  el.dataset.patched = String(proto != null)
  return el
}
"""

    def __init__(self, **params: Any):
        params.setdefault("width", 0)
        params.setdefault("height", 0)
        params.setdefault("sizing_mode", "fixed")
        params.setdefault("margin", 0)
        super().__init__(**params)


def page(main: Sequence[Any], *, sidebar: Sequence[Any] = (), title: str = TITLE,
         **params: Any) -> pn.template.FastListTemplate:
    """The template of every page: title bar, sidebar left, main area, busy indicator.

    The header carries `NestedLayoutFix`, so plots draw however deep a page nests them.
    """
    header = [*params.pop("header", []), NestedLayoutFix()]
    return pn.template.FastListTemplate(
        title=title,
        header=header,
        sidebar=list(sidebar),
        main=list(main),
        accent_base_color=ACCENT,
        header_background=ACCENT,
        sidebar_width=SIZES["sidebar_width"],
        main_layout=None,
        theme_toggle=False,
        design=Design,
        font=FONT,
        **params,
    )


def notify(kind: str, message: str, *, duration: int = 8000) -> None:
    """Show a notification in the page (``kind`` in error/warning/info/success) and log it.

    Outside a served page (tests, scripts) there is no notification area: the message is
    only logged.
    """
    getattr(log, "error" if kind == "error" else "info")(message)
    area = pn.state.notifications
    if area is not None:
        getattr(area, kind)(message, duration=duration)
