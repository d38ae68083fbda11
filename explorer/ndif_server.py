"""A loopback NDIF server: nnsight 0.8.1's remote protocol, served on 127.0.0.1 for tests.

The real ``ndif`` server needs Ray, redis, an S3 store and CUDA GPUs, so it cannot run on
a CPU machine. This module speaks the same protocol to nnsight's own client
(``nnsight.intervention.backends.remote.RemoteBackend``) and executes each request with
nnsight's own server-side code on one local model:

- ``WS /subscribe``: the first frame carries ``{"session_id": ...}``; then one frame per
  status update of that session's jobs (JSON ``ResponseModel``), ending with a binary
  frame (``ResponseModel.pickle()``) whose ``data`` is the zstd-compressed ``torch.save``
  of the saved values.
- ``POST /request``: multipart, form field ``data`` (the ``RequestModel`` JSON: model key,
  session id, compression, env) and file ``blob`` (the serialized trace). The header
  ``ndif-api-key`` must carry a valid key when the server was started with one.
- ``GET /response/{id}``: the latest status of a job (non-blocking clients poll this); a
  completed job's ``data`` is the URL ``/result/{id}`` to download the result from.

Execution reuses nnsight: ``Remotable.from_model_key`` builds the served model from the
model key, ``RequestModel.deserialize`` rebuilds the tracer against that model's
persistent objects, ``_remoteable_set_env`` applies the request's environment, and
``tracer.execute`` runs the block; the values it marked with ``save`` are the result.

The server runs code that clients send: it binds 127.0.0.1 only, and nothing here is
meant to be exposed. Start it with ``python -m explorer.ndif_server FOLDER`` (a Hugging
Face model folder) or, from tests, with `LoopbackServer`.
"""
import sys

# anyio and its asyncio backend must be imported before nnsight: nnsight mounts ``.save``
# on every object, and anyio's typed-attribute classes (which FastAPI's sync endpoints
# need) then fail with "Attribute 'save' is missing its type annotation". A process that
# already imported nnsight can still use `LoopbackServer`, which serves from a child process.
if "nnsight" not in sys.modules:
    import anyio._backends._asyncio  # noqa: F401

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import socket
import subprocess
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["create_app", "LoopbackServer", "serve", "API_KEY_ENV", "LOOPBACK_HOST"]

#: Environment variable holding the API key the server accepts (never put on the command line).
API_KEY_ENV = "NDIF_LOOPBACK_API_KEY"
#: The only address the server binds.
LOOPBACK_HOST = "127.0.0.1"

logger = logging.getLogger("explorer.ndif_server")


@dataclass
class _Job:
    id: str
    session_id: str
    blob: bytes
    compress: bool
    env: dict
    status: Any = None          # latest ResponseModel
    result: bytes | None = None
    cancelled: bool = False
    created: float = field(default_factory=time.monotonic)


def _served_model(folder: str) -> tuple[Any, str]:
    """The model nnsight would serve for ``folder`` (weights loaded), and its model key."""
    from nnsight import TransformersModel
    from nnsight.modeling import huggingface
    from nnsight.modeling.mixins.remotable import Remotable

    # A local folder has no hub record: prime nnsight's id cache so the key is the path.
    huggingface._ID_CACHE.setdefault(folder, folder)
    from transformers import AutoTokenizer

    meta = TransformersModel(folder, task="text-generation",
                             tokenizer=AutoTokenizer.from_pretrained(folder))
    key = meta.to_model_key()
    model = Remotable.from_model_key(key, dispatch=True)
    model._module.requires_grad_(False)
    model._module.eval()
    return model, key


