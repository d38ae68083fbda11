"""Remote models on NDIF through nnsight's remote backend.

The model is built on the meta device from its config (no weights are loaded here);
traces are sent to the NDIF host and only saved values come back. `run_batch` drives
nnsight the same way for local and remote models: ``nn.trace(..., remote=True)`` picks
this module's backend, which adds to nnsight's blocking client a timeout, cancellation,
status reports (RECEIVED, QUEUED, RUNNING, COMPLETED) and errors an explorer user can act on.

Configuration comes from the environment (``NDIF_API_KEY``, ``NDIF_HOST``) or nnsight's
own config file (``~/.config/nnsight/config.yaml``, written by ``nnsight login``). The key
is never put in a message, a log line, an export or the UI: `redact` scrubs it from any
text that leaves this module, and the key is kept out of the request payload, the model's
repr and the spec.

A model may be a hub id NDIF serves, or a local Hugging Face folder served by a
deployment that has the same folder (the loopback server of `explorer.ndif_server`);
nnsight's model key for a folder is its absolute path.
"""
from __future__ import annotations

import asyncio
import contextlib
import copyreg
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._checks import RemoteError, check_float

__all__ = [
    "remote_config",
    "remote_connection",
    "remote_meta_model",
    "remote_backend_class",
    "redact",
    "RemoteStatus",
    "RemoteRun",
    "RemoteTimeoutError",
    "RemoteCancelledError",
    "remote_run",
    "run_remote_async",
    "DEFAULT_TIMEOUT_S",
]

logger = logging.getLogger("explorer.remote")

#: Seconds a remote job may take, queue included, before the client gives up on it.
DEFAULT_TIMEOUT_S = 600.0
_POLL_S = 0.05  # how often the wait loop wakes to check cancellation and the deadline


class RemoteTimeoutError(RemoteError):
    """A remote job did not complete within its time limit."""


class RemoteCancelledError(RemoteError):
    """A remote job was cancelled by the user."""


def _api_key() -> str | None:
    from nnsight import CONFIG

    return os.environ.get("NDIF_API_KEY") or CONFIG.API.APIKEY or None


def remote_config() -> dict[str, Any]:
    """Host, whether a key is set and where it came from (never the key itself).

    Returns
    -------
    dict
        ``host`` (``NDIF_HOST``, else nnsight's config, else https://api.ndif.us),
        ``api_key_set`` (bool), ``api_key_source`` ({"environment", "config file", None})
        and ``config_file`` (the nnsight config path).
    """
    from nnsight import CONFIG
    from nnsight.schema.config import _user_config_path

    env_key = os.environ.get("NDIF_API_KEY")
    key = env_key or CONFIG.API.APIKEY
    source = "environment" if env_key else ("config file" if key else None)
    host = os.environ.get("NDIF_HOST") or CONFIG.API.HOST
    return {"host": host.rstrip("/"), "api_key_set": bool(key), "api_key_source": source,
            "config_file": str(_user_config_path())}


def redact(text: str, keys: tuple[str | None, ...] = ()) -> str:
    """Replace the API key (and any of ``keys``), wherever it appears in ``text``, with '***'."""
    from nnsight import CONFIG

    for key in {os.environ.get("NDIF_API_KEY"), CONFIG.API.APIKEY, *keys}:
        if key:
            text = text.replace(key, "***")
    return text


# -- job status, timeout and cancellation ------------------------------------------------

@dataclass(frozen=True)
class RemoteStatus:
    """One status update of a remote job.

    ``status`` is one of nnsight's: RECEIVED, QUEUED, PROVISIONING, DEPLOYING, DISPATCHED,
    RUNNING, COMPLETED, ERROR, LOG. ``elapsed_s`` counts from the submission.
    """

    job_id: str
    status: str
    description: str
    elapsed_s: float


