"""Controls with a visible label and a tooltip, built from a view's Parameters.

Panel draws a label and a "?" tooltip (the Parameter's doc) for selects, text and number
inputs, but none for button groups, and no tooltip for sliders and players. `control` adds
what is missing (`labelled_control`), so every control of a page says what it is and what it changes.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import panel as pn
import param

from apps import theme

__all__ = ["OwnItems", "caption", "check_selected_component", "control", "flex_plot", "flex_row",
           "labelled", "labelled_control", "labelled_controls", "run_page", "selected_component",
           "show_steps", "tip", "index_choice", "token_choice", "training_step"]

#: Width of a slider or player in a page's control column (the tooltip icon takes the rest).
_WIDGET_WIDTH = theme.SIZES["controls_width"] - 50

_GROUPS = (pn.widgets.RadioButtonGroup, pn.widgets.CheckButtonGroup, pn.widgets.RadioBoxGroup,
           pn.widgets.CheckBoxGroup)


def labelled_control(view: param.Parameterized, name: str, kind: type[pn.widgets.Widget], /,
            **options: Any) -> pn.viewable.Viewable:
    """The widget ``kind`` of ``view.param[name]``, with its label shown and its doc as a
    tooltip; ``options`` go to the widget."""
    p = view.param[name]
    doc = p.doc or p.label or name
    if "description" in kind.param and not issubclass(kind, _GROUPS):
        options.setdefault("description", doc)
        return kind.from_param(p, sizing_mode="stretch_width", **options)
    widget = kind.from_param(p, sizing_mode="stretch_width", **options)
    icon = pn.widgets.TooltipIcon(value=doc, margin=(0, 0, 0, 4), css_classes=["control-tooltip"])
    if issubclass(kind, _GROUPS):
        label = pn.pane.HTML(f"<span style='font-size: 0.9em'>{p.label}</span>", margin=(0, 0, 0, 10),
                             width=7 * len(p.label) + 6)     # about the text's width: the icon follows it
        return pn.Column(pn.Row(label, icon, margin=(4, 0, 0, 0)), widget, sizing_mode="stretch_width",
                         margin=0, css_classes=["control", f"control-{name}"])
    # sliders and players draw their own title (with the value): the tooltip goes beside it,
    # the widget at a fixed width (a stretching one shrinks next to it)
    widget.param.update(sizing_mode="fixed", width=options.get("width", _WIDGET_WIDTH))
    return pn.Row(widget, pn.Column(icon, margin=(8, 0, 0, 0), width=24), margin=0,
                  css_classes=["control", f"control-{name}"])


def labelled_controls(view: param.Parameterized, spec: dict[str, dict[str, Any]]) -> list[pn.viewable.Viewable]:
    """`labelled_control` for each ``name: {"type": kind, **options}`` of ``spec``, in its order."""
    out = []
    for name, opts in spec.items():
        opts = dict(opts)
        out.append(labelled_control(view, name, opts.pop("type"), **opts))
    return out


def control(widget: pn.viewable.Viewable, doc: str, label: str | None = None) -> pn.viewable.Viewable:
    """A built widget with a tooltip icon saying what it changes: a button group gets
    ``label`` (bold) above it, a slider or checkbox, which shows its own name, the icon beside it."""
    icon = pn.widgets.TooltipIcon(value=doc, width=20, margin=(6, 4, 0, 0))
    if label is None:
        return pn.Row(widget, icon, sizing_mode="stretch_width")
    head = pn.Row(pn.pane.HTML(f"<b>{label}</b>", margin=(6, 4, 0, 10)), icon)
    return pn.Column(head, widget, sizing_mode="stretch_width")


def tip(widget: pn.widgets.Widget, doc: str | None) -> pn.viewable.Viewable:
    """The widget with a tooltip saying what it changes: its own (``description``) where
    Panel draws one, else an (i) icon beside it (sliders, checkboxes)."""
    if not doc:
        return widget
    if "description" in widget.param:
        widget.description = doc
        return widget
    widget.sizing_mode = "stretch_width"
    return pn.Row(widget, pn.widgets.TooltipIcon(value=doc, margin=(6, 0, 0, -12), width=20),
                  margin=0, sizing_mode="stretch_width")


def labelled(widget: pn.widgets.Widget, label: str, doc: str) -> pn.Column:
    """A button group with the label and tooltip Panel does not draw for it."""
    widget.description = doc
    return pn.Column(pn.Row(pn.pane.HTML(f"<b>{label}</b>", margin=(0, 0, 0, 10)),
                            pn.widgets.TooltipIcon(value=doc, margin=(0, 0)), margin=0),
                     widget, margin=0)


def flex_plot(fn: Any, css: str, min_width: int = 340) -> pn.pane.HoloViews:
    """A plot pane that shares a `pn.FlexBox` row with others (wrapping below ``min_width``)."""
    return pn.pane.HoloViews(fn, sizing_mode="stretch_width", min_width=min_width,
                             css_classes=[css], styles={"flex": "1 1 0"})


def flex_row(min_width: int, *plots: tuple[Any, str]) -> pn.FlexBox:
    """Plots side by side, each ``(fn, css class)`` a `flex_plot`: they wrap one above the
    other where a row would leave one under ``min_width`` px."""
    return pn.FlexBox(*[flex_plot(fn, css, min_width) for fn, css in plots],
                      sizing_mode="stretch_width")


def run_page(view: Any, controls: pn.viewable.Viewable, summary_css: str,
             *body: pn.viewable.Viewable) -> pn.Row:
    """The layout of a page that shows a training run: ``controls`` on the left; on the
    right ``view``'s busy spinner and status line, its ``summary`` (Markdown, css class
    ``summary_css``) and ``body``, top to bottom."""
    status = pn.Row(view.busy_spinner(), theme.status_line(view.param.status), align="center")
    summary = pn.pane.Markdown(view.summary, css_classes=[summary_css])
    return pn.Row(controls, pn.Column(status, summary, *body, sizing_mode="stretch_width"),
                  sizing_mode="stretch_width")


def caption(fn: Any, css: str | None = None, **options: Any) -> pn.pane.Markdown:
    """A caption under a plot: what to read in it (``fn``: text, or a function bound to it);
    ``options`` go to the pane (e.g. ``margin``)."""
    return pn.pane.Markdown(fn, css_classes=[css] if css else [], sizing_mode="stretch_width",
                            styles={"color": "#444", "font-size": "0.9em"}, **options)


class OwnItems:
    """A "Your own" text area (its placeholder shows the format) and a Use button that calls
    ``on_use(text)``; the page parses the text and runs its analysis, or shows the parser's
    message (`View.show_error`), which `layout` shows under the button."""

    def __init__(self, label: str, placeholder: str, doc: str, on_use: Callable[[str], Any], *,
                 button: str = "Use"):
        self.area = pn.widgets.TextAreaInput(
            label=label, placeholder=placeholder, description=doc,
            rows=max(3, placeholder.count("\n") + 1), sizing_mode="stretch_width")
        self.button = pn.widgets.Button(label=button, color="primary", sizing_mode="stretch_width",
                                        description=doc)
        self.button.on_click(lambda *_: on_use(self.area.value))
        self._kept: tuple[param.Parameterized, str] | None = None
        self._keeping = False

    def follow(self, view: param.Parameterized, name: str, take: Callable[[Any], Any]) -> None:
        """Make the page's Parameter ``name`` hold what the box took in (a link carries it):
        the page calls `keep` as it takes an item in; a value set from elsewhere (a link, a
        state) calls ``take(event)``, which takes it in the page's own way."""
        self._kept = (view, name)

        def changed(event: Any) -> None:
            if not self._keeping:
                take(event)
        view.param.watch(changed, [name])

    def taking(self, parse: Callable[[str], Any],
               take: Callable[[Any, str], Any]) -> Callable[[Any], None]:
        """`follow`'s ``take`` for a page whose Parameter is the box's text: a text set from
        elsewhere is shown in the box and taken in with ``take(item, text)`` (the page's
        own way, through `View.adopt_own` and ``parse``); a text refused (the parser's
        message shows), or none, leaves what was taken in before."""
        def take_text(event: Any) -> None:
            view, _ = self._kept
            if event.new and self.area.value != event.new:
                self.area.value = event.new
            if not event.new or view.adopt_own(
                    event.new, parse, lambda item: take(item, event.new)) is None:
                self.keep(event.old)
        return take_text

    def keep(self, value: Any) -> None:
        """Set the followed Parameter to ``value`` without taking it in again."""
        view, name = self._kept
        self._keeping = True
        try:
            setattr(view, name, value)
        finally:
            self._keeping = False

    def layout(self, error: Any) -> pn.Column:
        """The area, the button and the last failure's message (``error``: the view's
        ``param.error``), in red under the button."""
        message = pn.pane.Markdown(pn.bind(lambda e: e or "", error), margin=(0, 10),
                                   styles={"color": "#b00020", "font-size": "0.9em"},
                                   css_classes=["own-items-error"], sizing_mode="stretch_width")
        return pn.Column(self.area, self.button, message, margin=0, sizing_mode="stretch_width",
                         css_classes=["own-items"])


