"""The app shell: every view as a page, with a shared sidebar (model, prompt, workspace, cache).

Serve it with ``python -c "from apps.gallery import serve; serve()"`` or
``panel serve apps/gallery.py`` (model from ``$EXPLORER_MODEL``, default smollm2-135m).
A page is added with its title in `apps._page_titles.PAGE_TITLES` and its class in
``_FACTORIES`` (`VIEWS` pairs them, in navigation order); ``factory(model)`` returns a
``pn.viewable.Viewer``. A view with a ``prompt`` parameter follows the sidebar's
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
with a ``selected_edges`` (list of edge names), ``selected_positions`` (list of token
positions) or ``selected_features`` (list of dictionary features, ``L5.F123``) parameter
gets the workspace's list and its changes to it (a click) select and deselect in the
workspace; a page with ``set_sources`` (the head atlas) reads
the Datasets the session's pages hold.

Under the selection, a small menu offers what applies to the newest selected component
(`Gallery.menu_actions`): show a head's attention on the prompt, ablate or scale a head (each
pushes an edit), add a head to the Knowledge conflicts page's JuICE sets, show a head's or an
MLP's circuit edges. The text pasted in a page's "Your own" box (`OWN_ITEMS`) is kept in the
workspace (`Workspace.items`), so it travels in the exported state and comes back on import.

The sidebar's *This page* part exports the page shown: *Export page data* downloads its
Datasets as NetCDF, its tables as CSV, its snippet and a manifest (with the workspace state) in
one zip (`apps._view.View.export_bytes`); *Copy page as code* copies the Python that recomputes
it (`apps._view.View.code_snippet`, following the page's settings) to the clipboard and shows
it in a dialog over the page (`apps._copy_code.CopyCode`).
"""
from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import panel as pn
import param
import xarray as xr
from tornado.ioloop import IOLoop

import explorer
from apps import theme
from apps._address_bar import AddressBar, LinksPart
from apps._component_menu import ComponentMenuPart, MENU_ACTIONS
from apps._copy_code import CopyCode
from apps._intros import INTROS, intro_pane
from apps._page_titles import PAGE_TITLES
from apps._prompt_box import MAX_PROMPT_TOKENS, PromptBoxPart
from apps._result_cache import start_warmup
from apps._server import served_origins, set_heavy_job_limit, with_sign_in_pages
from apps._session import Runner, get_model, served_document, session_hooks, user_message
from apps._view import scope_line
from apps._workspace_sharing import OWN_ITEMS, PAGE_SELECTIONS, SharingPart
from apps._workspace_sidebar import WorkspaceSidebarPart
from apps.atlas import AtlasView
from apps.attention import AttentionView
from apps.circuits import CircuitsView
from apps.compare import CompareView
from apps.conflicts import ConflictsView
from apps.dla import DLAView
from apps.features import FeaturesView
from apps.home import HomeView
from apps.icl_heads import ICLHeadsView
from apps.itda import ITDAView
from apps.lens import LensView
from apps.linear_icl import LinearICLView
from apps.neuron_eval import NeuronEvalView
from apps.parity import ParityView
from apps.patching import PatchingView
from apps.saturation import SaturationView
from apps.shattering import ShatteringView
from apps.study_builder import StudyBuilderView, participant_page
from apps.task_emergence import TaskEmergenceView
from apps.unlearning import UnlearningView
from explorer._checks import ExplorerError, check_choice
from explorer.defaults import DEFAULT_MODEL
from explorer.workspace import Workspace

__all__ = ["VIEWS", "DEFAULT_PROMPT", "MENU_ACTIONS", "OWN_ITEMS", "PAGE_SELECTIONS", "Gallery",
           "AddressBar", "MAX_PROMPT_TOKENS", "create_app", "serve"]

DEFAULT_PROMPT: str = Workspace.param["prompts"].default[0]
"""The sidebar's prompt on opening: the workspace's."""

ViewFactory = Callable[[explorer.Model], pn.viewable.Viewer]

_FACTORIES: dict[str, ViewFactory] = {
    "lens": LensView, "saturation": SaturationView, "conflicts": ConflictsView,
    "icl-heads": ICLHeadsView, "itda": ITDAView, "neuron-eval": NeuronEvalView,
    "parity": ParityView, "linear-icl": LinearICLView, "task-emergence": TaskEmergenceView,
    "circuits": CircuitsView, "shattering": ShatteringView, "unlearning": UnlearningView,
    "attention": AttentionView, "atlas": AtlasView,
    "dla": DLAView, "features": FeaturesView, "compare": CompareView,
    "patching": PatchingView, "study": StudyBuilderView,
}

