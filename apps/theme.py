"""The one theme of every page: template, colour maps, sizes, token display, notifications.

Every page is a Panel ``FastListTemplate`` built by `page`; every plot takes its colours
from `CMAPS` by the quantity it shows, so the same quantity has the same colour on every
page: probabilities and other magnitudes on a perceptually uniform sequential map, signed
scores on a diverging map centred on 0, categories on a colour-blind safe palette
(colorcet, Kovesi 2015, "Good colour maps: how to design them", arXiv:1509.03700).
"""
from __future__ import annotations

import logging
import re
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import colorcet as cc
import pandas as pd
import panel as pn
import param

# HoloViews aggregates a HeatMap's value columns with numpy's reshape, which pandas' pyarrow-backed
# strings (pandas 3's default str storage wherever pyarrow is installed) refuse; the pages'
# heatmaps carry token strings as hover columns. Python-backed strings keep them drawable.
pd.set_option("mode.string_storage", "python")

__all__ = [
    "TITLE",
    "BokehPane",
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
    "log_ticker",
    "NestedLayoutFix",
    "status_line",
    "page",
    "show_token",
    "show_tokens",
    "text_colors",
    "format_bytes",
    "notify",
    "CODE_CSS",
    "TOGGLE_CSS",
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


# The major ticks of a log axis: 1, 2 and 5 times each power of ten inside the visible range
# (Bokeh's LogTicker puts ticks only at powers of ten once the range spans two decades, so
# 0.05..3 shows just 0.1 and 1); the 1s alone when that gives more than `max_ticks`, every
# n-th power of ten when even those are too many, and 1..9 times the power when the range
# lies inside one decade and 1-2-5 leave fewer than two ticks. Computed in the browser from
# the range shown, so zooming keeps readable ticks.
_LOG_STEPS_JS = """
const steps = (low, high, mantissas, every) => {
  const out = []
  for (let e = Math.floor(Math.log10(low)); e <= Math.ceil(Math.log10(high)); e++) {
    if (every > 1 && ((e % every) + every) % every !== 0)
      continue
    for (const m of mantissas) {
      const t = Number((m * Math.pow(10, e)).toPrecision(12))
      if (t >= low * (1 - 1e-9) && t <= high * (1 + 1e-9))
        out.push(t)
    }
  }
  return out
}
"""

_LOG_MAJOR_JS = _LOG_STEPS_JS + """
const high = Math.max(cb_data.start, cb_data.end)
const low = Math.max(Math.min(cb_data.start, cb_data.end), high * 1e-15)
if (!(high > 0) || !isFinite(high))
  return []
let ticks = steps(low, high, [1, 2, 5], 1)
if (ticks.length > max_ticks) {
  ticks = steps(low, high, [1], 1)
  const every = Math.ceil(ticks.length / max_ticks)
  if (every > 1)
    ticks = steps(low, high, [1], every)
} else if (ticks.length < 2)
  ticks = steps(low, high, [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
return ticks
"""

_LOG_MINOR_JS = _LOG_STEPS_JS + """
const high = Math.max(cb_data.start, cb_data.end)
const low = Math.max(Math.min(cb_data.start, cb_data.end), high * 1e-15)
if (!(high > 0) || !isFinite(high) || high / low > 1e6)
  return []
return steps(low, high, [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
"""


def log_ticker(max_ticks: int = 8) -> Any:
    """A fresh ticker for a log axis: major ticks at 1, 2 and 5 times the powers of ten in
    the range shown (the 1s alone past ``max_ticks``), minor ticks at 1..9 times them.

    The theme (`bokeh_theme`) gives every `LogAxis` one, so a log axis spanning a decade or
    two reads 0.05, 0.1, 0.2, 0.5, 1, 2 instead of 0.1 and 1; a page that passes its own
    ``yticks``/``xticks`` keeps those.
    """
    from bokeh.models import CustomJSTicker

    return CustomJSTicker(major_code=_LOG_MAJOR_JS, minor_code=_LOG_MINOR_JS,
                          args={"max_ticks": int(max_ticks)}, tags=["explorer-log-ticks"])


def with_tick_label_policy(bokeh_json: dict[str, Any]) -> dict[str, Any]:
    """A Bokeh theme's JSON with every axis (numeric, log, categorical) on `no_overlap_policy`
    and every log axis on `log_ticker`.

    The theme is the document's, so it reaches every plot of every page, whatever
    ``hooks`` or options a page sets; a page that must show every label of an axis sets
    the axis' own ``major_label_policy`` (or rotates the labels, which the policy keeps when they fit).
    """
    attrs = dict(bokeh_json.get("attrs", {}))
    # Keyed by the two concrete axis families (linear, log, datetime are ContinuousAxis),
    # not "Axis": HoloViews copies the theme's "Axis" entries onto each axis as values.
    for name in _AXIS_FAMILIES:
        attrs[name] = {**attrs.get(name, {}), "major_label_policy": no_overlap_policy}
    attrs["LogAxis"] = {**attrs.get("LogAxis", {}), "ticker": log_ticker}
    return {**bokeh_json, "attrs": attrs}


_AXIS_FAMILIES = ("ContinuousAxis", "CategoricalAxis")


def bokeh_theme(style: Any = None) -> Any:
    """The Bokeh theme of every plot: the Fast design's, with non-colliding tick labels and
    1-2-5 ticks on log axes (`log_ticker`)."""
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


# The chosen button of a toggle group (RadioButtonGroup, CheckButtonGroup: eap / eap-ig,
# edges / nodes, the gallery's navigation) filled with the accent colour, white text: Fast's
# own active grey (237) was not told apart from the others' (242).
TOGGLE_CSS = f"""
.bk-btn-group .bk-btn.bk-active,
.bk-btn-group .bk-btn.bk-active:hover,
.bk-btn-group .bk-btn.bk-active:focus {{
  background-color: {ACCENT} !important; border-color: {ACCENT} !important;
  color: white !important; font-weight: 600;
}}
.bk-btn-group .bk-btn:not(.bk-active) {{ font-weight: normal; }}
"""


class Fast(pn.theme.Fast):
    """Panel's Fast design without its web font, so pages load nothing from outside the server.

    Its Bokeh theme (`bokeh_theme`) gives every axis a no-overlap tick-label policy
    (`no_overlap_policy`), and the chosen button of every toggle group is filled with the
    accent colour (`TOGGLE_CSS`).
    Named ``Fast`` on purpose: Panel finds a design's bundled files under its class name.
    """

    _resources = {key: value for key, value in pn.theme.Fast._resources.items() if key != "font"}
    modifiers = {
        pn.widgets.RadioButtonGroup: {"stylesheets": [pn.theme.Inherit, TOGGLE_CSS]},
        pn.widgets.CheckButtonGroup: {"stylesheets": [pn.theme.Inherit, TOGGLE_CSS]},
    }
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
    """A plot-sized text element shown where a plot will appear (no run yet, computing).

    The text is broken into lines of at most 56 characters: Bokeh draws a text glyph on one
    line, and a longer sentence ran past both edges of a half-width plot at 1280 px."""
    import textwrap

    import holoviews as hv

    return hv.Text(0.5, 0.5, textwrap.fill(text, 56)).opts(xaxis=None, yaxis=None, toolbar=None, height=height,
                                        responsive=True, xlim=(0, 1), ylim=(0, 1))


def enable_extension() -> None:
    """Load the Panel extensions every page needs, with notifications on.

    HoloViews' own Bokeh renderer (plots shown without Panel, ``hv.render``) gets the same
    Bokeh theme as the pages, so tick labels never collide there either.

    Plots draw on the 2D canvas, not WebGL (HoloViews' default): the pages' glyph counts
    (a few thousand cells at most) draw fast on canvas, while a WebGL plot is copied back
    into the canvas on every repaint, which costs ~50 ms a repaint of the lens heatmap in
    a browser without a GPU (headless chromium, software GL; 2026-12-04,
    `benchmarks/slider_drag.py`).
    """
    import holoviews as hv
    from holoviews.plotting.bokeh import BokehRenderer

    BokehRenderer.webgl = False
    hv.renderer("bokeh").webgl = False

    pn.extension(notifications=True, design=Design, sizing_mode="stretch_width")
    hv.renderer("bokeh").theme = bokeh_theme()
    if pn.config.exception_handler is None:
        pn.config.exception_handler = widget_error


_PARAM_BOUNDS = re.compile(r"^\w+ parameter '(?:(\w+)\.)?(\w+)' (must be .*)$", re.S)


def _param_label(owner: str | None, name: str) -> str:
    """The label a parameter ``owner.name`` shows (its widget's title), found among the
    Parameterized classes loaded; the name itself when there is none."""
    todo = [param.Parameterized]
    while todo:
        cls = todo.pop()
        if cls.__name__ == owner and name in cls.param:
            return cls.param[name].label or name
        todo += cls.__subclasses__()
    return name


def widget_error(exc: BaseException) -> None:
    """Panel's handler of an error raised by a widget's change (``pn.config.exception_handler``):
    a value the page refuses (a number out of its bounds, a bad name) becomes one notification
    saying what is allowed; the widget shows the value kept. Other errors are logged."""
    from explorer._checks import ExplorerError

    if isinstance(exc, (ExplorerError, ValueError)):
        text = str(exc)
        m = _PARAM_BOUNDS.match(text)
        if m:  # param's "Integer parameter 'CircuitsView.n_prompts' must be at least 1, not 0."
            text = f"{_param_label(m.group(1), m.group(2))} {m.group(3)} The value is unchanged."
        notify("warning", text, duration=6000)
        return
    log.error("a widget's change failed", exc_info=exc)


class BokehPane(pn.pane.Bokeh):
    """`pn.pane.Bokeh` for the pages' own Bokeh figures, safe under a page design.

    Panel's pane copies every layout parameter set on it to its figure when the figure
    changes. ``design`` is one of them (set from ``pn.config.design``, which
    `enable_extension` fills, or by a template), but a Bokeh figure has no such property,
    so a new figure in such a pane raised ``AttributeError: unexpected attribute
    'design'``. This pane keeps the design to itself.
    """

    def __init__(self, object: Any = None, **params: Any) -> None:
        super().__init__(object, **params)
        self._overrides = [p for p in self._overrides if p != "design"]

    def _track_overrides(self, *events: Any) -> None:
        super()._track_overrides(*(e for e in events if e.name != "design"))


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


# The sidebar's code cards: the code scrolls inside the card, the copy icon stays in view.
CODE_CSS = """
pre { overflow-x: auto; max-width: 100%; white-space: pre; }
.codehilite, div.highlight { position: relative; max-width: 100%; }
.codehilite .copy-button, .highlight .copy-button, button.copy-button {
  position: absolute; top: 2px; right: 2px; }
"""


# A <pre> keeps its text on one line: a long status ("… (shares the model with 1 other job
# running)") ran out of the page's column at 1280 px. Wrapped, it keeps its monospace look.
_STATUS_CSS = "pre { white-space: pre-wrap; overflow-wrap: anywhere; margin: 0; }"


def status_line(text: Any, **params: Any) -> pn.pane.Str:
    """A page's status line (``text``: a string or a ``param.String`` to follow), in grey
    monospace, wrapped to the width it has."""
    params.setdefault("margin", (12, 10))
    params.setdefault("sizing_mode", "stretch_width")
    styles = {"color": "#555", **params.pop("styles", {})}
    return pn.pane.Str(text, styles=styles, stylesheets=[_STATUS_CSS, *params.pop("stylesheets", [])],
                       css_classes=["status-line", *params.pop("css_classes", [])], **params)


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


_SHOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # document -> {key: shown}
_SHOWN_INLINE: dict = {}  # a notification area without a document (a notebook)


def notify(kind: str, message: str, *, duration: int = 8000, source: str | None = None,
           fault: str | None = None) -> None:
    """Show a notification in the page (``kind`` in error/warning/info/success) and log it.

    One fault, one notification: the same ``kind`` and ``fault`` (default: the message)
    shown again while the first is still up (several pages failing on one bad prompt)
    replaces it, the sources (``source``: the pages, e.g. "Logit lens") named together in
    front of the fault. Outside a served page (tests, scripts) there is no notification
    area: the message is only logged.
    """
    getattr(log, "error" if kind == "error" else "info")(message)
    message = message if fault is None else fault
    area = pn.state.notifications
    if area is None:
        return
    doc = pn.state.curdoc
    shown = _SHOWN.setdefault(doc, {}) if doc is not None else _SHOWN_INLINE
    now = time.monotonic()
    key = (kind, message)
    sources: list[str] = []
    if key in shown:
        until, sources, old = shown[key]
        if now < until:
            if source is None or source in sources:
                return
            try:
                old.destroy()
            except Exception:  # noqa: BLE001 - a notification the page dropped already
                pass
        else:
            sources = []
    if source is not None:
        sources = [*sources, source]
    text = f"{', '.join(sources)}: {message}" if sources else message
    note = getattr(area, kind)(text, duration=duration)
    shown[key] = (now + (duration / 1000 if duration else 3600.0), sources, note)
