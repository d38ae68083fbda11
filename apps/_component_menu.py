"""The gallery sidebar's component menu: what applies to the newest selected component (show
a head's attention, ablate or scale it, add it to the JuICE sets, show its circuit edges)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import panel as pn

from apps import theme
from explorer import components
from explorer._checks import ExplorerError, InputError, check_choice
from explorer.interventions import Ablate, Scale
from explorer.workspace import edit_label

__all__ = ["JUICE_NOTE", "ComponentMenuPart"]


# The component menu's actions: name -> (button label, css class, tooltip). Which apply to a
# component is `Gallery.menu_actions`; the css classes are what a browser test clicks.
MENU_ACTIONS: dict[str, tuple[str, str, str]] = {
    "attention": ("Show attention", "menu-attention",
                  "Open the Attention page with this head enlarged on the prompt."),
    "ablate": ("Ablate", "menu-ablate",
               "Push a zero-ablation of this head on the edit stack: pages that run the model "
               "show clean vs ablated."),
    "scale": ("Scale", "menu-scale",
              "Push an edit multiplying this head's output by the factor beside it."),
    "juice-enhance": ("JuICE S+", "menu-juice-enhance",
                      "Add this head to the enhance set (S+) of the Knowledge conflicts page's "
                      "JuICE run."),
    "juice-suppress": ("JuICE S-", "menu-juice-suppress",
                       "Add this head to the suppress set (S-) of the Knowledge conflicts "
                       "page's JuICE run."),
    "circuit": ("Show circuit edges", "menu-circuit",
                "Open the Circuits page with this component selected (its edges stand out)."),
}


JUICE_NOTE = ("The Knowledge conflicts page of this version cannot take heads from this menu; "
              "click the head there (its *clicks add to* toggle picks S+ or S-).")


class ComponentMenuPart:
    """The component menu of `apps.gallery.Gallery`."""

    def ablate_selected(self, *_: Any) -> None:
        """Push a zero-ablation of every selected head not already ablated."""
        have = {(e.layer, e.head) for e in self.workspace.edits if isinstance(e, Ablate)}
        for layer, head in self.workspace.selected_heads:
            if (layer, head) not in have:
                self.workspace.push_edit(Ablate(layer, head))

    def menu_actions(self, name: str) -> list[str]:
        """The `MENU_ACTIONS` that apply to the component ``name``, in menu order: a head's
        attention, ablation, scaling and JuICE sets (on the pages offered), a head's or an
        MLP's (or the input's, the logits') circuit edges. A whole layer has none."""
        c = components.parse(self.workspace.component(name))
        out = []
        if c.is_head:
            if "attention" in self._specs:
                out.append("attention")
            out += ["ablate", "scale"]
            if "conflicts" in self._specs:
                out += ["juice-enhance", "juice-suppress"]
        if c.kind in ("head", "mlp", "input", "logits") and "circuits" in self._specs:
            out.append("circuit")
        return out

    def _menu_head(self, name: str) -> components.Component:
        c = components.parse(self.workspace.component(name))
        if not c.is_head:
            raise InputError(f"{c} is not a head; ablate, scale and the JuICE sets take a head "
                             "such as 'L3.H1'.")
        return c

    def _set_page_selected(self, slug: str, name: str) -> pn.viewable.Viewer:
        view = self.page(slug)
        self._pushing_selection = True  # already in the workspace: not a new pick
        try:
            view.selected = name
        finally:
            self._pushing_selection = False
        return view

    def show_attention(self, name: str) -> None:
        """Open the Attention page with the head ``name`` enlarged."""
        self._set_page_selected("attention", str(self._menu_head(name)))
        self.view = "attention"

    def show_circuit_edges(self, name: str) -> None:
        """Open the Circuits page with the component ``name`` selected."""
        c = components.parse(self.workspace.component(name))
        if c.kind not in ("head", "mlp", "input", "logits"):
            raise InputError(f"{c} is not a node of the circuit graph; its nodes are heads, "
                             "MLPs, 'input' and 'logits'.")
        self._set_page_selected("circuits", str(c))
        self.view = "circuits"

    def ablate_component(self, name: str) -> Ablate | None:
        """Push a zero-ablation of the head ``name`` (None if it is on the stack already)."""
        c = self._menu_head(name)
        edit = Ablate(c.layer, c.head)
        if edit in self.workspace.edits:
            theme.notify("info", f"{edit_label(edit)} is on the edit stack already.",
                         duration=3000)
            return None
        return self.workspace.push_edit(edit)

    def scale_component(self, name: str, factor: Any) -> Scale | None:
        """Push an edit multiplying the head ``name``'s output by ``factor``."""
        c = self._menu_head(name)
        if factor is None:
            raise InputError("type a scale factor first (e.g. 0.5 halves the head's output).")
        edit = Scale(c.layer, c.head, factor)
        if edit in self.workspace.edits:
            theme.notify("info", f"{edit_label(edit)} is on the edit stack already.",
                         duration=3000)
            return None
        return self.workspace.push_edit(edit)

    def juice_available(self) -> bool:
        """Whether the Knowledge conflicts page takes heads into its JuICE sets
        (``add_to_juice``), judged without building the page when it is not open yet."""
        if "conflicts" not in self._specs:
            return False
        if "conflicts" in self._pages:
            return callable(getattr(self._pages["conflicts"], "add_to_juice", None))
        _, factory = self._specs["conflicts"]
        factory = getattr(factory, "func", factory)  # a functools.partial of the page class
        if not isinstance(factory, type):
            return True  # a factory function: known once the page is built
        return callable(getattr(factory, "add_to_juice", None))

    def add_to_juice(self, name: str, which: str) -> bool:
        """Add the head ``name`` to the Knowledge conflicts page's enhance (S+) or suppress
        (S-) set (its ``add_to_juice(component, which)``); False (with a note) when that page
        cannot take it."""
        check_choice("which", which, ("enhance", "suppress"))
        head = str(self._menu_head(name))
        if "conflicts" not in self._specs:
            raise InputError("this app has no Knowledge conflicts page.")
        add = getattr(self.page("conflicts"), "add_to_juice", None)
        if not callable(add):
            theme.notify("warning", JUICE_NOTE, duration=5000)
            return False
        done = add(head, which)
        if done is False:  # the page said why (a notification)
            return False
        if done is None:   # a page that does not say what it did: say it here
            sets = "S+ (enhance)" if which == "enhance" else "S- (suppress)"
            theme.notify("success", f"Added {head} to the JuICE set {sets} on the Knowledge "
                         "conflicts page.", duration=3000)
        return True

    def component_menu(self, selected: Sequence[str] | None = None) -> pn.Column:
        """The menu card of the newest selected component: its name and the actions that
        apply to it (each button has a tooltip and a ``menu-*`` css class)."""
        selected = self.workspace.selected if selected is None else selected
        if not selected:
            return pn.Column(sizing_mode="stretch_width", margin=0,
                             css_classes=["component-menu", "component-menu-empty"])
        name = selected[-1]
        actions = self.menu_actions(name)

        def act(fn: Callable[[], Any]) -> Callable[[Any], None]:
            def run(_event: Any) -> None:
                try:
                    fn()
                except ExplorerError as exc:
                    theme.notify("warning", str(exc), duration=5000)
            return run

        def button(action: str, fn: Callable[[], Any], **kw: Any) -> pn.widgets.Button:
            label, css, tip = MENU_ACTIONS[action]
            b = pn.widgets.Button(label=label, description=tip, color="light",
                                  css_classes=[css], **kw)
            b.on_click(act(fn))
            return b

        rows: list[Any] = [pn.pane.Markdown(f"**{name}**", margin=(0, 10),
                                            css_classes=["component-menu-name"])]
        if len(selected) > 1:
            rows[0].object += " (the newest selected)"
        line = []
        if "attention" in actions:
            line.append(button("attention", lambda: self.show_attention(name)))
        if "circuit" in actions:
            line.append(button("circuit", lambda: self.show_circuit_edges(name)))
        if line:
            rows.append(pn.Row(*line, margin=0, sizing_mode="stretch_width"))
        if "ablate" in actions:
            factor = pn.widgets.FloatInput(value=0.5, step=0.1, width=70, margin=(5, 5),
                                           description="Factor the head's output is "
                                                       "multiplied by (0 ablates it).",
                                           css_classes=["menu-scale-factor"])
            scale = button("scale", lambda: self.scale_component(name, factor.value))
            rows.append(pn.Row(button("ablate", lambda: self.ablate_component(name)),
                               scale, pn.pane.Str("×", margin=(12, 0)), factor, margin=0))
        if "juice-enhance" in actions:
            if self.juice_available():
                rows.append(pn.Row(
                    button("juice-enhance", lambda: self.add_to_juice(name, "enhance")),
                    button("juice-suppress", lambda: self.add_to_juice(name, "suppress")),
                    margin=0))
            else:
                rows.append(pn.pane.Markdown(JUICE_NOTE, margin=(0, 10),
                                             css_classes=["menu-juice-note"],
                                             styles={"color": "#555", "font-size": "0.9em"}))
        if not actions:
            rows.append(pn.pane.Markdown(
                "Nothing in this menu applies to a whole layer: select one of its heads or its "
                "MLP.", margin=(0, 10), styles={"color": "#555", "font-size": "0.9em"},
                css_classes=["menu-none"]))
        return pn.Column(*rows, sizing_mode="stretch_width", margin=(0, 10, 5, 10),
                         styles={"border": "1px solid #d0d7de", "border-radius": "4px"},
                         css_classes=["component-menu"])