# (title, slug, factory): the navigation, in order (`PAGE_TITLES`). Later pages append theirs.
VIEWS: list[tuple[str, str, ViewFactory]] = [
    (title, slug, _FACTORIES[slug]) for slug, title in PAGE_TITLES.items()]


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


class Gallery(LinksPart, SharingPart, ComponentMenuPart, WorkspaceSidebarPart, PromptBoxPart,
              pn.viewable.Viewer):
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
        self._items_behind: set[str] = set()  # pages whose box the workspace's item changed
        self._choices: list[pn.widgets.MultiChoice] = []  # the sidebar's selection widgets
        self.add_message = ""  # why the last text typed in *Add to selection* was not added
        self._hooks = session_hooks()
        self._hooks.on_remote_status = self._show_remote_status
        self._hooks.on_active = self._show_active
        self._pages: dict[str, pn.viewable.Viewer] = {}
        self._main = pn.Column(sizing_mode="stretch_width")
        self._loader = Runner(on_result=self._model_loaded, on_error=self._model_failed,
                              on_busy=lambda busy: None, background=served_document() is not None)
        self._loader.bind_session()
        if served_document() is not None:
            pn.state.on_session_destroyed(lambda _ctx: self.close())
        self.model_name = model_name
        self.param.watch(self._show_page, "view")
        self.param.watch(self._share_prompt, "prompt")
        self.param.watch(self._switch_model, "model_name")
        self.workspace.param.watch(self._prompt_from_workspace, "prompts")
        self.workspace.param.watch(self._share_second_prompt, "second_prompt")
        self.workspace.param.watch(self._share_selection, "selected")
        self.workspace.param.watch(self._share_page_selections, list(PAGE_SELECTIONS))
        self.workspace.param.watch(self._share_edits, "edits")
        self.workspace.param.watch(self._share_items, "items")
        self.workspace.param.watch(self._update_address, ["prompts", "second_prompt", "selected",
                                                          "selected_edges", "selected_positions",
                                                          "selected_features", "edits"])
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
            if "second_prompt" in view.param:  # the sidebar's second prompt drives it
                view.param["second_prompt"].precedence = -1
                view.second_prompt = self.workspace.second_prompt
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
            if hasattr(view, "set_gallery_pages"):  # a page that reads the other pages
                view.set_gallery_pages(lambda: self.pages)
            if hasattr(view, "set_edit_sink"):  # a page that adds edits to the workspace
                view.set_edit_sink(self.workspace.push_edit)
            if hasattr(view, "follow_workspace"):  # a page that marks its result outdated
                view.follow_workspace(self.workspace)  # when the workspace moves on
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
        # a page drawing a slider's preview (`previewing`) keeps its snippet, link and
        # scope line until the exact result of the released value is in
        if slug == self.view and not getattr(self._pages.get(slug), "previewing", False):
            self.page_revision += 1

    # -- links: the address bar, Copy link, the pages' settings ----------------------------------


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
                return self.page_code()
            except Exception as exc:  # noqa: BLE001 - a page's snippet must not break the sidebar
                return f"# The page could not write its snippet: {user_message(exc)}\n"

        copy_code = CopyCode(code=code(), label="Copy page as code",
                             title="This page as code: the Python that recomputes it",
                             css_classes=["page-code"])
        self.param.watch(lambda *_: setattr(copy_code, "code", code()),
                         ["view", "page_revision"])
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
                copy_code]

    def _show_page(self, event: Any = None) -> None:
        left = self._pages.get(getattr(event, "old", None))
        if left is not None and callable(getattr(left, "page_hidden", None)):
            left.page_hidden()  # its background work that only serves its own display stops
        head = [intro_pane(self.view)] if self.view in INTROS else []
        view = self.page(self.view)
        if callable(getattr(view, "page_shown", None)):
            view.page_shown()
        self.sync_page(self.view)  # what the workspace did while the page was not in view
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


    # -- selection -------------------------------------------------------------------------


    # -- the user's own items ----------------------------------------------------------------


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
        dropped, gone, second = self.workspace.set_model(model)
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
        if second:
            short = second if len(second) <= 60 else second[:57] + "..."
            theme.notify("warning", f"The second prompt {short!r} is longer than a prompt "
                         f"takes on {model.spec.name} ({self.workspace.prompt_limit:,} tokens): "
                         "removed from the workspace.", duration=0)

    def _model_failed(self, exc: BaseException) -> None:
        self.loading = False
        self._pending_state = None
        theme.notify("error", f"Could not load the model: {user_message(exc)}")
        self.model_name = self._model.spec.name  # the selector shows the model still running

    # -- state ---------------------------------------------------------------------------


    # -- the component menu ----------------------------------------------------------------


    def refresh_cache(self, *_: Any) -> None:
        self.cache = cache_status()

    # -- remote (NDIF) ---------------------------------------------------------------------
    def _show_remote_status(self, status: Any) -> None:
        """A status update of one of this session's remote jobs (queued, running, done)."""
        text = f"NDIF job `{status.job_id[:8]}`: **{status.status}** ({status.elapsed_s:.1f} s)"
        if status.status == "ERROR" and status.description:
            text += f": {status.description[:200]}"
        self.remote_status = text

    def _show_active(self, active: int) -> None:
        """The stop button is live (and orange) while this session has jobs to stop."""
        button = getattr(self, "_stop_button", None)
        if button is None:
            return
        button.param.update(disabled=active <= 0, button_type="warning" if active > 0 else "light",
                            name="Stop running work" + (f" ({active})" if active > 1 else ""))

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
        self._items_behind.clear()

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
        stop = self._stop_button = pn.widgets.Button(
            label="Stop running work", color="light", disabled=True,
            sizing_mode="stretch_width", css_classes=["stop-work"])
        stop.on_click(self.stop)
        self._show_active(self._hooks.active)
        remote = [pn.pane.Markdown(f"Running on NDIF (`{self._model.spec.name}`)"),
                  pn.pane.Markdown(self.param.remote_status, css_classes=["remote-status"])
                  ] if self._remote else []
        return [pn.pane.Markdown("### Pages"), nav, pn.layout.Divider(), model, loading, *prompt,
                self.second_prompt_box(), *remote, stop, pn.layout.Divider(), *self.workspace_widgets(), pn.layout.Divider(),
                *self.page_widgets(), pn.layout.Divider(),
                pn.pane.Markdown(self.param.cache, css_classes=["cache-status"]), refresh]

    def template(self) -> pn.template.FastListTemplate:
        """This session's page: the theme's template around the sidebar and the current page;
        served, it opens the link it was asked for (`open_link`) and keeps the address bar
        equal to the view (`AddressBar`)."""
        pn.extension("tabulator")  # the Head atlas table: its script must be in the first page
        if served_document() is not None:
            self._open_session_link()
        return theme.page([self._main], sidebar=self.sidebar(), header=[self._address])

    # -- the prompt box ---------------------------------------------------------------------


    def __panel__(self) -> pn.viewable.Viewable:
        # outside the template (Jupyter) the page sits two levels deeper than when served
        # alone: the layout fix is what lets its nested plots draw
        return pn.Row(pn.Column(*self.sidebar(), theme.NestedLayoutFix(),
                                width=theme.SIZES["sidebar_width"]), self._main,
                      sizing_mode="stretch_width")


