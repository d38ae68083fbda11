"""How the gallery keeps its pages and its workspace in step: a component, an edge or a
token position picked on a page joins the workspace selection, and the pages follow the
workspace's selection, prompt (and second prompt), edits and the text of the pages' "Your
own" boxes.

Only what the person asked for runs: a workspace change reaches the page in view at once
(it recomputes); the other pages built so far keep what they show, on the inputs they showed
it for, and catch up when opened (`SharingPart.sync_page`, called by the gallery as it shows a
page). So a prompt that a method refuses gets one message, from the page in view, and no
hidden page computes in the background."""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import panel as pn
import param

from apps import theme
from explorer import components
from explorer._checks import InputError

__all__ = ["PAGE_SELECTIONS", "SharingPart"]


# A page's "Your own" box whose text travels in the workspace (`Workspace.items`), by page
# slug: the name of a page parameter holding the text, else of the page's
# `apps._controls.OwnItems` box (its text area is read and written; on import the page's
# ``use_own(text)`` applies it). Pages not named here are looked up by the default.
OWN_ITEMS: dict[str, str] = {"conflicts": "_own", "icl-heads": "_own", "unlearning": "_own"}


_OWN_ITEMS_DEFAULT = "_own"


# The workspace lists a page can share by having a parameter of the same name (a param.List):
# the gallery keeps the page's list equal to the workspace's, and the page's own changes (a
# click) select / deselect in the workspace.
PAGE_SELECTIONS = ("selected_edges", "selected_positions", "selected_features")


def _own_items_source(view: Any, name: str) -> tuple[param.Parameterized, str] | None:
    """(object, parameter) holding the text of ``view``'s "Your own" box: the page's string
    parameter ``name``, or the ``value`` of the text area of its box ``name``; None if none."""
    if name in view.param and isinstance(view.param[name], param.String):
        return view, name
    area = getattr(getattr(view, name, None), "area", None)
    if isinstance(area, pn.widgets.TextAreaInput):
        return area, "value"
    return None


