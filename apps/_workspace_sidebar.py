"""The gallery sidebar's workspace part: the selection chips and the box that adds by name,
the edit stack, and the workspace state exported and imported as JSON."""
from __future__ import annotations

import io
from typing import Any

import panel as pn

from apps import theme
from apps._copy_code import CopyCode
from apps._workspace_sharing import PAGE_SELECTIONS
from explorer import components
from explorer._checks import ExplorerError, InputError
from explorer.workspace import Workspace, check_settings

__all__ = ["WorkspaceSidebarPart"]


# The chips of the sidebar selection: Choices.js's search box is hidden (see the module
# docstring); the list still opens on a click, and a chip's ✕ still removes it.
_CHIPS_CSS = """
input.choices__input[type="search"], input.choices__input--cloned { display: none !important; }
"""


class WorkspaceSidebarPart:
    """The sidebar's workspace part of `apps.gallery.Gallery`."""

    def export_state(self) -> str:
        """The session's workspace as JSON (what Export state downloads), with the settings
        (``link_params``) of every page opened."""
        settings = dict(self.workspace.settings)
        for slug in self._pages:
            values = self.page_settings(slug)
            try:  # a value JSON cannot hold stays out of the file (the page's default then)
                settings.update(check_settings({slug: values}) if values else {})
            except InputError as exc:
                theme.notify("warning", f"{self.titles.get(slug, slug)}'s settings are not in "
                             f"the state: {exc}", duration=5000)
        self.workspace.settings = settings
        return self.workspace.to_json()

    def import_state(self, data: str | bytes) -> None:
        """Load an exported state: its prompts, selection and edits (switching the model first
        if the state names another); a bad file shows a message and changes nothing."""
        try:
            state = Workspace.from_json(data)
            if state.model_name != self._model.spec.name:
                if state.model_name not in self.param.model_name.objects:
                    raise InputError(f"the state is for model {state.model_name!r}, which this "
                                     "app does not offer.")
                self._pending_state = state
                self.state_message = f"Loading {state.model_name} for the state…"
                self.model_name = state.model_name
                return
            state = Workspace.from_json(data, model=self._model)  # vector lengths checked too
        except ExplorerError as exc:
            self.state_message = f"Could not import the state: {exc}"
            theme.notify("error", f"Could not import the state: {exc}")
            return
        self._apply_state(state)

    def _apply_state(self, state: Workspace) -> None:
        # the pages' settings first: pasted items the state carries are applied after them
        # (using pasted pairs sets the page's example, which a stored setting must not undo)
        for slug, settings in state.settings.items():
            if slug not in self._specs:
                continue
            if slug in self._pages and slug == self.view:
                self._apply_settings(slug, self._pages[slug], settings)
            else:  # applied when the page is built or next shown (`sync_page`)
                self._pending_settings[slug] = dict(settings)
        self.workspace.update_from(state)
        n, e = len(state.selected), len(state.edits)
        items = f", {len(state.items)} pasted item(s)" if state.items else ""
        self.state_message = (f"Imported: {len(state.prompts)} prompt(s), {n} selected, "
                              f"{e} edit(s){items}.")

    def _state_file(self, event: Any) -> None:
        if event.new:
            self.import_state(event.new)

    def _component_options(self) -> list[str]:
        spec = self._model.spec
        out = []
        for layer in range(spec.n_layers):
            out += [str(components.head(layer, h)) for h in range(spec.n_heads)]
            out += [str(components.mlp(layer)), str(components.layer(layer))]
        return [*out, "input", "logits"]

    def _selection_options(self) -> list[str]:
        """The chips' options: every component, then the selected edges and positions."""
        ws = self.workspace
        return self._component_options() + [n for n in ws.selection if n not in set(ws.selected)]

    def _edit_rows(self, edits: list) -> pn.Column:
        rows = []
        for i, label in enumerate(self.workspace.edit_labels):
            remove = pn.widgets.Button(label="✕", width=36, color="light",
                                       css_classes=["remove-edit"], description=f"Remove {label}")
            remove.on_click(lambda _e, i=i: self.workspace.remove_edit(i))
            rows.append(pn.Row(pn.pane.Str(label, sizing_mode="stretch_width"), remove,
                               sizing_mode="stretch_width"))
        if not rows:
            rows = [pn.pane.Markdown("No edits. Select heads, then *Ablate selected heads*.",
                                     styles={"color": "#555"}, margin=(0, 10))]
        return pn.Column(*rows, sizing_mode="stretch_width", css_classes=["edit-stack"], margin=0)

    def workspace_widgets(self) -> list[pn.viewable.Viewable]:
        """The sidebar's workspace part: selection, edit stack, export / import, code."""
        ws = self.workspace
        choice = pn.widgets.MultiChoice(
            label="Selected (✕ drops one)",
            options=self._selection_options(), value=ws.selection, sizing_mode="stretch_width",
            css_classes=["workspace-selection"], stylesheets=[_CHIPS_CSS],
            description="The workspace's selection: components, circuit edges, token "
                        "positions and dictionary features. Click a head, node or token on a page to select it, or "
                        "type in the box below to add by name; ✕ on a chip drops it.")
        add = pn.widgets.TextInput(
            label="Add to selection", placeholder="L3.H1, L3.H1->L5.MLP, P5 (Enter)",
            sizing_mode="stretch_width", css_classes=["workspace-add"],
            description="A head (L3.H1), an MLP (L3.MLP), a layer (L3), input / logits, a "
                        "circuit edge (L3.H1->L5.MLP), a token position of the prompt (P5) "
                        "or a dictionary feature (L3.F12: feature 12 of the layer-3 "
                        "dictionary, shown on Feature dashboards); several separated by "
                        "commas. Press Enter to add.")
        message = pn.pane.Markdown("", visible=False, margin=(0, 10),
                                   styles={"color": "#b00020", "font-size": "0.9em"},
                                   css_classes=["workspace-add-message"])

        def from_widget(event: Any) -> None:
            # the chips list in option order: take what was added or dropped, keeping the
            # workspace's selection order (the menu follows the newest)
            now = ws.selection
            try:
                gone = [n for n in now if n not in event.new]
                if gone:
                    ws.deselect(*gone)
                added = [n for n in event.new if n not in now]
                if added:
                    ws.select(*added)
            except InputError as exc:
                theme.notify("warning", str(exc), duration=4000)
                to_widget()

        def to_widget(*_: Any) -> None:
            options = self._selection_options()
            if choice.options != options:
                choice.options = options
            if list(choice.value) != ws.selection:
                choice.value = ws.selection

        def typed(event: Any) -> None:
            if not (event.new or "").strip():
                return
            try:
                self.add_to_selection(event.new)
            except InputError:
                message.object, message.visible = self.add_message, True
                return
            message.object, message.visible = "", False
            add.value = ""  # the same name typed again is a new event

        self._choices.append(choice)
        choice.param.watch(from_widget, "value")
        add.param.watch(typed, "value")
        ws.param.watch(to_widget, ["selected", *PAGE_SELECTIONS])
        ablate = pn.widgets.Button(label="Ablate selected heads", color="light",
                                   sizing_mode="stretch_width", css_classes=["ablate-selected"])
        ablate.on_click(self.ablate_selected)
        export = pn.widgets.FileDownload(callback=lambda: io.StringIO(self.export_state()),
                                         filename="explorer-state.json", label="Export state",
                                         color="light", sizing_mode="stretch_width",
                                         css_classes=["export-state"])
        upload = pn.widgets.FileInput(accept=".json", multiple=False, sizing_mode="stretch_width",
                                      css_classes=["import-state"])
        upload.param.watch(self._state_file, "value")
        code = CopyCode(code=ws.copy_as_code(), label="Copy as code",
                        title="The workspace as code: model, prompt, selection and edits",
                        css_classes=["workspace-code"])
        ws.param.watch(lambda *_: setattr(code, "code", ws.copy_as_code()),
                       ["prompts", "second_prompt", "selected", "selected_edges",
                        "selected_positions", "selected_features", "edits"])
        return [pn.pane.Markdown("### Workspace"), choice, add, message,
                pn.bind(self.component_menu, ws.param.selected),
                pn.pane.Markdown("**Edits**"), pn.bind(self._edit_rows, ws.param.edits), ablate,
                export, pn.pane.Markdown("Import state (JSON):"), upload,
                pn.pane.Markdown(self.param.state_message, css_classes=["state-message"]), code]
