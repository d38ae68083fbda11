"""The app shell: every view as a page, with a shared sidebar (model, prompt, workspace, cache).

Serve it with ``python -c "from apps.gallery import serve; serve()"`` or
``panel serve apps/gallery.py`` (model from ``$EXPLORER_MODEL``, default smollm2-135m).
A page is added by appending ``(title, slug, factory)`` to `VIEWS`; ``factory(model)``
returns a ``pn.viewable.Viewer``. A view with a ``prompt`` parameter follows the sidebar's
prompt (and its own prompt widget is hidden); each page is built on first visit.
Every browser session gets its own `Gallery` and views; only loaded models are shared.

A session has one `explorer.workspace.Workspace` (`Gallery.workspace`): the sidebar prompt is
its prompt, the sidebar shows its selection (components, circuit edges and token positions,
one chip each: a chip's ✕ drops it; the list under the chips picks a component with the mouse)
and its edit stack (each removable), and exports / imports it as JSON. What the user types
goes into the *Add to selection* box, read with the one spelling (``L3.H1``, ``a3.h1->m5``,
``P5``; `explorer.components.parse_any`): the chips' own search box is hidden, because its
fuzzy search picks another head when the one typed is already selected or when Enter comes
before the search has run. A page with a ``selected`` parameter (the head or component it
shows) adds what the user picks there to the workspace selection and shows the workspace's
newest head; a page with a ``highlighted`` parameter outlines every selected component; a page
with a ``selected_edges`` (list of edge names) or ``selected_positions`` (list of token
positions) parameter gets the workspace's edges / positions and its changes to them (a click)
select and deselect them in the workspace; a page with ``set_sources`` (the head atlas) reads
the Datasets the session's pages hold.

Under the selection, a small menu offers what applies to the newest selected component
(`Gallery.menu_actions`): show a head's attention on the prompt, ablate or scale a head (each
pushes an edit), add a head to the Knowledge conflicts page's JuICE sets, show a head's or an
MLP's circuit edges. The text pasted in a page's "Your own" box (`OWN_ITEMS`) is kept in the
workspace (`Workspace.items`), so it travels in the exported state and comes back on import.

The sidebar's *This page* part exports the page shown: *Export page data* downloads its
Datasets as NetCDF, its tables as CSV, its snippet and a manifest (with the workspace state) in
one zip (`apps._view.View.export_bytes`); *Copy page as code* shows the Python that recomputes
it (`apps._view.View.code_snippet`), following the page's settings.
"""
from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import panel as pn
import param
import xarray as xr
from panel.custom import JSComponent

import explorer
from apps import theme
from apps._intros import INTROS, intro_pane
from apps._server import served_origins, set_heavy_job_limit, with_sign_in_pages
from apps._session import Runner, get_model, session_hooks, user_message
from apps._view import scope_line
from apps.home import HomeView
from apps.atlas import AtlasView
from apps.attention import AttentionView
from apps.circuits import CircuitsView
from apps.conflicts import ConflictsView
from apps.icl_heads import ICLHeadsView
from apps.itda import ITDAView
from apps.lens import LensView
from apps.neuron_eval import NeuronEvalView
from apps.linear_icl import LinearICLView
from apps.parity import ParityView
from apps.saturation import SaturationView
from apps.shattering import ShatteringView
from apps.unlearning import UnlearningView
from apps.task_emergence import TaskEmergenceView
from explorer import components
from explorer._checks import ExplorerError, InputError, check_choice
from explorer.defaults import DEFAULT_MODEL
from explorer.interventions import Ablate, Scale
from explorer.workspace import (MAX_PROMPT_CHARS, Workspace, check_settings, edit_label,
                                read_link, workspace_link)

__all__ = ["VIEWS", "DEFAULT_PROMPT", "MENU_ACTIONS", "OWN_ITEMS", "PAGE_SELECTIONS", "Gallery",
           "AddressBar", "MAX_PROMPT_TOKENS", "create_app", "serve"]

DEFAULT_PROMPT = "The capital of France is"

ViewFactory = Callable[[explorer.Model], pn.viewable.Viewer]

# (title, slug, factory): the navigation, in order. Later pages append theirs.
VIEWS: list[tuple[str, str, ViewFactory]] = [
    ("Logit lens", "lens", LensView),
    ("Saturation events", "saturation", SaturationView),
    ("Knowledge conflicts", "conflicts", ConflictsView),
    ("ICL heads", "icl-heads", ICLHeadsView),
    ("ITDA dictionaries", "itda", ITDAView),
    ("Neuron explanations", "neuron-eval", NeuronEvalView),
    ("Streaming parity", "parity", ParityView),
    ("Linear ICL", "linear-icl", LinearICLView),
    ("Task-vector emergence", "task-emergence", TaskEmergenceView),
    ("Circuits", "circuits", CircuitsView),
    ("Representation shattering", "shattering", ShatteringView),
    ("Unlearning", "unlearning", UnlearningView),
    ("Attention", "attention", AttentionView),
    ("Head atlas", "atlas", AtlasView),
]


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

