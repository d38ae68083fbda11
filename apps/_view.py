"""The base of every page: status, busy, error, progress, named runners, posting, closing, serving.

A page is a `View`: its state lives in Parameters, its plots are pure functions of that state,
and its slow work runs in named `Runner`s (`View.runner`) off the server's event loop. A job
never touches the page itself: its return value reaches the runner's ``on_result`` on the
session's event loop, and what it reports on the way (`View.post`, `View.progress_fn`,
`View.status_reporter`) is applied there too, at the document's next tick. A failed job shows in
the error parameter, the status line and a notification (`View.show_error`); `View.close` stops
every runner (the gallery calls it when the session goes). `serve` is the standalone footer of a
page module. docs/views.md describes the pattern.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import panel as pn
import param

from apps import theme
from apps._session import CancelToken, Runner, schedule, user_message

__all__ = ["View", "serve", "head_cell", "STATIC_TOOLS", "ZOOM_TOOLS"]

STATIC_TOOLS = ["save", "box_zoom", "reset"]
"""The toolbar of plots that are read rather than explored (no pan or wheel zoom)."""

ZOOM_TOOLS = theme.PLOT_TOOLS
"""The toolbar of the pages' zoomable plots."""

_DEFAULT = object()


def _served_doc() -> Any:
    doc = pn.state.curdoc
    return doc if doc is not None and doc.session_context is not None else None


