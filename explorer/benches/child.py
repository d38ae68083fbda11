"""A server in a child process: started, waited for until it answers, stopped.

What the serving bench, the figure scripts and the tests that start ``explorer serve``,
JupyterLab or a page server share. The wait is on the condition itself: the child's port
answers (and, with ``own_port``, the child process itself listens on it, not another
server that took the port meanwhile), with a deadline; a child that exits early raises
with the tail of its output.
"""
from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

__all__ = ["unused_port", "answers", "listens", "child_server", "stop"]


def unused_port() -> int:
    """A port on 127.0.0.1 that the system reports unused now (it may be taken before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts a connection on ``host:port`` now."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on ``port``."""
    import psutil

    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="inet"))
    except psutil.Error:
        return False


def stop(proc: subprocess.Popen, grace: float = 10) -> None:
    """Terminate ``proc``; kill it if it has not exited after ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace)


def _tail(paths: Sequence[Path]) -> str:
    return "".join(p.read_text(errors="replace") for p in paths if p.exists())[-2000:]


@contextlib.contextmanager
def child_server(argv: Sequence[str], port: int, *, log: Path | None = None,
                 errors: Path | None = None, env: dict[str, str] | None = None,
                 cwd: Path | str | None = None, timeout: float = 240, own_port: bool = False,
                 poll: float = 0.2, quiet: bool = False) -> Iterator[subprocess.Popen]:
    """Run ``argv`` (a server that listens on ``port`` of 127.0.0.1) until the block ends.

    Yields the process once the port answers (with ``own_port``: once the child itself
    listens on it). Its stdout (and stderr, unless ``errors`` names a file of its own) goes
    to ``log``; without one, where ours goes (dropped with ``quiet``). RuntimeError, with
    the output's tail, if the child exits first or does not answer in ``timeout`` seconds.
    """
    with contextlib.ExitStack() as files:
        inherit = subprocess.DEVNULL if quiet else None
        out: IO | int | None = files.enter_context(open(log, "w")) if log else inherit
        err: IO | int | None = files.enter_context(open(errors, "w")) if errors else (
            subprocess.STDOUT if log else inherit)
        proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            deadline = time.monotonic() + timeout
            while not (answers(port) and (not own_port or listens(proc.pid, port))):
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited (code {proc.returncode}): "
                                       + _tail([p for p in (log, errors) if p]))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not answer on port {port} in {timeout:.0f} s")
                time.sleep(poll)
            yield proc
        finally:
            stop(proc, 20)
