"""`explorer serve` as a user starts it: the real server, probed from outside.

By default it listens on loopback only (read from its sockets); ``--address`` changes that, and
off loopback it needs a sign-in or an explicit ``--no-auth`` (tests/test_serve_auth.py). Only
127.0.0.1 is ever connected to: a server bound to 0.0.0.0 answers there too.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import psutil
import pytest

from explorer.benches.child import child_server
from tests._browser import ROOT, free_port


@contextlib.contextmanager
def serving(tmp_path, *extra: str, env: dict[str, str] | None = None
            ) -> Iterator[tuple[subprocess.Popen, int]]:
    """`explorer serve --model tiny-llama` with ``extra`` flags (and ``env`` added to the
    environment) on a free port, until it answers; stdout and stderr go to
    ``serve-PORT.log`` / ``.err`` in ``tmp_path``."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    errors = tmp_path / f"serve-{port}.err"
    argv = [sys.executable, "-m", "explorer.cli", "serve", "--model", "tiny-llama", "--port",
            str(port), *extra]
    with child_server(argv, port, log=log, errors=errors, cwd=ROOT, timeout=180, poll=0.3,
                      env={**os.environ, **(env or {})}) as proc:
        yield proc, port


def _listening(proc: subprocess.Popen, port: int) -> set[str]:
    """The local addresses the server process listens on at ``port``."""
    return {c.laddr.ip for c in psutil.Process(proc.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_serve_listens_on_loopback_only_by_default(tmp_path):
    with serving(tmp_path) as (proc, port):
        assert _listening(proc, port) == {"127.0.0.1"}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=60) as page:
            assert page.status == 200 and b"bokeh" in page.read().lower()
    assert "serving the explorer gallery (tiny-llama) at http://127.0.0.1:" in \
        next(tmp_path.glob("serve-*.log")).read_text()


@pytest.mark.slow
def test_serve_address_flag_changes_the_binding(tmp_path):
    with serving(tmp_path, "--address", "0.0.0.0", "--no-auth") as (proc, port):
        assert _listening(proc, port) == {"0.0.0.0"}
        assert _connects("127.0.0.1", port)
    err = next(tmp_path.glob("serve-*.err")).read_text()
    assert "warning: --no-auth on 0.0.0.0: anyone who can reach the port can run the model" in err
