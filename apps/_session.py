"""What the pages share: the loaded models (read-only) and the background runner.

Models are cached per process by name: loading SmolLM2 takes seconds, and its weights are
only read, with ``Model.lock`` serialising forwards. Everything else (views, parameters,
results) is built per browser session, so sessions never see each other's state.

`Runner` runs a view's computation off the server's event loop so the page stays live:
a new request supersedes the one in flight, `cancel` discards a stale result, and a
closed session cancels its work (see `Runner.bind_session`).

Remote models (NDIF): a job that runs one is sent under its own `explorer.remote.RemoteRun`,
so cancelling the job stops its remote work too, and each status update (queued, running,
completed) reaches the session's `SessionHooks.on_remote_status` (the gallery's sidebar).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import explorer
from explorer._checks import ExplorerError

__all__ = ["get_model", "loaded_models", "Cancelled", "CancelToken", "Runner", "SessionHooks",
           "jobs_running", "schedule", "served_document", "session_hooks", "user_message"]

log = logging.getLogger(__name__)

_MODELS: dict[tuple[str, bool], explorer.Model] = {}
_MODELS_LOCK = threading.Lock()
_LOADING: dict[tuple[str, bool], threading.Lock] = {}

# Work is CPU-bound and forwards are serialised per model: a few threads are enough for light
# jobs. Heavy jobs wait in the server-wide queue (apps._server) on threads of their own, so a
# queue of them never holds up a light one.
_EXECUTOR = ThreadPoolExecutor(max_workers=2, thread_name_prefix="explorer-app")
_HEAVY_EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="explorer-heavy")
_RUNNING = 0                       # jobs of every session running now (not yet delivered)
_RUNNING_LOCK = threading.Lock()


def jobs_running() -> int:
    """How many jobs, of every page and session of this server, are running now."""
    return _RUNNING


def _count_running(step: int) -> None:
    global _RUNNING
    with _RUNNING_LOCK:
        _RUNNING += step


def get_model(name: str, *, remote: bool = False) -> explorer.Model:
    """The model ``name``, loaded once per process and shared read-only by all sessions.

    ``remote=True`` gives the NDIF-backed model (host and key from the environment).
    """
    key = (name, bool(remote))
    with _MODELS_LOCK:
        if key in _MODELS:
            return _MODELS[key]
        lock = _LOADING.setdefault(key, threading.Lock())
    with lock:  # two sessions asking for the same model load it once
        if key not in _MODELS:
            model = explorer.load_model(name, remote=remote)
            with _MODELS_LOCK:
                _MODELS[key] = model
    return _MODELS[key]


def loaded_models() -> list[str]:
    """Names of the models already in memory (remote ones marked "(remote)")."""
    with _MODELS_LOCK:
        return [name + (" (remote)" if remote else "") for name, remote in _MODELS]


def _remote_models() -> list[explorer.Model]:
    with _MODELS_LOCK:
        return [m for m in _MODELS.values() if m.remote]


@dataclass
class SessionHooks:
    """What one browser session (or one notebook) lets its runners reach.

    ``on_remote_status`` receives every `explorer.remote.RemoteStatus` of the session's
    jobs, on the session's event loop; ``runners`` are the session's live runners, which
    `stop_all` cancels (a "stop" button).
    """

    on_remote_status: Callable[[Any], None] | None = None
    runners: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    release_on_close: bool = False   # a closed session gives its memory back (bind_session)
    on_active: Callable[[int], None] | None = None
    """Hears the number of the session's background jobs submitted and not yet finished
    (waiting in the heavy-job queue or running), on the session's event loop, each time
    it changes (the sidebar's stop button follows it)."""
    active: int = 0
    _active_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def job_started(self, doc: Any) -> None:
        self._count(doc, +1)

    def job_ended(self, doc: Any) -> None:
        self._count(doc, -1)

    def _count(self, doc: Any, delta: int) -> None:
        with self._active_lock:
            self.active += delta
            now = self.active
        if self.on_active is not None:
            schedule(doc, lambda: self.on_active(now) if self.on_active is not None else None)

    def stop_all(self) -> int:
        """Stop every running job of the session (`Runner.stop`: its page hears that it was
        stopped); returns how many were running."""
        running = [r for r in list(self.runners) if r.running]
        for r in running:
            r.stop()
        return len(running)


_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INLINE_HOOKS = SessionHooks()  # notebooks and tests: no browser session


def served_document() -> Any:
    """The Bokeh document of the browser session running this code; None in a notebook, a
    test or a script (no session)."""
    import panel as pn

    doc = pn.state.curdoc
    return doc if doc is not None and doc.session_context is not None else None


def session_hooks(doc: Any = None) -> SessionHooks:
    """The hooks of ``doc``'s session (default: the current one; inline when not served)."""
    doc = doc if doc is not None else served_document()
    if doc is None:
        return _INLINE_HOOKS
    hooks = _HOOKS.get(doc)
    if hooks is None:
        hooks = _HOOKS[doc] = SessionHooks()
    return hooks


def _release_memory_soon(delay: float = 2.0) -> None:
    """Give freed memory back to the system once a closed session's objects are dropped."""
    from apps._server import release_memory

    timer = threading.Timer(delay, release_memory)
    timer.daemon = True
    timer.start()


def user_message(exc: BaseException) -> str:
    """One line for a notification: the message of errors a user can fix, else the type too."""
    if isinstance(exc, (ExplorerError, ValueError, TypeError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class Cancelled(Exception):
    """Raised inside a job by `CancelToken.check` once the job is cancelled."""


@dataclass
class CancelToken:
    """A flag a job checks between its steps."""

    event: threading.Event = field(default_factory=threading.Event)
    on_cancel: list[Callable[[], None]] = field(default_factory=list)

    def cancel(self) -> None:
        self.event.set()
        for fn in list(self.on_cancel):
            fn()

    @property
    def cancelled(self) -> bool:
        return self.event.is_set()

    def check(self) -> None:
        if self.event.is_set():
            raise Cancelled()


class Runner:
    """Runs one job at a time for one view, in a worker thread or inline.

    Parameters
    ----------
    on_result : callable(result)
        Called with the job's return value (on the session's event loop when served).
    on_error : callable(exception)
        Called when the job raises; `Cancelled` is not an error and is dropped.
    on_busy : callable(bool)
        Called with True once a job has run for ``busy_delay`` seconds, False when it ends.
    background : bool
        Run jobs in a worker thread (served pages) or inline (tests, notebooks).
    doc : bokeh Document, optional
        The session's document, for jobs submitted where no session is current (a worker
        thread); by default the current document at each `submit`.
    heavy : bool, default=False
        Served, its jobs wait their turn in the server-wide queue of heavy jobs
        (`apps._server.job_queue`); ``on_place(k)`` hears the job's place in line while it waits
        and ``on_place(0)`` when it starts. Inline runs never queue.
    counted : bool, default=True
        Served, its jobs count among the session's active jobs (`SessionHooks.active`, which
        the sidebar's stop button follows). A slider's preview lane, whose jobs last one move
        each, passes False: counted, each move would turn the button on and off again.
    """

    def __init__(self, *, on_result: Callable[[Any], None], on_error: Callable[[BaseException], None],
                 on_busy: Callable[[bool], None], background: bool, busy_delay: float = 0.3,
                 doc: Any = None, heavy: bool = False,
                 on_place: Callable[[int], None] | None = None, counted: bool = True,
                 on_stopped: Callable[[], None] | None = None):
        self._on_result = on_result
        self._on_stopped = on_stopped
        self.counted = bool(counted)
        self._on_error = on_error
        self._on_busy = on_busy
        self.heavy = bool(heavy)
        self._on_place = on_place
        self.background = background
        self.busy_delay = busy_delay
        self._lock = threading.Lock()
        self._token: CancelToken | None = None
        self._future: Future | None = None
        self._timer: threading.Timer | None = None
        self._closed = False
        self._doc = doc
        session_hooks(doc).runners.add(self)

    # -- lifecycle --------------------------------------------------------------------
    def bind_session(self) -> None:
        """Cancel this runner's work when the current browser session closes."""
        import panel as pn

        doc = pn.state.curdoc
        if doc is not None and doc.session_context is not None:
            pn.state.on_session_destroyed(lambda _ctx: self.close())
            hooks = session_hooks(doc)
            if not hooks.release_on_close:       # once per session: free its memory when it goes
                hooks.release_on_close = True
                pn.state.on_session_destroyed(lambda _ctx: _release_memory_soon())

    def close(self) -> None:
        """Cancel any job and refuse new ones (the session is gone)."""
        self._closed = True
        self.cancel()

    # -- jobs -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        f = self._future
        return f is not None and not f.done()

    def submit(self, job: Callable[[CancelToken], Any]) -> CancelToken | None:
        """Start ``job(token)``; any job in flight is cancelled and its result dropped."""
        if self._closed:
            return None
        doc = served_document()
        if doc is None:
            doc = self._doc
        token = CancelToken()
        with self._lock:
            if self._token is not None:
                self._token.cancel()
            if self._future is not None:
                self._future.cancel()
            self._stop_timer()
            self._token = token
        if not self.background:
            self._run(job, token, None)
            return token
        timer = threading.Timer(self.busy_delay, self._deliver, (doc, token, self._on_busy, True))
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()
        hooks = session_hooks(doc)
        if self.counted:
            hooks.job_started(doc)
        if self.heavy:
            future = _HEAVY_EXECUTOR.submit(self._run_queued, job, token, doc)
        else:
            future = _EXECUTOR.submit(self._run, job, token, doc)
        self._future = future
        if self.counted:
            future.add_done_callback(lambda _f: hooks.job_ended(doc))  # run, failed or cancelled
        return token

    def stop(self) -> None:
        """The person stopped the job in flight (the gallery's stop button): ``on_stopped``
        hears it, then the job is cancelled. A page's own `cancel` (a newer request
        superseding the job) says nothing."""
        if self.running and self._on_stopped is not None:
            self._on_stopped()
        self.cancel()

    def cancel(self) -> None:
        """Cancel the job in flight; its result, if it still arrives, is discarded."""
        with self._lock:
            token, future = self._token, self._future
            self._token = None
            self._stop_timer()
        if token is not None:
            token.cancel()
        if future is not None:
            future.cancel()
        self._on_busy(False)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the job in flight (if any) has finished and delivered its result."""
        f = self._future
        if f is not None and not f.cancelled():
            f.result(timeout)

    # -- internals --------------------------------------------------------------------
    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _current(self, token: CancelToken) -> bool:
        return self._token is token and not token.cancelled and not self._closed

    def _run_queued(self, job: Callable[[CancelToken], Any], token: CancelToken, doc: Any) -> None:
        """Wait for a slot in the server's heavy-job queue, then run ``job`` (and give the
        freed memory back once it is done)."""
        from apps._server import QueueCancelled, job_queue, release_memory

        def on_place(place: int) -> None:
            if self._on_place is not None:
                self._deliver(doc, token, self._on_place, place)

        queue = job_queue()
        try:
            with queue.turn(cancelled=lambda: token.cancelled, on_place=on_place,
                            owner=session_hooks(doc), on_ticket=lambda t: token.on_cancel.append(
                                lambda: queue.cancel(t))) as arrived:
                if arrived:
                    on_place(0)
                self._run(job, token, doc)
        except QueueCancelled:
            return
        finally:
            release_memory()

    def _run(self, job: Callable[[CancelToken], Any], token: CancelToken, doc: Any) -> None:
        _count_running(+1)
        try:
            token.check()
            with self._remote_runs(token, doc):
                result = job(token)
            token.check()
        except Cancelled:
            return
        except Exception as exc:  # a failed job must reach the page, never kill the worker
            if not isinstance(exc, (ExplorerError, ValueError, TypeError)):
                log.exception("view computation failed")
            self._finish(doc, token, self._on_error, exc)
            return
        finally:
            _count_running(-1)
        self._finish(doc, token, self._on_result, result)

    @contextlib.contextmanager
    def _remote_runs(self, token: CancelToken, doc: Any):
        """Send this job's remote work under RemoteRuns that the token cancels."""
        remote = _remote_models()
        if not remote:
            yield
            return
        from explorer.remote import remote_run

        hooks = session_hooks(doc)

        def on_status(status: Any) -> None:
            if hooks.on_remote_status is not None:
                schedule(doc, lambda: hooks.on_remote_status(status))

        with contextlib.ExitStack() as stack:
            runs = [stack.enter_context(remote_run(m, on_status=on_status)) for m in remote]
            token.on_cancel.extend(run.cancel for run in runs)
            if token.cancelled:
                for run in runs:
                    run.cancel()
            yield

    def _finish(self, doc: Any, token: CancelToken, callback: Callable[[Any], None], value: Any) -> None:
        def deliver():
            if not self._current(token):
                return
            with self._lock:
                self._stop_timer()
                self._token = None
            callback(value)
            self._on_busy(False)

        schedule(doc, deliver)

    def _deliver(self, doc: Any, token: CancelToken, callback: Callable[[Any], None], value: Any) -> None:
        def deliver():
            if self._current(token):
                callback(value)

        schedule(doc, deliver)



class _DocQueue:
    """The callbacks scheduled for one document, run on its loop in the order scheduled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fns: list[Callable[[], None]] = []
        self.pending = False   # a drain is queued on the loop (or waits for the page to load)


_QUEUES: weakref.WeakKeyDictionary[Any, _DocQueue] = weakref.WeakKeyDictionary()
_QUEUES_LOCK = threading.Lock()


def schedule(doc: Any, fn: Callable[[], None]) -> None:
    """Run ``fn`` on ``doc``'s session event loop, or right here (no doc).

    Callbacks for one document run in the order they were scheduled, whatever the thread
    and whether the page has loaded: a status posted before a result is never applied after
    it. A callback scheduled while the page is still connecting waits for the page to load:
    Panel would otherwise queue the model changes it makes, and a widget rebuilt on that
    path (a DiscreteSlider given its options) can end up detached from the server, so the
    browser's moves of it are never heard.
    """
    if doc is None:
        fn()
        return
    with _QUEUES_LOCK:
        queue = _QUEUES.get(doc)
        if queue is None:
            queue = _QUEUES[doc] = _DocQueue()
    with queue.lock:
        queue.fns.append(fn)
        if queue.pending:
            return  # the queued drain will run it, after what came before
        queue.pending = True
    try:
        doc.add_next_tick_callback(lambda: _drain(doc, queue))
    except RuntimeError:  # the session closed
        with queue.lock:
            queue.fns.clear()
            queue.pending = False
        log.debug("session gone; result dropped", exc_info=True)


def _drain(doc: Any, queue: _DocQueue, *, loaded: bool = False) -> None:
    """Run ``queue``'s callbacks on ``doc``'s loop, in the order scheduled."""
    from panel.io.state import set_curdoc, state

    with set_curdoc(doc):
        # Panel runs onload callbacks before it marks the page loaded: ``loaded`` says so.
        if not (loaded or state.loaded):
            state.onload(lambda: _drain(doc, queue, loaded=True))
            return
        while True:
            with queue.lock:
                fns, queue.fns = queue.fns, []
                if not fns:
                    queue.pending = False
                    return
            for fn in fns:
                try:
                    fn()
                except Exception:  # one failing callback must not drop the ones after it
                    log.exception("a scheduled page update failed")