def index_choice(label: str, *, doc: str) -> param.Integer:
    """A page's Parameter for an index into what the model or the shown result has (a layer,
    a head, an atom, a text), from 0; the page bounds it above once it knows how many
    (`apps._view.View.bound_layer`)."""
    return param.Integer(default=0, bounds=(0, None), label=label, doc=doc)


def token_choice(label: str, *, doc: str) -> param.String:
    """A page's answer or alternative token Parameter: empty for the page's default token,
    else a token as the model spells it or ``#id``; ``doc`` says which default."""
    return param.String(default="", label=label, doc=doc)


def selected_component(*, doc: str) -> param.String:
    """A page's ``selected`` Parameter: the component last clicked (``L3.H1``, ``L3.MLP``),
    which the gallery selects in the workspace; ``doc`` says where it is clicked."""
    return param.String(default="", label="Selected component",
                        doc=f"{doc}; in the gallery it is selected in the workspace.")


def check_selected_component(view: param.Parameterized, spec: Any, event: Any) -> None:
    """Watcher of a page's ``selected`` component: a component the model (``spec``) lacks is
    refused with a notification and the previous one kept; any other spelling becomes the
    one spelling (``L3.H1``, ``L3.MLP``)."""
    from explorer import components

    if not event.new:
        return
    try:
        c = components.check_in_model(event.new, spec.n_layers, spec.n_heads)
    except components.ComponentError as exc:
        theme.notify("warning", str(exc), duration=4000)
        view.selected = event.old
        return
    if str(c) != event.new:
        view.selected = str(c)


def training_step(*, doc: str) -> param.Selector:
    """A training-lab page's ``step`` Parameter: the checkpoint shown; its options are the
    steps of the run the page shows (`show_steps`); ``doc`` says what it sets."""
    return param.Selector(default=None, objects=[], label="Training step", doc=doc)


def show_steps(view: param.Parameterized, ds: Any) -> int:
    """Give ``view``'s ``step`` the checkpoint steps of ``ds`` (a run or its analysis) as its
    options; returns the step to show: the one shown when ``ds`` has it, else the last. It is
    chosen before the options change (a slider snaps to the first one then)."""
    steps = [int(s) for s in ds["step"].values]
    keep = view.step if view.step in steps else steps[-1]
    view.param.step.objects = steps
    return keep