def _unclamped_numbers(layout: Any) -> None:
    """Let the number boxes of a page send what was typed: Bokeh's box clamps a value to its
    bounds (or keeps it from the page) without a word. Without the bounds in the browser the
    page's Parameter refuses it, and `apps.theme.widget_error` says what is allowed while
    the box goes back to the value kept."""
    kinds = (pn.widgets.IntInput, pn.widgets.FloatInput)
    for widget in layout.select(lambda o: isinstance(o, kinds)):
        if widget.start is not None or widget.end is not None:
            widget.param.update(start=None, end=None)


def create_app(model_name: str = DEFAULT_MODEL, *, view: str | None = None,
               remote: bool = False) -> pn.template.FastListTemplate:
    """A fresh app for one browser session: its own gallery and views around a shared model,
    the home page first (a link's ``?view=<slug>`` opens its page)."""
    theme.enable_extension()
    return Gallery(model_name, view=view, remote=remote, home=True).template()


def serve(*, model: str = DEFAULT_MODEL, port: int = 5006, address: str = "127.0.0.1",
          show: bool = False, allow_websocket_origin: Sequence[str] | None = None,
          remote: bool = False, heavy_jobs: int | None = None, warm_cache: bool = True,
          **kwargs: Any) -> Any:
    """Serve the gallery (blocking unless ``threaded=True``); binds 127.0.0.1 by default.

    ``warm_cache``: once the server listens, a low-priority child process fills the pages'
    result cache for the cached pages' default inputs (`apps._result_cache.start_warmup`;
    not with ``remote``, ``threaded``, ``EXPLORER_WARM_CACHE=off`` or the cache off).

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

    if warm_cache and not remote and not kwargs.get("threaded"):
        # the first turn of the loop pn.serve starts: its server is listening by then
        IOLoop.current().add_callback(start_warmup, model)
    # /study: the participants of the studies opened on the User study page
    return pn.serve({"/": app, "/study": participant_page}, port=port, address=address, show=show,
                    websocket_origin=origins, title=theme.TITLE, **with_sign_in_pages(kwargs))


if pn.state.served:
    create_app(os.environ.get("EXPLORER_MODEL", DEFAULT_MODEL)).servable()
