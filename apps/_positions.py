"""Token positions of the prompt as something to click and to see: a strip of the prompt's
tokens (a click selects or deselects that position) and the outlines pages draw around the
selected positions. Pages keep the selection in a ``selected_positions`` parameter (0-based
token positions of the prompt, spelled ``P5``: `explorer.components.Position`); in the gallery
that parameter is the workspace's, so a click on one page shows on every page.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import holoviews as hv
import panel as pn
import param

from apps import theme
from apps._view import STATIC_TOOLS
from explorer import components
from explorer._checks import InputError

__all__ = ["PositionStrip", "PagePositions", "toggled", "shown_positions", "column_boxes", "row_boxes",
           "position_outlines", "POSITION_COLOR", "position_caption"]

POSITION_COLOR = theme.CATEGORICAL[2]
"""The colour of a workspace selection on every page (the selected heads' dashed outlines too)."""


def toggled(selected: Sequence[int], pos: int) -> list[int]:
    """``selected`` with ``pos`` removed if it is there, else added last."""
    pos = int(pos)
    return [p for p in selected if p != pos] if pos in selected else [*selected, pos]


def shown_positions(selected: Iterable[int], n: int) -> list[int]:
    """The selected positions a prompt of ``n`` tokens has, in selection order, once each."""
    out: list[int] = []
    for p in selected or ():
        if isinstance(p, int) and not isinstance(p, bool) and 0 <= p < n and p not in out:
            out.append(p)
    return out


def column_boxes(positions: Iterable[int], low: float, high: float) -> list[tuple]:
    """(x0, y0, x1, y1) of a full-height box around each position's column (x = position)."""
    return [(p - 0.5, low, p + 0.5, high) for p in positions]


def row_boxes(positions: Iterable[int], low: float, high: float) -> list[tuple]:
    """(x0, y0, x1, y1) of a full-width box around each position's row (y = position)."""
    return [(low, p - 0.5, high, p + 0.5) for p in positions]


def position_outlines(boxes: Sequence[tuple]) -> hv.Rectangles:
    """Dashed outlines of the selected positions, in the selection colour.

    The plot they are overlaid on draws on a canvas: HoloViews asks Bokeh for WebGL, whose
    quads draw a dash pattern as a solid line. Dashes of 8 px (Bokeh's "dashed" is 6 on 6
    off): at 3 px wide those read as dots on a small cell."""
    return hv.Rectangles(list(boxes)).opts(
        fill_alpha=0.0, line_color=POSITION_COLOR, line_width=3, line_dash=(8, 4),
        default_tools=STATIC_TOOLS, backend_opts={"plot.output_backend": "canvas"})


def position_caption(selected: Sequence[int], tokens: Sequence[str]) -> str:
    """One line naming the selected positions with their tokens (``Selected positions
    (dashed): P1 ·capital. …``), or how to select one when none of them is in the prompt."""
    shown = shown_positions(selected, len(tokens))
    if not shown:
        return "Click a token to select its position (again to deselect it)."
    names = ", ".join(f"{components.Position(p)} {tokens[p]}" for p in shown)
    return f"Selected positions (dashed): {names}. Click a token to add or drop one."


class PositionStrip(pn.custom.ReactiveHTML):
    """The prompt's tokens as spans; a click (or Enter / Space on a focused token) selects or
    deselects that position in ``selected``; the selected ones are outlined. The strip's box
    carries ``data-positions-selected`` (the selection, comma separated) for tests.

    A ReactiveHTML rather than a JSComponent: a JSComponent's view waits for its ES module to
    load before it renders, and its page's other panes wait with it; a pane whose ``visible``
    changed meanwhile (the page's busy spinner, as the trace starts) raised in the browser
    (Panel's HTML view: "Cannot read properties of undefined (reading 'style')")."""

    tokens = param.List(default=[], item_type=str, doc="The prompt's tokens, as shown.")
    selected = param.List(default=[], item_type=int, doc="Selected positions (0-based).")

    def __init__(self, **params):
        params.setdefault("margin", (4, 10))  # the page's text panes' left edge
        super().__init__(**params)

    _template = '<div id="strip" class="pos-strip" data-positions-selected=""></div>'

    # `draw` builds the spans (a new prompt); `mark` outlines the selected ones in place, so a
    # token focused from the keyboard keeps the focus when it is toggled
    _scripts = {
        "render": """
          state.mark = () => {
            const sel = data.selected;
            strip.dataset.positionsSelected = sel.join(",");
            for (const s of strip.children) {
              const on = sel.includes(Number(s.dataset.pos));
              s.classList.toggle("pos-selected", on);
              s.setAttribute("aria-pressed", on ? "true" : "false");
            }
          };
          const toggle = (i) => {
            const now = data.selected.slice();
            const at = now.indexOf(i);
            if (at >= 0) now.splice(at, 1); else now.push(i);
            data.selected = now;
          };
          state.draw = () => {
            strip.replaceChildren();
            data.tokens.forEach((t, i) => {
              const s = document.createElement("span");
              s.textContent = t;
              s.title = "P" + i + " " + t + " (click to select or deselect)";
              s.dataset.pos = String(i);
              s.tabIndex = 0;
              s.setAttribute("role", "button");
              s.className = "pos-token";
              s.addEventListener("click", () => toggle(i));
              s.addEventListener("keydown", (e) => {
                if (e.key === "Enter" || e.key === " ") { e.preventDefault(); toggle(i); }
              });
              strip.appendChild(s);
            });
            state.mark();
          };
          state.draw();
        """,
        "tokens": "state.draw()",
        "selected": "state.mark()",
    }
    _stylesheets = [f"""
    .pos-strip {{ line-height: 2.0; font-family: ui-monospace, monospace; font-size: 13px; }}
    .pos-token {{ padding: 1px 3px; margin: 0 1px; border-radius: 3px; cursor: pointer;
                 white-space: pre; display: inline-block; background: #eef1f4; }}
    .pos-token:hover {{ outline: 2px solid #444; }}
    .pos-selected, .pos-selected:hover {{ outline: 2.5px dashed {POSITION_COLOR};
                                         background: #fff6d5; }}
    """]


class PagePositions:
    """A page's prompt-token strip, kept in step with the page's ``selected_positions``
    both ways (a click on the strip sets the parameter; the parameter, set by the
    workspace or the page, marks the strip), its tokens refreshed when ``refresh_on``
    changes. ``tokens()`` gives the prompt's tokens as shown; ``empty`` is the message of
    `toggle` before there are any."""

    def __init__(self, view: param.Parameterized, tokens: Callable[[], list[str]], *,
                 refresh_on: str, css_class: str, empty: str = "the prompt has no tokens yet."):
        self._view, self._tokens, self._empty = view, tokens, empty
        self.strip = PositionStrip(selected=list(view.selected_positions),
                                   sizing_mode="stretch_width", css_classes=[css_class])
        self.strip.param.watch(self._clicked, "selected")
        view.param.watch(self._to_strip, ["selected_positions"])
        view.param.watch(self.refresh, [refresh_on])

    def toggle(self, pos: int) -> None:
        """Select token position ``pos`` of the prompt, or deselect it (a click on it)."""
        n = len(self._tokens())
        pos = int(pos)
        if not 0 <= pos < n:
            raise InputError(f"`pos` must be a token position of the prompt in [0, {n - 1}]; "
                             f"got {pos}." if n else self._empty)
        self._view.selected_positions = toggled(self._view.selected_positions, pos)

    def refresh(self, *_: Any) -> None:
        """Show the prompt's current tokens."""
        self.strip.tokens = self._tokens()

    def _clicked(self, event: Any) -> None:
        if list(event.new) != list(self._view.selected_positions):
            self._view.selected_positions = list(event.new)

    def _to_strip(self, *_: Any) -> None:
        if list(self.strip.selected) != list(self._view.selected_positions):
            self.strip.selected = list(self._view.selected_positions)