class RemoteRun:
    """Handle on the remote jobs of one piece of work: status, time limit, cancel.

    An analysis may send several jobs (one per batch); all of them report to the same
    handle and stop at the same `cancel`. Use `remote_run` to install one on a model.

    Attributes
    ----------
    timeout_s : float
        Time limit of each job, queue included.
    on_status : callable(RemoteStatus), optional
        Called from the waiting thread on every status update.
    statuses : list of RemoteStatus
        Every update received so far, oldest first.
    """

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 on_status: Callable[[RemoteStatus], Any] | None = None):
        self.timeout_s = check_float("timeout_s", timeout_s, low=0.0)
        if on_status is not None and not callable(on_status):
            raise TypeError(f"`on_status` must be callable; got {type(on_status).__name__}.")
        self.on_status = on_status
        self.statuses: list[RemoteStatus] = []
        self._cancel = threading.Event()

    def __repr__(self) -> str:
        last = self.statuses[-1].status if self.statuses else None
        return (f"RemoteRun(timeout_s={self.timeout_s}, jobs={len(self.job_ids)}, last={last!r}, "
                f"cancelled={self.cancelled})")

    @property
    def job_ids(self) -> list[str]:
        return list(dict.fromkeys(s.job_id for s in self.statuses))

    @property
    def status(self) -> str | None:
        """The latest status, or None before the first job is submitted."""
        return self.statuses[-1].status if self.statuses else None

    def cancel(self) -> None:
        """Stop waiting: the job in flight raises `RemoteCancelledError`, later ones do not start.

        The client closes its websocket session; a server that has not started the job yet
        drops it (NDIF's client protocol has no call to stop a job already running).
        """
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _record(self, status: RemoteStatus) -> None:
        self.statuses.append(status)
        logger.info("NDIF job %s: %s %s", status.job_id, status.status, status.description[:200])
        if self.on_status is not None:
            self.on_status(status)


@contextlib.contextmanager
def remote_run(model: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               on_status: Callable[[RemoteStatus], Any] | None = None) -> Iterator[RemoteRun]:
    """Send the model's remote jobs from this thread under a fresh `RemoteRun`, in the block.

    Each thread has its own run, so sessions of a served app sharing one model do not mix
    their statuses or cancel each other's work.

    Parameters
    ----------
    model : Model
        A model from ``load_model(..., remote=True)``.
    timeout_s : float, default=600
        Time limit of each job, queue included.
    on_status : callable(RemoteStatus), optional
        Called on every status update (e.g. to drive a progress indicator).

    Yields
    ------
    RemoteRun
        Call ``run.cancel()`` from another thread to stop the work.

    Examples
    --------
    >>> with remote_run(model, timeout_s=60, on_status=print) as run:  # doctest: +SKIP
    ...     ds = trace(model, prompts)
    """
    connection = _connection(model)
    run = RemoteRun(timeout_s=timeout_s, on_status=on_status)
    previous = getattr(connection._local, "run", None)
    connection.run = run
    try:
        yield run
    finally:
        connection.run = previous


async def run_remote_async(model: Any, func: Callable[..., Any], *args: Any,
                           timeout_s: float = DEFAULT_TIMEOUT_S,
                           on_status: Callable[[RemoteStatus], Any] | None = None,
                           **kwargs: Any) -> Any:
    """Await ``func(model, *args, **kwargs)`` without blocking the event loop.

    The work runs in a worker thread under its own `RemoteRun`; if the awaiting task is
    cancelled (a Panel callback superseded, a user pressing stop), the remote job is
    cancelled too. nnsight's blocking client writes saved values back into the tracing
    frame, which its asyncio backend does not, so the thread is what keeps `run_batch`'s
    single code path for local and remote runs.
    """
    connection = _connection(model)
    run = RemoteRun(timeout_s=timeout_s, on_status=on_status)

    def work() -> Any:
        previous = getattr(connection._local, "run", None)
        connection.run = run
        try:
            return func(model, *args, **kwargs)
        finally:
            connection.run = previous

    future = asyncio.get_running_loop().run_in_executor(None, work)
    # a cancelled caller never reads the worker's RemoteCancelledError: retrieve it here
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        run.cancel()
        raise


# -- the backend ---------------------------------------------------------------------------

class _Connection:
    """Where and how one remote model sends its jobs. Holds the key; never printed or pickled."""

    def __init__(self, host: str, api_key: str, timeout_s: float):
        self.host = host
        self._api_key = api_key
        self.default_run = RemoteRun(timeout_s=timeout_s)
        self._local = threading.local()  # the RemoteRun installed by remote_run, per thread

    @property
    def run(self) -> RemoteRun:
        return getattr(self._local, "run", None) or self.default_run

    @run.setter
    def run(self, run: RemoteRun | None) -> None:
        self._local.run = run

    def __repr__(self) -> str:
        return f"_Connection(host={redact(self.host, (self._api_key,))!r}, api_key='***')"

    def redact(self, text: str) -> str:
        return redact(text, (self._api_key,))