class _HiddenModuleFinder:
    """A meta-path finder refusing some top-level packages, as on a server without them."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not installed on this "
                                      "server)", name=fullname)
        return None


@contextlib.contextmanager
def _without_modules(names: tuple[str, ...]):
    """Run a job as if ``names`` were not installed: client code must ship them by value."""
    if not names:
        yield
        return
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] in names}
    finder = _HiddenModuleFinder(names)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for m in [m for m in sys.modules if m.split(".")[0] in names]:
            del sys.modules[m]
        sys.modules.update(saved)


def create_app(model: Any, model_key: str, *, api_key: str | None = None,
               queue_delay_s: float = 0.0, hidden_modules: tuple[str, ...] = ("explorer",)) -> Any:
    """The FastAPI application serving ``model`` under ``model_key``.

    Parameters
    ----------
    model : nnsight TransformersModel
        A dispatched model (real weights), as built by ``Remotable.from_model_key``.
    model_key : str
        The key clients send; requests for another key are refused.
    api_key : str, optional
        The key clients must send in ``ndif-api-key``; None accepts any request.
    queue_delay_s : float, default=0.0
        Seconds each job waits in QUEUED before it runs (simulates a busy deployment; tests
        use it for timeouts and cancellation). ``PUT /_loopback/queue_delay`` changes it.
    hidden_modules : tuple of str, default=("explorer",)
        Packages a job cannot import, as on a real NDIF server where they are not installed:
        the client must send their code by value (``nnsight.register``).

    Returns
    -------
    fastapi.FastAPI
    """
    try:
        import anyio._backends._asyncio  # noqa: F401
    except TypeError:
        raise RuntimeError("the loopback NDIF server must run in a process that imports "
                           "explorer.ndif_server before nnsight (python -m explorer.ndif_server, "
                           "or LoopbackServer).") from None
    import torch
    from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
    from fastapi.responses import JSONResponse, Response
    from nnsight.schema.request import RequestModel
    from nnsight.schema.response import ResponseModel, Status
    from nnsight.tracing import tracer as tracing

    app = FastAPI(title="explorer loopback NDIF server")
    persistent = model._remoteable_persistent_objects()
    jobs: dict[str, _Job] = {}
    sessions: dict[str, tuple[WebSocket, asyncio.AbstractEventLoop]] = {}
    settings = {"queue_delay_s": float(queue_delay_s)}
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ndif-job")  # one model
    lock = threading.Lock()

    def authorised(request_key: str | None) -> bool:
        return api_key is None or request_key == api_key

    def unauthorised() -> Any:
        return JSONResponse(status_code=401, content={
            "detail": "Invalid or missing API key (header ndif-api-key)."})

    def publish(job: _Job, status: Status, description: str = "", data: Any = None) -> None:
        """Record a status and push it to the job's websocket session, if still connected."""
        response = ResponseModel(id=job.id, status=status, description=description, data=data)
        job.status = response
        target = sessions.get(job.session_id)
        if target is None:
            return
        ws, loop = target
        if isinstance(data, (bytes, bytearray)):
            send = ws.send_bytes(response.pickle())
        else:
            send = ws.send_text(response.model_dump_json())
        try:
            asyncio.run_coroutine_threadsafe(send, loop).result(timeout=30)
        except Exception:  # noqa: BLE001 - a client gone mid-send just stops getting updates
            send.close()
            logger.info("job %s: session %s went away", job.id, job.session_id)

    def execute(job: _Job) -> dict[str, Any]:
        """Run one request the way an NDIF model actor does; return the saved values."""
        with _without_modules(hidden_modules):
            tracer = RequestModel.deserialize(job.blob, persistent, job.compress)
            model._remoteable_set_env(job.env)
            frame = tracer.info.frame
            tracing.inc()  # a trace scope: `save` marks values, the outermost push keeps them
            try:
                with torch.no_grad():
                    tracer.execute(tracer.info.code)
                saved = tracing._saves()
                return {k: v for k, v in frame.f_locals.items() if id(v) in saved}
            finally:
                tracing.dec()

    def run(job: _Job) -> None:
        try:
            publish(job, Status.QUEUED, "Waiting for the model.")
            deadline = time.monotonic() + settings["queue_delay_s"]
            while time.monotonic() < deadline and not job.cancelled:
                time.sleep(0.01)
            if job.cancelled:
                publish(job, Status.ERROR, "Cancelled: the client closed its session.")
                return
            publish(job, Status.RUNNING, "Running.")
            with lock:
                saves = execute(job)
            buffer = io.BytesIO()
            torch.save(saves, buffer)
            payload = buffer.getvalue()
            if job.compress:
                import zstandard

                payload = zstandard.ZstdCompressor(level=6).compress(payload)
            job.result = payload
            publish(job, Status.COMPLETED, "Completed.", data=payload)
        except BaseException as e:  # noqa: BLE001 - every failure is reported to the client
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-4))
            logger.info("job %s failed: %s", job.id, text.strip().splitlines()[-1])
            publish(job, Status.ERROR, text.strip())
        finally:
            job.blob = b""

    @app.get("/ping")
    def ping() -> str:
        return "pong"

    @app.get("/status")
    def status() -> dict:
        repo = json.loads(model_key.split(":", 1)[1])
        return {"deployments": {repo["repo_id"]: {
            "model_key": model_key, "repo_id": repo["repo_id"], "task": repo.get("task"),
            "revision": repo.get("revision"), "deployment_level": "HOT",
            "application_state": "RUNNING"}}}

    @app.websocket("/subscribe")
    async def subscribe(ws: WebSocket) -> None:
        await ws.accept()
        session_id = uuid.uuid4().hex
        sessions[session_id] = (ws, asyncio.get_running_loop())
        try:
            await ws.send_text(json.dumps({"session_id": session_id}))
            while True:
                await ws.receive_text()  # clients send nothing; this waits for the close
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            sessions.pop(session_id, None)
            for job in jobs.values():  # a closed session cancels its jobs still queued
                if job.session_id == session_id and job.status is not None \
                        and job.status.status in (Status.RECEIVED, Status.QUEUED):
                    job.cancelled = True

    @app.post("/request")
    async def submit(request: Request) -> Any:
        if not authorised(request.headers.get("ndif-api-key")):
            return unauthorised()
        form = await request.form()
        try:
            envelope = RequestModel.model_validate_json(form["data"])
            blob = await form["blob"].read()
        except (KeyError, AttributeError, ValueError) as e:
            return JSONResponse(status_code=400, content={
                "detail": f"Malformed request: {type(e).__name__}."})
        if envelope.model_key != model_key:
            return JSONResponse(status_code=404, content={
                "detail": f"Model not served here: {envelope.model_key}. This server serves "
                          f"{model_key}."})
        job = _Job(id=uuid.uuid4().hex, session_id=envelope.session_id, blob=blob,
                   compress=envelope.compress, env=dict(envelope.env))
        job.status = ResponseModel(id=job.id, status=Status.RECEIVED,
                                   description="Your job has been received.")
        jobs[job.id] = job
        received = job.status.model_dump_json()  # before the worker moves the job on
        asyncio.get_running_loop().run_in_executor(executor, run, job)
        return Response(received, media_type="application/json")

    @app.get("/response/{job_id}")
    def response(job_id: str, request: Request) -> Any:
        if not authorised(request.headers.get("ndif-api-key")):
            return unauthorised()
        job = jobs.get(job_id)
        if job is None or job.status is None:
            return JSONResponse(status_code=404, content={"detail": "No such job."})
        current = job.status
        if current.status == Status.COMPLETED:  # a download URL, like NDIF's presigned one
            current = current.model_copy(update={"data": str(request.url_for("result",
                                                                              job_id=job_id))})
        return Response(current.model_dump_json(), media_type="application/json")

    @app.get("/result/{job_id}", name="result")
    def result(job_id: str) -> Any:
        job = jobs.get(job_id)  # the id is the secret, as in a presigned URL
        if job is None or job.result is None:
            return JSONResponse(status_code=404, content={"detail": "No such result."})
        return Response(job.result, media_type="application/octet-stream")

    @app.put("/_loopback/queue_delay")
    def set_queue_delay(seconds: float, request: Request) -> Any:
        """Test control (loopback only): how long jobs wait in QUEUED."""
        if not authorised(request.headers.get("ndif-api-key")):
            return unauthorised()
        settings["queue_delay_s"] = max(0.0, float(seconds))
        return {"queue_delay_s": settings["queue_delay_s"]}

    @app.post("/_loopback/disconnect")
    async def disconnect(request: Request) -> Any:
        """Test control (loopback only): close every websocket session, as a network drop would."""
        if not authorised(request.headers.get("ndif-api-key")):
            return unauthorised()
        targets = list(sessions.values())
        for ws, _ in targets:
            await ws.close(code=1011)
        return {"closed": len(targets)}

    return app


