"""`explorer.benches.child.child_server`: the wait every served page, Lab and bench uses.

The children are plain Python one-liners (no project import): a socket server, one that
exits at once, one that never listens. Each case is checked from outside: a connection to
the port, the process's exit status, the error's text.
"""
from __future__ import annotations

import socket
import sys
import time

import pytest

from explorer.benches.child import answers, child_server, listens, unused_port
from tests._browser import free_port

pytestmark = pytest.mark.slow   # starts child interpreters

SERVE = ("import socket, time\n"
         "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
         "s.bind(('127.0.0.1', {port})); s.listen(); print('listening', flush=True)\n"
         "time.sleep(60)\n")


def test_yields_once_the_child_listens_and_stops_it_afterwards(tmp_path):
    port = free_port()
    log = tmp_path / "child.log"
    with child_server([sys.executable, "-c", SERVE.format(port=port)], port, log=log,
                      own_port=True, timeout=30) as proc:
        assert proc.poll() is None
        assert listens(proc.pid, port) and answers(port)
        with socket.create_connection(("127.0.0.1", port), timeout=3):
            pass
    assert proc.poll() is not None, "the child still runs after the block"
    assert not answers(port)
    assert log.read_text().strip() == "listening"


def test_a_child_that_exits_raises_with_its_output(tmp_path):
    port = free_port()
    code = "import sys; print('no model called nope', file=sys.stderr); sys.exit(3)"
    with pytest.raises(RuntimeError, match=r"exited \(code 3\).*no model called nope"), \
            child_server([sys.executable, "-c", code], port, log=tmp_path / "c.log", timeout=30):
        pytest.fail("yielded for a child that never listened")


def test_a_child_that_never_answers_times_out(tmp_path):
    port = unused_port()
    assert not answers(port)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"did not answer on port {port} in 1 s"), \
            child_server([sys.executable, "-c", "import time; time.sleep(60)"], port,
                         log=tmp_path / "c.log", timeout=1):
        pytest.fail("yielded for a child that never listened")
    assert time.monotonic() - started < 15


def test_own_port_waits_for_the_child_not_for_whoever_holds_the_port(tmp_path):
    """Another process's server on the port answers, but the child is not the one
    listening: with ``own_port`` that is not ready."""
    port = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        assert answers(port)
        with pytest.raises(RuntimeError, match="did not answer"), \
                child_server([sys.executable, "-c", "import time; time.sleep(60)"], port,
                             log=tmp_path / "c.log", timeout=1, own_port=True):
            pytest.fail("took another process's port for the child's")
        with child_server([sys.executable, "-c", "import time; time.sleep(60)"], port,
                          log=tmp_path / "c2.log", timeout=5) as proc:
            assert proc.poll() is None     # without own_port, an answer is enough
