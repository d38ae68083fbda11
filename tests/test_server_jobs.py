"""The shared server's rationing: one queue for heavy jobs, bounded caches, memory given back.

`apps._server.JobQueue` is checked with real threads (the order jobs start in, the limit, the
places each waiting job is told, cancelling while in line); the runners of `apps._view.View`
are checked to send heavy jobs through it and light ones past it.
"""
from __future__ import annotations

import functools
import threading

import numpy as np
import param
import pytest
from _browser import wait_until

from apps import _server
from apps._server import BoundedCache, JobQueue, QueueCancelled, place_text, release_memory
from apps._view import View

WAIT = 30  # seconds: generous on a loaded machine; the events below fire in milliseconds


def _start(queue: JobQueue, name: str, log: list, gate: threading.Event, places: dict,
           cancelled=lambda: False) -> threading.Thread:
    def job():
        try:
            with queue.turn(cancelled=cancelled,
                            on_place=lambda k: places.setdefault(name, []).append(k)):
                log.append(("start", name))
                assert gate.wait(WAIT)
                log.append(("end", name))
        except QueueCancelled:
            log.append(("left", name))

    t = threading.Thread(target=job, daemon=True)
    t.start()
    return t


_until = functools.partial(wait_until, timeout=WAIT, interval=0.005)


def test_jobs_start_in_arrival_order_within_the_limit():
    queue = JobQueue(2)
    log: list = []
    places: dict = {}
    gates = {n: threading.Event() for n in "abcde"}
    threads = []
    for name in "abcde":
        threads.append(_start(queue, name, log, gates[name], places))
        _until(lambda: queue.running + queue.waiting == len(threads))
    assert [e for e in log if e[0] == "start"] == [("start", "a"), ("start", "b")]
    assert queue.running == 2 and queue.waiting == 3
    assert places == {"c": [1], "d": [2], "e": [3]}            # each told its place on arrival
    gates["b"].set()                                           # b ends: c starts, d and e move up
    _until(lambda: ("start", "c") in log)
    _until(lambda: places["e"][-1] == 2)
    assert places["d"][-1] == 1
    for g in gates.values():
        g.set()
    for t in threads:
        t.join(WAIT)
    starts = [n for kind, n in log if kind == "start"]
    assert starts == list("abcde") and queue.running == 0 and queue.waiting == 0


def test_a_cancelled_job_leaves_the_line_and_the_others_move_up():
    queue = JobQueue(1)
    log: list = []
    places: dict = {}
    gate = threading.Event()
    flag = threading.Event()
    a = _start(queue, "a", log, gate, places)
    _until(lambda: queue.running == 1)
    b = _start(queue, "b", log, gate, places, cancelled=flag.is_set)
    _until(lambda: queue.waiting == 1)
    c = _start(queue, "c", log, gate, places)
    _until(lambda: queue.waiting == 2)
    flag.set()                                                 # b is cancelled while waiting
    _until(lambda: ("left", "b") in log)
    _until(lambda: places["c"][-1] == 1)
    gate.set()
    for t in (a, b, c):
        t.join(WAIT)
    assert [n for kind, n in log if kind == "start"] == ["a", "c"]


def test_cancel_owner_takes_a_closed_sessions_jobs_out():
    queue = JobQueue(1)
    gate = threading.Event()
    results: list = []

    def job(owner):
        try:
            with queue.turn(owner=owner):
                results.append(owner)
                gate.wait(WAIT)
        except QueueCancelled:
            results.append(f"{owner} left")

    threads = [threading.Thread(target=job, args=(o,), daemon=True) for o in ("s1", "s2", "s2", "s3")]
    for t in threads:
        t.start()
        _until(lambda: queue.running + queue.waiting == threads.index(t) + 1)
    assert queue.cancel_owner("s2") == 2
    gate.set()
    for t in threads:
        t.join(WAIT)
    assert results.count("s2 left") == 2 and results[0] == "s1" and "s3" in results


def test_limit_is_checked_and_can_grow_while_jobs_wait():
    with pytest.raises(ValueError, match=r"heavy-job limit must be an int >= 1; got 0"):
        JobQueue(0)
    queue = JobQueue(1)
    log: list = []
    gate = threading.Event()
    threads = [_start(queue, n, log, gate, {}) for n in "ab"]
    _until(lambda: queue.running == 1 and queue.waiting == 1)
    queue.limit = 2                                           # a second slot opens at once
    _until(lambda: queue.running == 2)
    gate.set()
    for t in threads:
        t.join(WAIT)


