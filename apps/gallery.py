"""The app shell: every view as a page, with a shared sidebar (model, prompt, cache status).

Serve it with ``python -c "from apps.gallery import serve; serve()"`` or
``panel serve apps/gallery.py`` (model from ``$EXPLORER_MODEL``, default smollm2-135m).
A page is added by appending ``(title, slug, factory)`` to `VIEWS`; ``factory(model)``
returns a ``pn.viewable.Viewer``. A view with a ``prompt`` parameter follows the sidebar's
prompt (and its own prompt widget is hidden); each page is built on first visit.
Every browser session gets its own `Gallery` and views; only loaded models are shared.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import panel as pn
import param

import explorer
from apps import theme
from apps._intros import INTROS, intro_pane
from apps._session import Runner, get_model, session_hooks, user_message
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
from explorer._checks import ExplorerError, check_choice

__all__ = ["VIEWS", "DEFAULT_PROMPT", "Gallery", "create_app", "serve"]

DEFAULT_MODEL = "smollm2-135m"
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
]


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
    view = param.Selector(default=None, objects=[], label="Page", doc="The page shown.")
    cache = param.String(default="", precedence=-1, doc="Activation cache status line.")
    loading = param.Boolean(default=False, precedence=-1, doc="A model is loading.")
    remote_status = param.String(default="", precedence=-1,
                                 doc="Latest status of this session's remote (NDIF) job.")

    def __init__(self, model_name: str = DEFAULT_MODEL, *, views: Sequence[tuple] | None = None,
                 view: str | None = None, remote: bool = False, **params: Any):
        super().__init__(**params)
        self._remote = bool(remote)
        self._specs = {slug: (title, factory) for title, slug, factory in (views or VIEWS)}
        if not self._specs:
            raise ValueError("a gallery needs at least one view.")
        self.param.model_name.objects = _model_choices(model_name)
        self.param.view.objects = list(self._specs)
        if view is not None:
            check_choice("view", view, self._specs)
        self._model = get_model(model_name, remote=self._remote)
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
            self._pages[slug] = view
        return self._pages[slug]

    def _show_page(self, event: Any = None) -> None:
        head = [intro_pane(self.view)] if self.view in INTROS else []
        self._main.objects = [*head, self.page(self.view)]

    def _share_prompt(self, event: Any) -> None:
        for view in self._pages.values():
            if "prompt" in view.param and view.prompt != event.new:
                view.prompt = event.new

    def _prompt_from_page(self, event: Any) -> None:
        # a page changed its prompt (a loaded state): the sidebar and other pages follow
        if self.prompt != event.new:
            self.prompt = event.new

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
        self._show_page()
        theme.notify("success", f"Loaded {model.spec.name}.", duration=3000)

    def _model_failed(self, exc: BaseException) -> None:
        self.loading = False
        theme.notify("error", f"Could not load the model: {user_message(exc)}")
        self.model_name = self._model.spec.name  # the selector shows the model still running

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

    def close(self) -> None:
        """Cancel every page's work (the session is gone)."""
        self._loader.close()
        self.close_pages()

    # -- layout ----------------------------------------------------------------------------
    def sidebar(self) -> list[pn.viewable.Viewable]:
        nav = pn.widgets.RadioButtonGroup.from_param(
            self.param.view, options={title: slug for slug, title in self.titles.items()},
            orientation="vertical", color="primary", variant="outline",
            sizing_mode="stretch_width", name="")
        model = pn.widgets.Select.from_param(self.param.model_name, sizing_mode="stretch_width",
                                             disabled=self.param.loading)
        prompt = pn.widgets.TextInput.from_param(self.param.prompt, sizing_mode="stretch_width",
                                                 placeholder="Enter a prompt and press Enter")
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
        return [pn.pane.Markdown("### Pages"), nav, pn.layout.Divider(), model, loading, prompt,
                *remote, stop, pn.layout.Divider(),
                pn.pane.Markdown(self.param.cache, css_classes=["cache-status"]), refresh]

    def template(self) -> pn.template.FastListTemplate:
        """This session's page: the theme's template around the sidebar and the current page."""
        tmpl = theme.page([self._main], sidebar=self.sidebar())
        if pn.state.location is not None and _served():
            pn.state.location.sync(self, {"view": "view"})
        return tmpl

    def __panel__(self) -> pn.viewable.Viewable:
        # outside the template (Jupyter) the page sits two levels deeper than when served
        # alone: the layout fix is what lets its nested plots draw
        return pn.Row(pn.Column(*self.sidebar(), theme.NestedLayoutFix(),
                                width=theme.SIZES["sidebar_width"]), self._main,
                      sizing_mode="stretch_width")


def _served() -> bool:
    doc = pn.state.curdoc
    return doc is not None and doc.session_context is not None


def create_app(model_name: str = DEFAULT_MODEL, *, view: str | None = None,
               remote: bool = False) -> pn.template.FastListTemplate:
    """A fresh app for one browser session: its own gallery and views around a shared model."""
    theme.enable_extension()
    return Gallery(model_name, view=view, remote=remote).template()


def serve(*, model: str = DEFAULT_MODEL, port: int = 5006, address: str = "127.0.0.1",
          show: bool = False, allow_websocket_origin: Sequence[str] | None = None,
          remote: bool = False, **kwargs: Any) -> Any:
    """Serve the gallery (blocking unless ``threaded=True``); binds 127.0.0.1 by default.

    The model loads before the server starts, so a bad name fails here, once. With
    ``remote=True`` every page runs the model on NDIF (`explorer.remote`).
    ``kwargs`` go to `panel.serve`.
    """
    get_model(model, remote=remote)
    theme.enable_extension()
    origins = list(allow_websocket_origin) if allow_websocket_origin else [
        f"{host}:{port}" for host in dict.fromkeys((address, "127.0.0.1", "localhost"))]
    def app() -> pn.template.FastListTemplate:
        return create_app(model, remote=remote)

    return pn.serve({"/": app}, port=port, address=address, show=show,
                    websocket_origin=origins, title=theme.TITLE, **kwargs)


if pn.state.served:
    create_app(os.environ.get("EXPLORER_MODEL", DEFAULT_MODEL)).servable()