def serve(folder: str, *, port: int, queue_delay_s: float = 0.0) -> None:
    """Load ``folder`` and serve it on 127.0.0.1:``port`` until interrupted.

    The accepted API key is read from the ``NDIF_LOOPBACK_API_KEY`` environment variable
    (unset: any request is accepted).
    """
    import uvicorn

    model, key = _served_model(str(Path(folder).expanduser().resolve()))
    app = create_app(model, key, api_key=os.environ.get(API_KEY_ENV) or None,
                     queue_delay_s=queue_delay_s)
    # a short graceful shutdown: uvicorn otherwise waits for open websockets forever
    uvicorn.run(app, host=LOOPBACK_HOST, port=port, log_level="warning",
                timeout_graceful_shutdown=1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK_HOST, 0))
        return s.getsockname()[1]


# anyio first, whatever importing the explorer package may pull in (see the top of the module)
_CHILD = ("import sys, anyio._backends._asyncio; from explorer.ndif_server import main; "
          "sys.exit(main(sys.argv[1:]))")


class LoopbackServer:
    """Run the loopback server in a child process (a context manager).

    Parameters
    ----------
    folder : str or os.PathLike
        A Hugging Face model folder; the server serves it, the client loads the same folder
        with ``load_model(folder, remote=True)``.
    api_key : str, optional
        The key the server accepts (passed to the child through its environment).
    queue_delay_s : float, default=0.0
    startup_timeout_s : float, default=120.0

    Attributes
    ----------
    url : str
        ``http://127.0.0.1:PORT``; set ``NDIF_HOST`` to it.
    """

    def __init__(self, folder: str | os.PathLike, *, api_key: str | None = None,
                 queue_delay_s: float = 0.0, startup_timeout_s: float = 120.0):
        self.folder = str(folder)
        self._api_key = api_key
        self.queue_delay_s = queue_delay_s
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.url = ""
        self._proc: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"LoopbackServer({self.folder!r}, url={self.url!r})"

    def start(self) -> "LoopbackServer":
        import httpx

        self.port = _free_port()
        self.url = f"http://{LOOPBACK_HOST}:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        if self._api_key:
            env[API_KEY_ENV] = self._api_key
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, self.folder, "--port", str(self.port),
             "--queue-delay", str(self.queue_delay_s)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"loopback NDIF server exited during start-up:\n{err}")
            try:
                if httpx.get(f"{self.url}/ping", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"loopback NDIF server did not answer within {self.startup_timeout_s} s.")

    def set_queue_delay(self, seconds: float) -> None:
        """How long jobs wait in QUEUED from now on."""
        import httpx

        headers = {"ndif-api-key": self._api_key} if self._api_key else None
        httpx.put(f"{self.url}/_loopback/queue_delay", params={"seconds": seconds},
                  headers=headers, timeout=10).raise_for_status()

    def disconnect(self) -> int:
        """Close every open websocket session on the server; returns how many were closed."""
        import httpx

        headers = {"ndif-api-key": self._api_key} if self._api_key else None
        reply = httpx.post(f"{self.url}/_loopback/disconnect", headers=headers, timeout=10)
        reply.raise_for_status()
        return reply.json()["closed"]

    def job_status(self, job_id: str) -> dict:
        """The server's latest record of a job (``GET /response/{id}``), as a dict."""
        import httpx

        headers = {"ndif-api-key": self._api_key} if self._api_key else None
        reply = httpx.get(f"{self.url}/response/{job_id}", headers=headers, timeout=10)
        reply.raise_for_status()
        return reply.json()

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None

    def __enter__(self) -> "LoopbackServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m explorer.ndif_server",
        description="Serve a local model folder over nnsight's NDIF protocol on 127.0.0.1 "
                    f"(the API key, if any, comes from ${API_KEY_ENV}).")
    parser.add_argument("folder", help="Hugging Face model folder")
    parser.add_argument("--port", type=int, default=8289)
    parser.add_argument("--queue-delay", type=float, default=0.0, metavar="SECONDS",
                        help="time each job waits in QUEUED (simulates a busy deployment)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    serve(args.folder, port=args.port, queue_delay_s=args.queue_delay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