# A page's "Your own" box whose text travels in the workspace (`Workspace.items`), by page
# slug: the name of a page parameter holding the text, else of the page's
# `apps._controls.OwnItems` box (its text area is read and written; on import the page's
# ``use_own(text)`` applies it). Pages not named here are looked up by the default.
OWN_ITEMS: dict[str, str] = {"conflicts": "_own", "icl-heads": "_own", "unlearning": "_own"}
_OWN_ITEMS_DEFAULT = "_own"

# The workspace lists a page can share by having a parameter of the same name (a param.List):
# the gallery keeps the page's list equal to the workspace's, and the page's own changes (a
# click) select / deselect in the workspace.
PAGE_SELECTIONS = ("selected_edges", "selected_positions")

MAX_PROMPT_TOKENS = 2048
"""The longest prompt the sidebar takes, in tokens (less when the model's context is shorter);
each page may refuse a shorter one its method cannot draw (it says its limit)."""


class AddressBar(JSComponent):
    """The browser's address bar kept equal to the view, in the browser itself.

    A click on the navigation (a button of the ``gallery-nav`` group) or on a page link
    (``<a data-view="slug">``, the home page's) writes ``?view=<slug>`` at once, before the
    server answers, so the address follows the page however busy the server is. The server
    then sets `query` (the whole link: page and ``s=`` state), which replaces the address, or
    pushes a new entry when the server itself changed the page. Back / Forward (and page
    links) send the address to the server as `popped`, which opens its page.
    """

    query = param.String(default="", doc="The link of the view shown (server -> browser).")
    popped = param.String(default="", doc="The address after Back / Forward or a page link "
                                          "(browser -> server), with a counter.")
    titles = param.Dict(default={}, doc="Navigation title -> page slug.")

    _esm = """
export function render({ model }) {
  const slugOf = (search) => new URLSearchParams(search).get('view')
  const pop = () => { model.popped = window.location.search + '#' + Date.now() + Math.random() }
  const go = (slug) => {
    if (slug == null || slugOf(window.location.search) === slug) return
    window.__explorerNav = slug
    history.pushState(null, '', '?view=' + encodeURIComponent(slug))
  }
  const sync = () => {
    const want = model.query
    if (!want || window.location.search === want) return
    const next = slugOf(want)
    const pending = window.__explorerNav
    if (pending != null) {
      if (next !== pending) return          // an answer from before the user's last click
      window.__explorerNav = null
    }
    if (slugOf(window.location.search) === next) history.replaceState(null, '', want)
    else history.pushState(null, '', want)
  }
  const onclick = (e) => {
    if (e.button !== 0 || e.ctrlKey || e.metaKey || e.shiftKey || e.altKey) return
    const path = e.composedPath()
    const link = path.find(el => el.tagName === 'A' && el.dataset && el.dataset.view)
    if (link) {
      e.preventDefault()
      go(link.dataset.view)
      pop()
      return
    }
    const button = path.find(el => el.tagName === 'BUTTON')
    const nav = path.find(el => el.classList && el.classList.contains('gallery-nav'))
    if (button && nav) go(model.titles[button.textContent.trim()])
  }
  const onpop = () => { window.__explorerNav = slugOf(window.location.search); pop() }
  document.addEventListener('click', onclick, true)
  window.addEventListener('popstate', onpop)
  model.on('query', sync)
  model.on('remove', () => {
    document.removeEventListener('click', onclick, true)
    window.removeEventListener('popstate', onpop)
  })
  sync()
  const el = document.createElement('span')
  el.className = 'address-bar'
  return el
}
"""


# The chips of the sidebar selection: Choices.js's search box is hidden (see the module
# docstring); the list still opens on a click, and a chip's ✕ still removes it.
_CHIPS_CSS = """
input.choices__input[type="search"], input.choices__input--cloned { display: none !important; }
"""

# The sidebar's code cards: the code scrolls inside the card, the copy icon stays in view.
_CODE_CSS = """
pre { overflow-x: auto; max-width: 100%; white-space: pre; }
.codehilite, div.highlight { position: relative; max-width: 100%; }
.codehilite .copy-button, .highlight .copy-button, button.copy-button {
  position: absolute; top: 2px; right: 2px; }
"""

# a page's parameters that do not change what its snippet says
_NOT_SNIPPET = {"name", "status", "busy", "running", "progress", "progress_active", "error"}


def _model_choices(current: str) -> list[str]:
    names = list(explorer.known_models())
    return names if current in names else [current, *names]


def cache_status() -> str:
    """One line on the activation cache: its size and folder, or why it cannot be used."""
    try:
        store = explorer.ActivationStore()
        return f"Activation cache: {theme.format_bytes(store.du())} in `{store.path}`"
    except ExplorerError as exc:
        return f"Activation cache unavailable: {exc}"