class SharingPart:
    """The workspace sharing of `apps.gallery.Gallery`."""

    def _page_in_view(self) -> list[pn.viewable.Viewer]:
        """The page shown, when built: the one page a workspace change reaches at once."""
        view = self._pages.get(self.view)
        return [] if view is None else [view]

    def sync_page(self, slug: str) -> None:
        """Bring the built page ``slug`` up to the workspace: its prompt, selection, edges,
        positions, edits, pasted item and the settings a state or link left for it. The
        gallery calls it as it shows the page; a page already up to date is left alone (no
        parameter is set, nothing recomputes)."""
        view = self._pages.get(slug)
        if view is None:
            return
        ws = self.workspace
        settings = self._pending_settings.pop(slug, None)
        if settings:
            self._apply_settings(slug, view, settings)
        # the inputs first, in one update: the page recomputes once, on all of them (a head
        # selected while it was hidden must not recompute it on its old prompts first)
        inputs = {"edits": list(ws.edits), "prompt": self.prompt,
                  "second_prompt": ws.second_prompt}
        changed = {name: value for name, value in inputs.items()
                   if name in view.param and getattr(view, name) != value}
        if changed:
            view.param.update(**changed)
        self._pushing_selection = True
        try:
            if "highlighted" in view.param and list(view.highlighted) != list(ws.selected):
                view.highlighted = list(ws.selected)
            if "selected" in view.param:
                self._selection_to_page(view, ws.selected)
            for name in PAGE_SELECTIONS:
                if (name in view.param and isinstance(view.param[name], param.List)
                        and list(getattr(view, name)) != list(getattr(ws, name))):
                    setattr(view, name, list(getattr(ws, name)))
        finally:
            self._pushing_selection = False
        if slug in self._items_behind and slug in self._own_boxes:
            self._items_behind.discard(slug)
            obj, name = self._own_boxes[slug]
            if (getattr(obj, name) or "") != ws.item(slug):
                self._item_to_page(slug, ws.item(slug))

    def _share_prompt(self, event: Any) -> None:
        self.workspace.prompt = event.new
        for view in self._page_in_view():
            if "prompt" in view.param and view.prompt != event.new:
                view.prompt = event.new

    def _share_second_prompt(self, event: Any) -> None:
        """The workspace's second prompt changed (the sidebar box, a state, a link): the page
        in view that shows it follows (`Workspace.second_prompt`)."""
        for view in self._page_in_view():
            if "second_prompt" in view.param and view.second_prompt != event.new:
                view.second_prompt = event.new

    def _prompt_from_workspace(self, event: Any) -> None:
        # a loaded state: the sidebar and every page follow
        if self.workspace.prompt != self.prompt:
            self.prompt = self.workspace.prompt

    def _selection_from_page(self, event: Any) -> None:
        """A page picked a component (a click, a typed name): select it in the workspace."""
        if self._pushing_selection:
            return
        new = event.new
        try:
            if isinstance(new, str):
                if new:
                    self.workspace.select(new)
            elif isinstance(new, (list, tuple)):
                old = list(event.old or [])
                self.workspace.select(*[n for n in new if n not in old])
                self.workspace.deselect(*[n for n in old if n not in new])
        except InputError as exc:
            theme.notify("warning", str(exc), duration=4000)

    def _selection_to_page(self, view: pn.viewable.Viewer, selected: Sequence[str]) -> None:
        if isinstance(view.param["selected"], param.List):
            if list(view.selected) != list(selected):
                view.selected = list(selected)
            return
        if not isinstance(view.param["selected"], param.String):
            return
        current = view.selected
        try:
            current = components.canonical(current) if current else ""
        except components.ComponentError:
            pass
        heads = [name for name in selected if components.parse(name).is_head]
        if heads and current != heads[-1]:
            view.selected = heads[-1]  # the newest selected head

    def _share_selection(self, event: Any) -> None:
        self._pushing_selection = True
        try:
            for view in self._page_in_view():
                if "highlighted" in view.param and list(view.highlighted) != list(event.new):
                    view.highlighted = list(event.new)
                if "selected" in view.param:
                    self._selection_to_page(view, event.new)
        finally:
            self._pushing_selection = False

    def _page_selection_changed(self, event: Any) -> None:
        """A page changed its edges or positions (a click): the workspace follows."""
        if self._pushing_selection:
            return
        old, new = list(event.old or []), list(event.new or [])
        try:
            gone = [n for n in old if n not in new]
            if gone:
                self.workspace.deselect(*gone)
            added = [n for n in new if n not in old]
            if added:
                self.workspace.select(*added)
        except InputError as exc:
            theme.notify("warning", str(exc), duration=4000)
        finally:  # the page shows what the workspace took (a refused pick is undone)
            kept = list(getattr(self.workspace, event.name))
            if list(getattr(event.obj, event.name)) != kept:
                self._pushing_selection = True
                try:
                    setattr(event.obj, event.name, kept)
                finally:
                    self._pushing_selection = False

    def _share_page_selections(self, *events: Any) -> None:
        self._pushing_selection = True
        try:
            for event in events:
                for view in self._page_in_view():
                    if (event.name in view.param
                            and list(getattr(view, event.name)) != list(event.new)):
                        setattr(view, event.name, list(event.new))
        finally:
            self._pushing_selection = False

    def add_to_selection(self, text: str) -> list[str]:
        """Select what ``text`` names: components, edges (``L3.H1->L5.MLP``), positions
        (``P5``) and dictionary features (``L5.F12``), separated by commas or semicolons.
        Returns the names added; for text that cannot be read nothing is added and
        `add_message` says why (also raised). The page in view with a ``show_selected``
        method is told the last name typed, so that one typed again (already selected, the
        workspace unchanged) is shown there too."""
        parts = [t.strip() for t in re.split(r"[,;]", text or "") if t.strip()]
        try:
            added = self.workspace.select(*parts) if parts else []
        except InputError as exc:
            self.add_message = str(exc)
            raise
        self.add_message = ""
        for view in self._page_in_view():
            if added and callable(getattr(view, "show_selected", None)):
                view.show_selected(added[-1])
        return added

    def _share_edits(self, event: Any) -> None:
        for view in self._page_in_view():
            if "edits" in view.param and list(view.edits) != list(event.new):
                view.edits = list(event.new)

    def _prompt_from_page(self, event: Any) -> None:
        # a page changed its prompt (a loaded state): the sidebar and other pages follow
        if self.prompt != event.new:
            self.prompt = event.new

    def _connect_own_items(self, slug: str, view: pn.viewable.Viewer) -> None:
        """Keep the page's "Your own" box and the workspace's item for ``slug`` in step."""
        source = _own_items_source(view, OWN_ITEMS.get(slug, _OWN_ITEMS_DEFAULT))
        if source is None:
            return
        self._own_boxes[slug] = source
        obj, name = source
        if self.workspace.item(slug):  # pasted before (an imported state, another model)
            self._item_to_page(slug, self.workspace.item(slug))
        obj.param.watch(lambda event, slug=slug: self._item_from_page(slug, event.new), name)

    def _item_from_page(self, slug: str, text: Any) -> None:
        if self._pushing_items:
            return
        try:
            self.workspace.set_item(slug, text or "")
        except InputError as exc:
            theme.notify("warning", f"Not kept in the workspace state: {exc}", duration=5000)

    def _item_to_page(self, slug: str, text: str) -> None:
        """Show ``text`` in the page's box; a page with ``use_own`` applies it (as its Use
        button does: a bad text shows the page's parser message)."""
        obj, name = self._own_boxes[slug]
        self._pushing_items = True
        try:
            setattr(obj, name, text)
        finally:
            self._pushing_items = False
        use = getattr(self._pages.get(slug), "use_own", None)
        if text and obj is not self._pages.get(slug) and callable(use):
            use(text)

    def _share_items(self, event: Any) -> None:
        old = event.old or {}
        for slug, (obj, name) in list(self._own_boxes.items()):
            text = event.new.get(slug, "")
            # only the items that changed: a box whose text the state refused keeps it
            if text != old.get(slug, "") and (getattr(obj, name) or "") != text:
                if slug == self.view:
                    self._item_to_page(slug, text)
                else:  # applied (and run) when the page is opened
                    self._items_behind.add(slug)