def _connection(model: Any) -> _Connection:
    connection = getattr(getattr(model, "nn", None), "_explorer_connection", None)
    if not getattr(model, "remote", False) or connection is None:
        raise TypeError("`model` must be a remote model from load_model(..., remote=True).")
    return connection


@functools.cache
def remote_backend_class() -> type:
    """nnsight's RemoteBackend with a time limit, cancellation, status reports, clear errors.

    The class is built once (nnsight is imported on first use); `explorer.bench` wraps its
    serialiser to measure the size of the requests a remote run sends."""
    from nnsight.intervention.backends.display import StatusDisplay
    from nnsight.intervention.backends.remote import RemoteBackend
    from nnsight.intervention.backends.remote import RemoteError as NNsightRemoteError
    from nnsight.schema.response import Status

    class ExplorerRemoteBackend(RemoteBackend):
        def __init__(self, model_key: str, connection: _Connection, env: dict):
            super().__init__(model_key, host=connection.host, api_key=connection._api_key,
                             env=env, blocking=True)
            self.connection = connection
            self.run = connection.run
            self.display = StatusDisplay(enabled=False)  # statuses go to RemoteRun and logging
            self.started = time.monotonic()
            self.last: RemoteStatus | None = None

        def __call__(self, tracer: Any = None) -> Any:
            import httpx
            import websocket

            host = self.connection.redact(self.host)
            if self.run.cancelled:
                raise RemoteCancelledError("the remote run was cancelled before this job was sent.")
            try:
                return super().__call__(tracer)
            except RemoteError:
                raise
            except NNsightRemoteError as e:
                raise self._server_error(e) from None
            except (httpx.HTTPError, websocket.WebSocketException, OSError) as e:
                reason = self.connection.redact(str(e).splitlines()[0] if str(e) else
                                                type(e).__name__)[:200]
                if self.last is None:
                    raise RemoteError(
                        f"cannot reach the NDIF server at {host}: {reason}. Check that NDIF_HOST "
                        "is right and the server is up (nnsight.status())."
                    ) from None
                raise RemoteError(
                    f"lost contact with the NDIF server at {host} (job {self.last.job_id}, last "
                    f"status {self.last.status}): {reason}."
                ) from None

        def _server_error(self, e: Exception) -> RemoteError:
            host = self.connection.redact(self.host)
            cause = e.__cause__
            status_code = getattr(getattr(cause, "response", None), "status_code", None)
            text = self.connection.redact(str(e))
            if status_code in (401, 403):
                return RemoteError(
                    f"the NDIF server at {host} refused the API key (HTTP {status_code}). Set "
                    "NDIF_API_KEY to a valid key (https://login.ndif.us) or run `nnsight login`.")
            if status_code is not None:
                detail = text.removeprefix("Failed to send request: ")[:300]
                return RemoteError(f"the NDIF server at {host} refused the request "
                                   f"(HTTP {status_code}): {detail}")
            if cause is not None:  # no HTTP answer at all
                return RemoteError(f"cannot reach the NDIF server at {host}: "
                                   f"{text.removeprefix('Failed to send request: ')[:200]}. "
                                   "Check NDIF_HOST and your network.")
            lines = [ln for ln in text.strip().splitlines() if ln.strip()]
            summary = lines[-1].strip() if lines else "no description"
            job = self.last.job_id if self.last else "?"
            err = RemoteError(f"NDIF job {job} failed on the server: {summary[:300]}")
            err.server_traceback = text  # the whole server-side description, redacted
            return err

        def note(self, response: Any) -> bool:
            desc = self.connection.redact(response.description or "")
            status = RemoteStatus(job_id=response.id, status=response.status.value,
                                  description=desc, elapsed_s=time.monotonic() - self.started)
            self.last = status
            self.run._record(status)
            return super().note(response)

        def request(self, request: Any, tracer: Any) -> Any:
            """nnsight's blocking wait, woken every 50 ms to honour the deadline and cancel."""
            import websocket

            blob = self._serialize(tracer)
            deadline = self.started + self.run.timeout_s
            connection = websocket.create_connection(
                f"{self.ws_host}/subscribe", timeout=10,
                header={"ndif-api-key": self.api_key} if self.api_key else None)
            try:
                request.session_id = json.loads(connection.recv())["session_id"]
                self.send(request, blob)
                connection.settimeout(_POLL_S)
                while True:
                    if self.run.cancelled:
                        raise RemoteCancelledError(f"NDIF job {self._job()} was cancelled.")
                    if time.monotonic() > deadline:
                        raise RemoteTimeoutError(
                            f"NDIF job {self._job()} did not complete within "
                            f"{self.run.timeout_s:g} s (last status: "
                            f"{self.last.status if self.last else 'none'}); the client stopped "
                            "waiting. Allow more time with remote_run(model, timeout_s=...).")
                    try:
                        message = connection.recv()
                    except websocket.WebSocketTimeoutException:
                        continue
                    except websocket.WebSocketConnectionClosedException:
                        message = None
                    if not message:  # a close frame reads as an empty message
                        raise RemoteError(
                            f"the NDIF server at {self.connection.redact(self.host)} closed the "
                            f"connection before job {self._job()} completed.") from None
                    response = self.parse(message)
                    result = self.handle(response)
                    if response.status == Status.COMPLETED:
                        return result
            finally:
                connection.close()

        def _job(self) -> str:
            return self.last.job_id if self.last else "(not yet accepted)"

    return ExplorerRemoteBackend