class Gallery(pn.viewable.Viewer):
    """One browser session of the app: navigation, shared sidebar, the pages it has opened.

    Parameters
    ----------
    model_name : str, default="smollm2-135m"
    views : sequence of (title, slug, factory), optional
        Pages to offer; default `VIEWS`.
    view : str, optional
        Slug of the page shown first; default the first.
    """

    model_name = param.Selector(default=DEFAULT_MODEL, objects=[DEFAULT_MODEL], label="Model",
                                doc="Model every page runs; switching reloads the pages.")
    prompt = param.String(default=DEFAULT_PROMPT, label="Prompt",
                          doc="Prompt shared by every page (press Enter to run).")
    view = param.Selector(default=None, objects=[], label="Page",
                          doc="Which page is shown; the prompt, selection and edits in this "
                              "sidebar go with you to every page.")
    cache = param.String(default="", precedence=-1, doc="Activation cache status line.")
    loading = param.Boolean(default=False, precedence=-1, doc="A model is loading.")
    remote_status = param.String(default="", precedence=-1,
                                 doc="Latest status of this session's remote (NDIF) job.")
    state_message = param.String(default="", precedence=-1,
                                 doc="What the last state import did, or why it failed.")
    page_revision = param.Integer(default=0, precedence=-1,
                                  doc="Bumped when the page shown changes a setting or a result "
                                      "(its snippet follows).")
    link_message = param.String(default="", precedence=-1,
                                doc="Why the link this session opened could not be followed.")
    link_note = param.String(default="", precedence=-1,
                             doc="What the last Copy link copied.")
    prompt_info = param.String(default="", precedence=-1,
                               doc="The prompt box's length in tokens and the limit.")

    def __init__(self, model_name: str = DEFAULT_MODEL, *, views: Sequence[tuple] | None = None,
                 view: str | None = None, remote: bool = False, home: bool = False,
                 **params: Any):
        super().__init__(**params)
        self._remote = bool(remote)
        self._specs = {slug: (title, factory) for title, slug, factory in (views or VIEWS)}
        if home:
            titles = {slug: title for slug, (title, _) in self._specs.items()}
            self._specs = {"home": ("Home", lambda _m: HomeView(titles)), **self._specs}
        if not self._specs:
            raise ValueError("a gallery needs at least one view.")
        self.param.model_name.objects = _model_choices(model_name)
        self.param.view.objects = list(self._specs)
        if view is not None:
            check_choice("view", view, self._specs)
        self._model = get_model(model_name, remote=self._remote)
        self.workspace = Workspace.from_model(self._model, prompts=[self.prompt])
        self._pending_settings: dict[str, dict[str, Any]] = {}  # slug -> settings to apply
        self._address = AddressBar(titles={t: s for s, (t, _) in self._specs.items()},
                                   height=0, width=0, margin=0, visible=True)
        self._address.param.watch(self._address_popped, "popped")
        self._pending_state: Workspace | None = None
        self._pushing_selection = False  # pages following the workspace: not a user's pick
        self._pushing_items = False  # boxes following the workspace: not the user's typing
        self._own_boxes: dict[str, tuple[param.Parameterized, str]] = {}  # slug -> (obj, param)
        self._choices: list[pn.widgets.MultiChoice] = []  # the sidebar's selection widgets
        self.add_message = ""  # why the last text typed in *Add to selection* was not added
        self._hooks = session_hooks()
        self._hooks.on_remote_status = self._show_remote_status
        self._pages: dict[str, pn.viewable.Viewer] = {}
        self._main = pn.Column(sizing_mode="stretch_width")
        self._loader = Runner(on_result=self._model_loaded, on_error=self._model_failed,
                              on_busy=lambda busy: None, background=_served())
        self._loader.bind_session()
        if _served():
            pn.state.on_session_destroyed(lambda _ctx: self.close())
        self.model_name = model_name
        self.param.watch(self._show_page, "view")
        self.param.watch(self._share_prompt, "prompt")
        self.param.watch(self._switch_model, "model_name")
        self.workspace.param.watch(self._prompt_from_workspace, "prompts")
        self.workspace.param.watch(self._share_selection, "selected")
        self.workspace.param.watch(self._share_page_selections, list(PAGE_SELECTIONS))
        self.workspace.param.watch(self._share_edits, "edits")
        self.workspace.param.watch(self._share_items, "items")
        self.workspace.param.watch(self._update_address, ["prompts", "selected", "selected_edges",
                                                          "selected_positions", "edits"])
        self.param.watch(self._update_address, ["view", "page_revision"])
        self.refresh_cache()
        self.view = view or next(iter(self._specs))

    # -- pages ---------------------------------------------------------------------------
    @property
    def titles(self) -> dict[str, str]:
        """Slug -> title of every page on offer, in navigation order."""
        return {slug: title for slug, (title, _) in self._specs.items()}

    @property
    def pages(self) -> dict[str, pn.viewable.Viewer]:
        """The pages built so far in this session, by slug."""
        return dict(self._pages)

    @property
    def model(self) -> explorer.Model:
        return self._model

    def page(self, slug: str) -> pn.viewable.Viewer:
        """The view behind ``slug``, built on first use."""
        if slug not in self._pages:
            _, factory = self._specs[slug]
            view = factory(self._model)
            if "prompt" in view.param:
                view.param["prompt"].precedence = -1  # the sidebar's prompt drives it
                view.prompt = self.prompt
                view.param.watch(self._prompt_from_page, "prompt")
            if "highlighted" in view.param:
                view.highlighted = list(self.workspace.selected)
            if "selected" in view.param:
                self._selection_to_page(view, self.workspace.selected)
                view.param.watch(self._selection_from_page, "selected")
            for name in PAGE_SELECTIONS:
                if isinstance(view.param[name] if name in view.param else None, param.List):
                    setattr(view, name, list(getattr(self.workspace, name)))
                    view.param.watch(self._page_selection_changed, name)
            if "edits" in view.param:  # the page runs the model with the workspace's edits
                view.edits = list(self.workspace.edits)
            self._pages[slug] = view
            settings = self._pending_settings.pop(slug, None)
            if settings:
                self._apply_settings(slug, view, settings)
            view.param.watch(lambda *events, slug=slug: self._page_changed(slug, events),
                             [n for n in view.param if n not in _NOT_SNIPPET])
            if hasattr(view, "set_sources"):
                view.set_sources(self.page_results)
            self._connect_own_items(slug, view)
        return self._pages[slug]

    def page_results(self) -> list[xr.Dataset]:
        """Every Dataset the session's pages hold in their parameters (what the atlas reads)."""
        out = []
        for view in self._pages.values():
            if hasattr(view, "set_sources"):
                continue
            out += [v for v in view.param.values().values() if isinstance(v, xr.Dataset)]
        return out

    def _page_changed(self, slug: str, events: Sequence[Any]) -> None:
        if slug == self.view:
            self.page_revision += 1

    # -- links: the address bar, Copy link, the pages' settings ----------------------------------
    def page_settings(self, slug: str) -> dict[str, Any]:
        """The settings of page ``slug`` a link and the export carry: its ``link_params``
        (empty for a page not built yet or without any)."""
        view = self._pages.get(slug)
        out: dict[str, Any] = {}
        for name in getattr(view, "link_params", ()) or ():
            if name in view.param:
                value = getattr(view, name)
                out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def _apply_settings(self, slug: str, view: Any, settings: dict[str, Any]) -> list[str]:
        """Set ``settings`` on the page; a name it does not carry or a value it refuses is
        left as it is, and said (returned and shown under the link message)."""
        allowed = set(getattr(view, "link_params", ()) or ())
        problems = []
        for name, value in settings.items():
            if name not in allowed or name not in view.param:
                problems.append(f"{self.titles.get(slug, slug)} has no setting {name!r} that "
                                f"links carry (it carries {', '.join(sorted(allowed)) or 'none'})")
                continue
            try:
                setattr(view, name, value)
            except (ValueError, TypeError, ExplorerError) as exc:
                problems.append(f"{self.titles.get(slug, slug)}: {name} = {value!r} refused: {exc}")
        if problems:
            self._link_problem("; ".join(problems))
        return problems

    def link(self) -> tuple[str, int]:
        """The query string of a link to what this session shows (``?view=<slug>&s=<state>``,
        `explorer.workspace.workspace_link`), and how many edits it leaves out."""
        ws = self.workspace
        settings = self.page_settings(self.view)
        plain = (ws.prompts == [DEFAULT_PROMPT] and not ws.selection and not ws.edits
                 and not settings)
        if plain:
            return f"?view={self.view}", 0
        state, left_out = workspace_link(ws, view=self.view, settings=settings)
        return f"?view={self.view}&s={state}", left_out

    def _update_address(self, *_: Any) -> None:
        try:
            query, _ = self.link()
        except ExplorerError as exc:  # a setting a link cannot hold: the page alone
            query = f"?view={self.view}"
            self.link_note = f"The link holds the page only: {exc}"
        if self._address.query != query:
            self._address.query = query

    def _address_popped(self, event: Any) -> None:
        """Back / Forward or a page link: open the page the address names."""
        search = (event.new or "").split("#", 1)[0]
        from urllib.parse import parse_qs

        slug = (parse_qs(search.lstrip("?")).get("view") or [None])[0]
        if slug is None:
            slug = next(iter(self._specs))
        if slug in self._specs:
            if self.view != slug:
                self.view = slug
            else:
                self._update_address()
        else:
            self._link_problem(f"there is no page {slug!r}; the pages are "
                               f"{', '.join(self._specs)}")

    def _link_problem(self, text: str) -> None:
        message = f"This link could not be opened as it was: {text}."
        self.link_message = message if not self.link_message else f"{self.link_message} {text}."
        if _served() and not pn.state.loaded:  # the page is still opening: once it shows
            pn.state.onload(lambda: theme.notify("error", message, duration=10000))
        else:
            theme.notify("error", message, duration=10000)
        if self.view is not None:
            self._show_page()

    def open_link(self, view: str | None = None, state: str | None = None) -> bool:
        """Open what a link holds: the page ``view`` and the ``state`` text
        (`explorer.workspace.read_link`: prompt, selection, edits, the page's settings). A
        link that cannot be read or does not fit this app's model opens the page alone (or
        the first page) with a message saying why; returns whether all of it was followed."""
        ok = True
        if state:
            try:
                link = read_link(state, model=self._model)
                self._check_prompt(link.workspace.prompt)
            except ExplorerError as exc:
                self._link_problem(str(exc).rstrip("."))
                ok = False
            else:
                if view is not None and link.view is not None and link.view != view:
                    self._link_problem(f"its page is {view!r} but its state was written on "
                                       f"{link.view!r}")
                    ok = False
                view = view or link.view
                self.workspace.update_from(link.workspace)
                if link.settings and view in self._specs:
                    if view in self._pages:
                        ok = not self._apply_settings(view, self._pages[view], link.settings) and ok
                    else:
                        self._pending_settings[view] = dict(link.settings)
        if view is not None:
            if view in self._specs:
                self.view = view
            else:
                self._link_problem(f"there is no page {view!r}; the pages are "
                                   f"{', '.join(self._specs)}")
                ok = False
        self._update_address()
        return ok

    def _open_session_link(self) -> None:
        """The link this browser session was opened with (its query arguments)."""
        args = getattr(pn.state, "session_args", None) or {}

        def arg(name: str) -> str | None:
            values = args.get(name)
            if not values:
                return None
            value = values[0]
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

        view, state = arg("view"), arg("s")
        if view is not None or state is not None:
            self.open_link(view, state)

    # -- the page's data and code ------------------------------------------------------------
    def export_page_data(self, slug: str | None = None) -> bytes:
        """The page ``slug``'s (default: the one shown) data zip (`View.export_bytes`), with the
        gallery page and the workspace state in its manifest."""
        slug = self.view if slug is None else slug
        view = self.page(slug)
        extra = {"gallery_page": slug, "workspace": json.loads(self.workspace.to_json())}
        return view.export_bytes(extra=extra)

    def page_code(self, slug: str | None = None) -> str:
        """Python that recomputes what the page ``slug`` (default: the one shown) shows."""
        view = self.page(self.view if slug is None else slug)
        code = view.code_snippet() if hasattr(view, "code_snippet") else ""
        if self.workspace.edits and "edits_from_json" not in code:
            code += ("# The workspace's edits are not in this snippet: the Workspace's "
                     "'Copy as code' rebuilds them.\n")
        return code

    def _link_copied(self, *_: Any) -> None:
        query, left_out = self.link()
        text = f"Link copied ({len(query):,} characters)."
        if left_out:
            text += (f" {left_out} edit(s) holding a vector are not in it: Export state keeps "
                     "them.")
        self.link_note = text

    def _page_data_name(self, *_: Any) -> str:
        return f"explorer-{self.view}.zip"

    def page_widgets(self) -> list[pn.viewable.Viewable]:
        """The sidebar's part for the page shown: export its data, copy it as code."""
        download = pn.widgets.FileDownload(callback=lambda: io.BytesIO(self.export_page_data()),
                                           filename=self._page_data_name(),
                                           label="Export page data", color="light",
                                           sizing_mode="stretch_width",
                                           css_classes=["export-page-data"])
        self.param.watch(lambda e: setattr(download, "filename", self._page_data_name()), "view")

        def code(*_: Any) -> str:
            try:
                return "```python\n" + self.page_code() + "```"
            except Exception as exc:  # noqa: BLE001 - a page's snippet must not break the sidebar
                return f"The page could not write its snippet: {user_message(exc)}"

        pane = pn.pane.Markdown(pn.bind(code, self.param.view, self.param.page_revision),
                                sizing_mode="stretch_width", css_classes=["page-code"],
                                stylesheets=[_CODE_CSS])
        copy = pn.widgets.Button(label="Copy link", color="light", sizing_mode="stretch_width",
                                 css_classes=["copy-link"],
                                 description="Copy a link to this view: the page, the prompt, "
                                             "the selection, the edits and the page's settings.")
        copy.js_on_click(code="""
const url = window.location.href
if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(url).catch(() => {})
window.__explorerCopied = url
""")
        copy.on_click(self._link_copied)
        note = pn.pane.Markdown(self.param.link_note, css_classes=["link-note"], margin=(0, 10),
                                styles={"color": "#555", "font-size": "0.85em"})
        return [pn.pane.Markdown("### This page"), pn.Row(download, copy, margin=0), note,
                pn.Card(pane, title="Copy page as code", collapsed=True, margin=(5, 10),
                        sizing_mode="stretch_width", css_classes=["page-code-card"])]

    def _show_page(self, event: Any = None) -> None:
        head = [intro_pane(self.view)] if self.view in INTROS else []
        view = self.page(self.view)
        if hasattr(view, "set_sources") and hasattr(view, "refresh"):
            view.refresh()  # what the other pages computed since it was last shown
        if self.link_message:
            head.insert(0, pn.pane.Markdown(self.link_message, css_classes=["link-message"],
                                            sizing_mode="stretch_width",
                                            styles={"color": "#b00020"}))
        if callable(getattr(view, "scope", None)):
            head.append(pn.pane.Markdown(
                pn.bind(lambda *_: scope_line(view), self.param.page_revision,
                        self.workspace.param.edits, self.workspace.param.prompts,
                        self.workspace.param.selected),
                css_classes=["page-scope"], sizing_mode="stretch_width", margin=(0, 10),
                styles={"color": "#444", "font-size": "0.9em"}))
        layout = pn.panel(view)
        _unclamped_numbers(layout)
        self._main.objects = [*head, layout]

    def _share_prompt(self, event: Any) -> None:
        self.workspace.prompt = event.new
        for view in self._pages.values():
            if "prompt" in view.param and view.prompt != event.new:
                view.prompt = event.new

    def _prompt_from_workspace(self, event: Any) -> None:
        # a loaded state: the sidebar and every page follow
        if self.workspace.prompt != self.prompt:
            self.prompt = self.workspace.prompt

    # -- selection -------------------------------------------------------------------------
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
            for view in self._pages.values():
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
                for view in self._pages.values():
                    if (event.name in view.param
                            and list(getattr(view, event.name)) != list(event.new)):
                        setattr(view, event.name, list(event.new))
        finally:
            self._pushing_selection = False

    def add_to_selection(self, text: str) -> list[str]:
        """Select what ``text`` names: components, edges (``L3.H1->L5.MLP``) and positions
        (``P5``), separated by commas or semicolons. Returns the names added; for text that
        cannot be read nothing is added and `add_message` says why (also raised)."""
        parts = [t.strip() for t in re.split(r"[,;]", text or "") if t.strip()]
        try:
            added = self.workspace.select(*parts) if parts else []
        except InputError as exc:
            self.add_message = str(exc)
            raise
        self.add_message = ""
        return added

    def _share_edits(self, event: Any) -> None:
        for view in self._pages.values():
            if "edits" in view.param and list(view.edits) != list(event.new):
                view.edits = list(event.new)

    def _prompt_from_page(self, event: Any) -> None:
        # a page changed its prompt (a loaded state): the sidebar and other pages follow
        if self.prompt != event.new:
            self.prompt = event.new

    # -- the user's own items ----------------------------------------------------------------
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
                self._item_to_page(slug, text)

    # -- model ---------------------------------------------------------------------------
    def _switch_model(self, event: Any) -> None:
        if event.new == self._model.spec.name:
            return
        self.loading = True
        name = event.new
        self._loader.submit(lambda token: get_model(name, remote=self._remote))

    def _model_loaded(self, model: explorer.Model) -> None:
        self.loading = False
        self.close_pages()
        self._model = model
        dropped, gone = self.workspace.set_model(model)
        for choice in self._choices:
            choice.options = self._selection_options()
        pending, self._pending_state = self._pending_state, None
        if pending is not None and pending.model_name == model.spec.name:
            try:  # checked against the loaded model's shape now
                self._apply_state(Workspace.from_state(pending.state(), model=model))
            except ExplorerError as exc:
                self.state_message = f"Could not import the state: {exc}"
                theme.notify("error", f"Could not import the state: {exc}")
        self._show_page()
        theme.notify("success", f"Loaded {model.spec.name}.", duration=3000)
        if dropped or gone:
            theme.notify("warning", f"{model.spec.name} has no {', '.join(dropped) or ''}"
                         f"{'; ' if dropped and gone else ''}"
                         f"{f'{len(gone)} edit(s) did not fit it' if gone else ''}: dropped.")

    def _model_failed(self, exc: BaseException) -> None:
        self.loading = False
        self._pending_state = None
        theme.notify("error", f"Could not load the model: {user_message(exc)}")
        self.model_name = self._model.spec.name  # the selector shows the model still running

    # -- state ---------------------------------------------------------------------------
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
            if slug in self._pages:
                self._apply_settings(slug, self._pages[slug], settings)
            else:
                self._pending_settings[slug] = dict(settings)
        self.workspace.update_from(state)
        n, e = len(state.selected), len(state.edits)
        items = f", {len(state.items)} pasted item(s)" if state.items else ""
        self.state_message = (f"Imported: {len(state.prompts)} prompt(s), {n} selected, "
                              f"{e} edit(s){items}.")

    def _state_file(self, event: Any) -> None:
        if event.new:
            self.import_state(event.new)

    def ablate_selected(self, *_: Any) -> None:
        """Push a zero-ablation of every selected head not already ablated."""
        have = {(e.layer, e.head) for e in self.workspace.edits if isinstance(e, Ablate)}
        for layer, head in self.workspace.selected_heads:
            if (layer, head) not in have:
                self.workspace.push_edit(Ablate(layer, head))

    # -- the component menu ----------------------------------------------------------------
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
            description="The workspace's selection: components, circuit edges and token "
                        "positions. Click a head, node or token on a page to select it, or "
                        "type in the box below to add by name; ✕ on a chip drops it.")
        add = pn.widgets.TextInput(
            label="Add to selection", placeholder="L3.H1, L3.H1->L5.MLP, P5 (Enter)",
            sizing_mode="stretch_width", css_classes=["workspace-add"],
            description="A head (L3.H1), an MLP (L3.MLP), a layer (L3), input / logits, a "
                        "circuit edge (L3.H1->L5.MLP) or a token position of the prompt (P5); "
                        "several separated by commas. Press Enter to add.")
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
        code = pn.pane.Markdown(pn.bind(lambda *_: "```python\n" + ws.copy_as_code() + "```",
                                        ws.param.prompts, ws.param.selected,
                                        ws.param.selected_edges, ws.param.selected_positions,
                                        ws.param.edits),
                                sizing_mode="stretch_width", css_classes=["workspace-code"],
                                stylesheets=[_CODE_CSS])
        return [pn.pane.Markdown("### Workspace"), choice, add, message,
                pn.bind(self.component_menu, ws.param.selected),
                pn.pane.Markdown("**Edits**"), pn.bind(self._edit_rows, ws.param.edits), ablate,
                export, pn.pane.Markdown("Import state (JSON):"), upload,
                pn.pane.Markdown(self.param.state_message, css_classes=["state-message"]),
                pn.Card(code, title="Copy as code", collapsed=True, sizing_mode="stretch_width",
                        css_classes=["workspace-code-card"], margin=(5, 10))]

    def refresh_cache(self, *_: Any) -> None:
        self.cache = cache_status()

    # -- remote (NDIF) ---------------------------------------------------------------------
    def _show_remote_status(self, status: Any) -> None:
        """A status update of one of this session's remote jobs (queued, running, done)."""
        text = f"NDIF job `{status.job_id[:8]}`: **{status.status}** ({status.elapsed_s:.1f} s)"
        if status.status == "ERROR" and status.description:
            text += f": {status.description[:200]}"
        self.remote_status = text

    def stop(self, *_: Any) -> None:
        """Stop every page's running work in this session (remote jobs included)."""
        stopped = self._hooks.stop_all()
        if stopped:
            self.remote_status = (self.remote_status + " - stopped") if self.remote_status else ""
            theme.notify("info", f"Stopped {stopped} running job{'s' if stopped > 1 else ''}.",
                         duration=3000)

    def close_pages(self) -> None:
        for view in self._pages.values():
            close = getattr(view, "close", None)
            if close is not None:
                close()
        self._pages.clear()
        self._own_boxes.clear()

    def close(self) -> None:
        """Cancel every page's work (the session is gone)."""
        self._loader.close()
        self.close_pages()

    # -- layout ----------------------------------------------------------------------------
    def sidebar(self) -> list[pn.viewable.Viewable]:
        # no tooltip on the navigation: Bokeh's stayed over the page after the mouse left it
        nav = pn.widgets.RadioButtonGroup.from_param(
            self.param.view, options={title: slug for slug, title in self.titles.items()},
            orientation="vertical", color="primary", variant="outline",
            sizing_mode="stretch_width", label="", description=None, css_classes=["gallery-nav"])
        model = pn.widgets.Select.from_param(self.param.model_name, sizing_mode="stretch_width",
                                             disabled=self.param.loading)
        prompt = self.prompt_box()
        loading = pn.Row(pn.indicators.LoadingSpinner(value=True, size=20),
                         pn.pane.Str("Loading model…"), visible=self.param.loading)
        refresh = pn.widgets.Button(label="Refresh cache status", color="light",
                                    sizing_mode="stretch_width")
        refresh.on_click(self.refresh_cache)
        stop = pn.widgets.Button(label="Stop running work", color="warning",
                                 sizing_mode="stretch_width", css_classes=["stop-work"])
        stop.on_click(self.stop)
        remote = [pn.pane.Markdown(f"Running on NDIF (`{self._model.spec.name}`)"),
                  pn.pane.Markdown(self.param.remote_status, css_classes=["remote-status"])
                  ] if self._remote else []
        return [pn.pane.Markdown("### Pages"), nav, pn.layout.Divider(), model, loading, *prompt,
                *remote, stop, pn.layout.Divider(), *self.workspace_widgets(), pn.layout.Divider(),
                *self.page_widgets(), pn.layout.Divider(),
                pn.pane.Markdown(self.param.cache, css_classes=["cache-status"]), refresh]

    def template(self) -> pn.template.FastListTemplate:
        """This session's page: the theme's template around the sidebar and the current page;
        served, it opens the link it was asked for (`open_link`) and keeps the address bar
        equal to the view (`AddressBar`)."""
        pn.extension("tabulator")  # the Head atlas table: its script must be in the first page
        if _served():
            self._open_session_link()
        return theme.page([self._main], sidebar=self.sidebar(), header=[self._address])

    # -- the prompt box ---------------------------------------------------------------------
    @property
    def prompt_limit(self) -> int:
        """The longest prompt the sidebar takes, in tokens: `MAX_PROMPT_TOKENS`, or the
        model's context when that is shorter."""
        return min(MAX_PROMPT_TOKENS, int(getattr(self._model.spec, "context_length", 0)
                                          or MAX_PROMPT_TOKENS))

    def count_tokens(self, text: str) -> int:
        """``text``'s length in tokens, as the pages tokenise it (no special tokens)."""
        return len(self._model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_prompt(self, text: str) -> int:
        """The prompt's length in tokens; InputError saying the limit when it is over it."""
        limit = self.prompt_limit
        if not text.strip():
            raise InputError("the prompt is empty; type at least one non-space character.")
        if len(text) > MAX_PROMPT_CHARS:
            raise InputError(f"the prompt has {len(text):,} characters; the sidebar takes at "
                             f"most {limit:,} tokens ({MAX_PROMPT_CHARS:,} characters).")
        n = self.count_tokens(text)
        if n > limit:
            raise InputError(f"the prompt is {n:,} tokens; the sidebar takes at most {limit:,} "
                             f"tokens ({self._model.spec.name}). Shorten it; nothing was cut.")
        return n

    def _prompt_line(self, text: str) -> str:
        try:
            n = self._check_prompt(text)
        except InputError as exc:
            what = "Too long" if "at most" in str(exc) else "Not run"
            return f"<span style='color:#b00020'>{what}: {exc}</span>"
        return f"{n:,} / {self.prompt_limit:,} tokens · Enter runs it"

    def submit_prompt(self, text: str) -> bool:
        """The prompt typed in the sidebar: shared with every page when it fits the limit;
        refused (one notification saying the limit, the text kept in the box) when not."""
        try:
            self._check_prompt(text)
        except InputError as exc:
            theme.notify("warning", f"Prompt not run: {exc}", duration=8000)
            self.prompt_info = self._prompt_line(text)
            return False
        self.prompt = text
        return True

    def prompt_box(self) -> list[pn.viewable.Viewable]:
        """The sidebar's prompt box (nothing cut: a prompt over the limit is refused with a
        message) and the line under it: its length in tokens and the limit, as you type."""
        box = pn.widgets.TextInput(label="Prompt", value=self.prompt, max_length=MAX_PROMPT_CHARS,
                                   sizing_mode="stretch_width", css_classes=["prompt-box"],
                                   placeholder="Enter a prompt and press Enter",
                                   description=self.param.prompt.doc)
        self.prompt_info = self._prompt_line(self.prompt)
        info = pn.pane.HTML(self.param.prompt_info, css_classes=["prompt-info"], margin=(0, 10),
                            styles={"color": "#555", "font-size": "0.85em"},
                            sizing_mode="stretch_width")

        def typed(event: Any) -> None:
            self.prompt_info = self._prompt_line(event.new or "")

        def entered(event: Any) -> None:
            if event.new != self.prompt:
                self.submit_prompt(event.new)

        def follow(event: Any) -> None:  # a loaded state or link: the box shows its prompt
            if box.value != event.new:
                box.value = event.new
            self.prompt_info = self._prompt_line(event.new)

        box.param.watch(typed, "value_input")
        box.param.watch(entered, "value")
        self.param.watch(follow, "prompt")
        return [box, info]

    def __panel__(self) -> pn.viewable.Viewable:
        # outside the template (Jupyter) the page sits two levels deeper than when served
        # alone: the layout fix is what lets its nested plots draw
        return pn.Row(pn.Column(*self.sidebar(), theme.NestedLayoutFix(),
                                width=theme.SIZES["sidebar_width"]), self._main,
                      sizing_mode="stretch_width")


JUICE_NOTE = ("The Knowledge conflicts page of this version cannot take heads from this menu; "
              "click the head there (its *clicks add to* toggle picks S+ or S-).")


def _own_items_source(view: Any, name: str) -> tuple[param.Parameterized, str] | None:
    """(object, parameter) holding the text of ``view``'s "Your own" box: the page's string
    parameter ``name``, or the ``value`` of the text area of its box ``name``; None if none."""
    if name in view.param and isinstance(view.param[name], param.String):
        return view, name
    area = getattr(getattr(view, name, None), "area", None)
    if isinstance(area, pn.widgets.TextAreaInput):
        return area, "value"
    return None


def _unclamped_numbers(layout: Any) -> None:
    """Let the number boxes of a page send what was typed: Bokeh's box clamps a value to its
    bounds (or keeps it from the page) without a word. Without the bounds in the browser the
    page's Parameter refuses it, and `apps.theme.widget_error` says what is allowed while
    the box goes back to the value kept."""
    kinds = (pn.widgets.IntInput, pn.widgets.FloatInput)
    for widget in layout.select(lambda o: isinstance(o, kinds)):
        if widget.start is not None or widget.end is not None:
            widget.param.update(start=None, end=None)


def _served() -> bool:
    doc = pn.state.curdoc
    return doc is not None and doc.session_context is not None


def create_app(model_name: str = DEFAULT_MODEL, *, view: str | None = None,
               remote: bool = False) -> pn.template.FastListTemplate:
    """A fresh app for one browser session: its own gallery and views around a shared model,
    the home page first (a link's ``?view=<slug>`` opens its page)."""
    theme.enable_extension()
    return Gallery(model_name, view=view, remote=remote, home=True).template()


def serve(*, model: str = DEFAULT_MODEL, port: int = 5006, address: str = "127.0.0.1",
          show: bool = False, allow_websocket_origin: Sequence[str] | None = None,
          remote: bool = False, heavy_jobs: int | None = None, **kwargs: Any) -> Any:
    """Serve the gallery (blocking unless ``threaded=True``); binds 127.0.0.1 by default.

    ``heavy_jobs``: how many heavy analyses run at once (`apps._server`; default one per two
    cores). Sign-in options (``basic_auth``, ``oauth_provider``, ``cookie_secret``, ...) go to
    `panel.serve` with ``kwargs``; ``explorer serve`` requires one off loopback.

    The model loads before the server starts, so a bad name fails here, once. With
    ``remote=True`` every page runs the model on NDIF (`explorer.remote`).
    ``kwargs`` go to `panel.serve`.
    """
    get_model(model, remote=remote)
    if heavy_jobs is not None:
        set_heavy_job_limit(heavy_jobs)
    theme.enable_extension()
    origins = list(allow_websocket_origin) if allow_websocket_origin else served_origins(address, port)
    def app() -> pn.template.FastListTemplate:
        return create_app(model, remote=remote)

    return pn.serve({"/": app}, port=port, address=address, show=show,
                    websocket_origin=origins, title=theme.TITLE, **with_sign_in_pages(kwargs))


if pn.state.served:
    create_app(os.environ.get("EXPLORER_MODEL", DEFAULT_MODEL)).servable()
