"""The paper beside the page: a *Paper's setting* button, the line saying which of the page's
values differ from the paper's, and a card with the paper's headline result beside the
explorer's measured number (read from ``docs/figures/*.json``).

The table of the papers' settings and results is `explorer.paper_settings`; everything
here is drawing. `paper_card_markdown` and `page_differs_line` are pure functions of the
table, the page's parameter values and the committed JSON, so the tests check them as text.
"""
from __future__ import annotations

from typing import Any

import panel as pn
import param

from explorer.paper_settings import (
    PAPER_RESULTS,
    differs_line,
    measured_numbers,
    page_values,
    paper_setting,
    reproduces,
    reproduction_line,
)

__all__ = ["paper_card_markdown", "page_differs_line", "apply_paper_setting", "paper_panel"]


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if float(x).is_integer() and abs(x) >= 1:
        return f"{int(x):,}"
    return f"{x:.3g}" if abs(x) < 0.01 else f"{x:.3f}"


def paper_card_markdown(method: str, numbers: dict[str, dict[str, float | None]] | None = None) -> str:
    """The card: the paper's headline (its setting and model), the explorer's numbers (with
    their intervals where the JSON has them) and whether it reproduces. ``numbers`` defaults
    to `measured_numbers` (the committed JSON)."""
    result = PAPER_RESULTS[method]
    numbers = measured_numbers(method) if numbers is None else numbers
    here = []
    for label, n in numbers.items():
        interval = (f" [{_fmt(n['low'])}, {_fmt(n['high'])}]"
                    if n.get("low") is not None and n.get("high") is not None else "")
        here.append(f"{label} **{_fmt(n['value'])}**{interval}")
    mark = "✓" if reproduces(method, numbers) else "✗"
    return (f"**Paper** ({paper_setting(method).paper}): {result.paper}. "
            f"*{result.paper_setting}.*\n\n"
            f"**Here** ({result.here_setting}): {'; '.join(here)} "
            f"(`docs/figures/{result.figure}`).\n\n"
            f"{mark} {reproduction_line(method, numbers)} Details: `{result.doc}`.")


def _run_settings(method: str) -> dict[str, Any]:
    """The training settings of the runs a training page shows (the library's defaults, which
    the shipped and stored runs use), by command option."""
    if method == "parity":
        from explorer.analyses.parity import DEFAULTS
    elif method == "linear-icl":
        from explorer.analyses.linear_icl import DEFAULTS
    elif method == "task-emergence":
        from explorer.analyses.task_emergence import DEFAULTS
    elif method == "shattering":
        from explorer.analyses.shattering import DEFAULTS
    else:
        return {}
    return dict(DEFAULTS)


def page_differs_line(method: str, view: param.Parameterized) -> str:
    """`differs_line` of the page's current values of the parameters the table ties to it and,
    on a page of trained runs, of the runs' training settings."""
    values = page_values(method)
    current = {name: getattr(view, name) for name in values if name in view.param}
    line = differs_line(method, current, _run_settings(method))
    if not values:
        line += f" Train the paper's setting with `explorer {method} train --paper`."
    return line


def apply_paper_setting(method: str, view: param.Parameterized) -> dict[str, Any]:
    """Set every page parameter the table ties to the paper's value (in one update, so the
    page recomputes once); returns what was set."""
    values = {k: v for k, v in page_values(method).items() if k in view.param}
    view.param.update(**values)
    return values


def paper_panel(method: str, view: param.Parameterized) -> pn.viewable.Viewable:
    """The button, the differs line (following the page's parameters) and the card."""
    names = [n for n in page_values(method) if n in view.param]
    button = pn.widgets.Button(
        label="Paper's setting", disabled=not names, width=150,    # the line beside takes the rest
        description=("Set " + ", ".join(view.param[n].label or n for n in names)
                     + f" to the values of {paper_setting(method).paper}") if names else
                    "The paper's setting is a training setting of the command (--paper).",
        css_classes=["paper-setting"])
    button.on_click(lambda *_: apply_paper_setting(method, view))
    line = pn.pane.Markdown(
        pn.bind(lambda *_: page_differs_line(method, view), *[view.param[n] for n in names])
        if names else page_differs_line(method, view),
        sizing_mode="stretch_width", css_classes=["paper-differs"],
        styles={"font-size": "0.9em", "color": "#444"}, margin=(0, 10))
    try:
        text = paper_card_markdown(method) if method in PAPER_RESULTS else ""
    except FileNotFoundError as exc:         # an installed copy without the repository's docs
        text = (f"The explorer's measured numbers are in the repository's docs/figures "
                f"({exc.filename} is not here).")
    card = pn.pane.Markdown(
        text,
        sizing_mode="stretch_width", css_classes=["paper-card"],
        styles={"font-size": "0.9em", "border-left": "3px solid #1f77b4",
                "padding-left": "8px", "background": "#f7f9fc"})
    return pn.Column(pn.Row(button, line, sizing_mode="stretch_width"), card,
                     sizing_mode="stretch_width", css_classes=["paper-panel"])