@functools.cache
def _remote_model_class() -> type:
    """TransformersModel whose remote runs go through `ExplorerRemoteBackend`.

    Requests name the model by nnsight's ordinary key (``TransformersModel:...``), and the
    model pickles as a plain TransformersModel, so neither this class nor the connection
    (with the key) travels in a request.
    """
    from nnsight import TransformersModel

    class ExplorerRemoteModel(TransformersModel):
        def _remoteable_class(self) -> type:
            return TransformersModel

        def _remote_backend(self, remote: Any, blocking: bool, job_id: Any, verbose: bool) -> Any:
            if remote == "local" or not blocking or job_id is not None:
                return super()._remote_backend(remote, blocking, job_id, verbose)
            return remote_backend_class()(self.to_model_key(), self._explorer_connection,
                                    self._remoteable_get_env())

        def __reduce_ex__(self, protocol: int) -> Any:
            state = self.__getstate__()
            state.pop("_explorer_connection", None)
            return copyreg._reconstructor, (TransformersModel, object, None), state

    return ExplorerRemoteModel


# -- loading (the Model itself is built by `explorer.models.load_remote_model`) ------------

def remote_connection(host: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> _Connection:
    """Where a remote model's jobs go: ``host`` (default ``NDIF_HOST`` or nnsight's config),
    the API key, and each job's time limit ``timeout_s``.

    Raises
    ------
    RemoteError
        No API key configured, or a host that is not an http(s) URL.
    """
    cfg = remote_config()
    key = _api_key()
    if not key:
        raise RemoteError(
            "remote=True needs an NDIF API key: set the NDIF_API_KEY environment variable "
            f"or run `nnsight login` (host: {cfg['host']}; set NDIF_HOST to use another "
            "deployment).")
    host = (host or cfg["host"]).rstrip("/")
    if not host.startswith(("http://", "https://")):
        raise RemoteError(f"the NDIF host must start with http:// or https://; got "
                          f"{redact(host)!r}.")
    check_float("timeout_s", timeout_s, low=0.0)
    return _Connection(host, key, timeout_s)


def remote_meta_model(name: str, tokenizer: Any, rename: dict[str, str],
                      connection: _Connection, *, is_folder: bool) -> Any:
    """The nnsight model of ``name`` on the meta device whose traces go through ``connection``.

    ``rename`` is the family's site aliases (`ArchSpec.rename`); ``is_folder``: ``name`` is a
    local folder's absolute path, which is then its model key. Explorer's own code is
    registered with nnsight here, since NDIF servers do not have it installed: it travels
    with each request.
    """
    import importlib

    import nnsight
    from nnsight.modeling import huggingface

    if is_folder:
        # nnsight's model key canonicalises a repo id through the hub; a folder's id is its path
        huggingface._ID_CACHE.setdefault(name, name)
    nn_model = _remote_model_class()(name, task="text-generation", tokenizer=tokenizer,
                                     rename=rename)
    nn_model.to_model_key()  # resolves (and caches) the hub id now, not mid-trace
    nnsight.register(importlib.import_module(__package__))
    nn_model._explorer_connection = connection
    return nn_model