def test_default_limit_from_the_environment(monkeypatch):
    monkeypatch.setenv(_server.HEAVY_JOBS_ENV, "3")
    assert _server._default_limit() == 3
    monkeypatch.setenv(_server.HEAVY_JOBS_ENV, "none")
    with pytest.raises(ValueError, match="EXPLORER_HEAVY_JOBS must be an int >= 1; got 'none'"):
        _server._default_limit()
    monkeypatch.delenv(_server.HEAVY_JOBS_ENV)
    monkeypatch.setattr(_server.os, "cpu_count", lambda: 2)
    assert _server._default_limit() == 1
    monkeypatch.setattr(_server.os, "cpu_count", lambda: 16)
    assert _server._default_limit() == 8


def test_place_text():
    assert place_text(1, 1) == ("Waiting for the server: next in line (1 heavy job running). "
                                "Cancel leaves the line.")
    assert place_text(2, 2).startswith("Waiting for the server: 2nd in line (2 heavy jobs running)")
    assert [place_text(n, 1).split(": ")[1].split(" in")[0] for n in (3, 4, 11, 12, 13, 21, 22)] == \
        ["3rd", "4th", "11th", "12th", "13th", "21st", "22nd"]


def test_bounded_cache_keeps_the_most_recent_within_both_bounds():
    cache = BoundedCache(max_items=3, max_bytes=None)
    for k in "abcd":
        cache[k] = k
    assert list(cache) == ["b", "c", "d"]
    cache["b"]                                                 # a read makes b the newest
    cache["e"] = "e"
    assert list(cache) == ["d", "b", "e"]
    assert cache.get("zz") is None and cache.get("d") == "d"
    sized = BoundedCache(max_items=100, max_bytes=3 * 800)
    for i in range(5):
        sized[i] = (np.zeros(100), {"x": np.zeros(0)})        # 800 bytes each
    assert list(sized) == [2, 3, 4] and sized.nbytes == 2400
    sized["big"] = np.zeros(1000)                              # alone over the bound: kept alone
    assert list(sized) == ["big"]
    with pytest.raises(ValueError, match="max_items must be >= 1"):
        BoundedCache(max_items=0)


def test_release_memory_runs_on_linux():
    import sys

    assert release_memory() is sys.platform.startswith("linux")


class _Jobs(View):
    got = param.List(default=[])

    def __init__(self, **params):
        super().__init__(background=True, **params)
        self.runner("heavy", lambda v: self.got.append(v), progress=True)
        self.runner("light", lambda v: self.got.append(v))


def test_views_send_heavy_jobs_through_the_queue_and_light_ones_past_it(monkeypatch):
    queue = JobQueue(1)
    monkeypatch.setattr(_server, "_QUEUE", queue)
    first, second = _Jobs(), _Jobs()
    assert first._runners["heavy"].heavy and not first._runners["light"].heavy
    gate = threading.Event()
    first.status = "Computing the circuit"
    first.submit("heavy", lambda token: (gate.wait(WAIT), "first heavy")[1])
    _until(lambda: queue.running == 1)
    second.status = "Computing scores"
    second.submit("heavy", lambda token: "second heavy")
    _until(lambda: queue.waiting == 1)
    _until(lambda: second.status.startswith("Waiting for the server: next in line"))
    second.submit("light", lambda token: "light")              # not queued behind the heavy ones
    _until(lambda: "light" in second.got)
    assert "second heavy" not in second.got
    gate.set()
    _until(lambda: "second heavy" in second.got and "first heavy" in first.got)
    assert second.status.startswith("Computing scores")       # its own status back once it ran
    assert "Waiting for the server" not in second.status


def test_cancelling_a_view_takes_its_job_out_of_the_line(monkeypatch):
    queue = JobQueue(1)
    monkeypatch.setattr(_server, "_QUEUE", queue)
    first, second = _Jobs(), _Jobs()
    gate = threading.Event()
    ran = threading.Event()
    first.submit("heavy", lambda token: gate.wait(WAIT))
    _until(lambda: queue.running == 1)
    second.submit("heavy", lambda token: ran.set())
    _until(lambda: queue.waiting == 1)
    second.close()                                             # e.g. its tab was closed
    _until(lambda: queue.waiting == 0)
    gate.set()
    first.wait(WAIT)
    assert not ran.is_set()


def test_sessions_share_one_model_and_its_weights():
    """Every session's gallery reads the same loaded model: its weights exist once per server."""
    from apps._session import get_model, loaded_models
    from apps.gallery import Gallery

    first, second = Gallery("tiny-llama"), Gallery("tiny-llama")
    assert first._model is second._model is get_model("tiny-llama")
    a = dict(first._model.hf.named_parameters())
    b = dict(second._model.hf.named_parameters())
    assert all(a[name].data_ptr() == b[name].data_ptr() for name in a)
    assert loaded_models().count("tiny-llama") == 1
    first.close()
    second.close()