class View(pn.viewable.Viewer):
    """A page of the explorer: the plumbing every view shares.

    Parameters
    ----------
    background : bool, optional
        Run jobs in worker threads (default when served) or inline (tests, notebooks).
    **params
        Initial values of the view's parameters.

    Subclasses set ``notify_title`` (the prefix of their notifications; None: the message
    alone) and ``failed_status`` (the status line after a failure, ``{message}`` filled in;
    None leaves the status as it is).
    """

    notify_title: str | None = "Page"
    failed_status: str | None = "Failed: {message}"
    wait_timeout: float | None = 600

    status = param.String(default="", precedence=-1, doc="One line on what the page is doing or did.")
    busy = param.Boolean(default=False, precedence=-1,
                         doc="A job has run for a moment and is still running (shows the spinner).")
    running = param.Boolean(default=False, precedence=-1,
                            doc="A job the page waits on is in flight (set by the view when it "
                                "asks; cleared when it fails).")
    error = param.String(default="", precedence=-1, doc="Message of the last failure; '' after a good run.")
    progress = param.Integer(default=0, bounds=(0, 100), precedence=-1,
                             doc="Percent done of the job that reports progress.")
    progress_active = param.Boolean(default=False, precedence=-1,
                                    doc="A job is reporting progress and has not finished.")

    def __init__(self, *, background: bool | None = None, **params: Any):
        super().__init__(**params)
        doc = _served_doc()
        self._background = (doc is not None) if background is None else bool(background)
        self._doc = doc
        self._runners: dict[str, Runner] = {}
        self._busy_runners: set[str] = set()

    # -- runners -----------------------------------------------------------------------------
    def runner(self, name: str, on_result: Callable[[Any], None], *, busy: bool = True,
               progress: bool = False) -> Runner:
        """A new runner called ``name`` whose results go to ``on_result`` on the page's loop.

        ``busy``: its jobs set `busy` while they run (after the runner's short delay).
        ``progress``: it reports progress, so the bar hides when its job ends.
        Failures go to `show_error`. The runner stops when the session closes or at `close`.
        """
        def done(value: Any) -> None:
            if progress:
                self.progress_active = False
            on_result(value)

        r = Runner(on_result=done, on_error=self.show_error,
                   on_busy=(lambda b: self._runner_busy(name, b)) if busy else (lambda b: None),
                   background=self._background, doc=self._doc)
        r.bind_session()
        self._runners[name] = r
        return r

    def submit(self, name: str, job: Callable[[CancelToken], Any]) -> CancelToken | None:
        """Run ``job(token)`` on the runner ``name``; a job in flight there is superseded."""
        return self._runners[name].submit(job)

    def cancel(self, name: str | None = None) -> None:
        """Cancel the job in flight on runner ``name`` (default: on every runner)."""
        for key, r in self._runners.items():
            if name is None or key == name:
                r.cancel()

    def wait(self, timeout: Any = _DEFAULT) -> View:
        """Block until every runner's job has finished and delivered (tests, scripts)."""
        timeout = self.wait_timeout if timeout is _DEFAULT else timeout
        for r in list(self._runners.values()):
            r.wait(timeout)
        return self

    def close(self) -> None:
        """Cancel every job and refuse new ones (the page is gone)."""
        for r in self._runners.values():
            r.close()

    def _runner_busy(self, name: str, busy: bool) -> None:
        if busy:
            self._busy_runners.add(name)
        else:
            self._busy_runners.discard(name)
        busy = bool(self._busy_runners)
        if self.busy != busy:
            self.busy = busy

    # -- from a job to the page ----------------------------------------------------------------
    def schedule(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the session's event loop at the document's next tick; right here when
        not served or when jobs run inline (their results arrive at once, so must their posts)."""
        schedule(self._doc if self._background else None, fn)

    def post(self, **values: Any) -> None:
        """Set parameters from any thread: on the session's document at its next tick."""
        self.schedule(lambda: self.param.update(**values))

    def progress_fn(self, token: CancelToken | None = None, *, lo: int = 0,
                    hi: int = 100) -> Callable[[int, int], None]:
        """A ``progress(done, total)`` callback for an analysis: posts `progress` (``done/total``
        mapped onto ``lo``..``hi`` percent) and `progress_active`; with ``token``, it raises
        `Cancelled` once the job is cancelled."""
        def report(done: int, total: int) -> None:
            if token is not None:
                token.check()
            self.post(progress=int(lo + (hi - lo) * done / max(1, total)), progress_active=done < total)
        return report

    def status_reporter(self, token: CancelToken, message: Callable[[int, int, float], str], *,
                        every: float = 0.5) -> Callable[[int, int], bool]:
        """A ``progress(done, total) -> bool`` callback that posts ``message(done, total,
        seconds)`` as the status at most every ``every`` seconds (and at the end), and returns
        False once the job is cancelled (the training loops stop then)."""
        started = time.perf_counter()
        last = [0.0]

        def report(done: int, total: int) -> bool:
            now = time.perf_counter()
            if now - last[0] > every or done == total:
                last[0] = now
                self.post(status=message(done, total, now - started))
            return not token.cancelled
        return report

    # -- errors -----------------------------------------------------------------------------------
    def show_error(self, exc: BaseException) -> None:
        """Show a failure: `error`, the status line (``failed_status``) and a notification."""
        message = user_message(exc)
        values: dict[str, Any] = {"error": message, "running": False, "progress_active": False}
        if self.failed_status is not None:
            values["status"] = self.failed_status.format(message=message)
        self.param.update(**values)
        text = message + self._error_note()
        theme.notify("error", f"{self.notify_title}: {text}" if self.notify_title else text)

    def _error_note(self) -> str:
        """Text added to a failure's notification (e.g. that the last result is still shown)."""
        return ""


def head_cell(x: Any, y: Any, scores: Any) -> tuple[int, int] | None:
    """(layer, head) of a click at ``(x, y)`` = (head, layer) on a layer x head heatmap of
    ``scores`` (a Dataset with ``layer`` and ``head`` dimensions); None when the click is off the
    grid or there are no scores. Categorical axes give strings; they are read as numbers."""
    if x is None or y is None or scores is None:
        return None
    try:
        head, layer = int(round(float(x))), int(round(float(y)))
    except (TypeError, ValueError):
        return None
    if 0 <= layer < scores.sizes["layer"] and 0 <= head < scores.sizes["head"]:
        return layer, head
    return None


# -- the standalone page ------------------------------------------------------------------------

def serve(module: str, factory: Callable[[Any], pn.viewable.Viewable], *, title: str,
          model: bool = True, argv: list[str] | None = None, intro: str | None = None) -> None:
    """The footer of a page module: serve the page on its own.

    Call it at the end of the module with its ``__name__``. Under ``panel serve apps/X.py`` the
    page is made servable; under ``python -m apps.X [PORT]`` a server on 127.0.0.1:PORT (default
    5006) serves it until interrupted; on a plain import nothing happens. ``factory(model)``
    builds the view; ``model=True`` passes it the model named by ``$EXPLORER_MODEL`` (default
    smollm2-135m), else None. ``intro`` is the page's slug in `apps._intros.INTROS`: its few
    lines open the page, as they do in the gallery.
    """
    served = module.startswith("bokeh_app_")
    if not served and module != "__main__":
        return

    def page() -> pn.template.FastListTemplate:
        from apps._session import get_model

        theme.enable_extension()
        from apps._intros import intro_pane

        m = get_model(os.environ.get("EXPLORER_MODEL", "smollm2-135m")) if model else None
        head = [intro_pane(intro)] if intro else []
        return theme.page([*head, factory(m)], title=title)

    if served:
        page().servable()
        return
    args = sys.argv[1:] if argv is None else argv
    port = int(args[0]) if args else 5006
    pn.serve(page, port=port, address="127.0.0.1", show=False, title=title,
             websocket_origin=[f"127.0.0.1:{port}", f"localhost:{port}"], threaded=False)
