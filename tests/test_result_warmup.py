"""The result cache's warm-up (`apps._result_warmup`): the cached pages' results on their
default inputs computed before anyone opens them, so a page opened afterwards shows them from
the cache; ``explorer serve`` starts it in a child process only once its server listens, and
it stays off with ``EXPLORER_WARM_CACHE=off`` or the cache off. In-process, tiny-llama."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import threading

import pytest
import xarray as xr

from apps import _result_cache as rc
from apps import _result_warmup as rw
from _browser import free_port

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NOTE = "Shown from the result cache (computed "


def _opened(slug: str):
    """The page ``slug`` as a new session of the gallery opens it (tiny-llama)."""
    from apps.gallery import VIEWS, Gallery

    (row,) = [v for v in VIEWS if v[1] == slug]
    return Gallery("tiny-llama", views=[row], view=slug).page(slug)


def test_a_page_opened_after_the_warm_up_shows_its_result_from_the_cache(cache_on,
                                                                       prompt_calls):
    from apps.gallery import DEFAULT_PROMPT
    from explorer.analyses.saturation import saturation_layers

    done = rw.warm_result_cache("tiny-llama", ["saturation"])
    assert [(slug, state) for slug, state, _ in done] == [("saturation", "computed")]
    assert [prompt for _, prompt, _ in prompt_calls] == [DEFAULT_PROMPT]
    page = _opened("saturation")
    assert [prompt for _, prompt, _ in prompt_calls] == [DEFAULT_PROMPT]                           # nothing ran
    assert page.result_note.startswith(NOTE)
    model = page._model
    k = min(10, model.vocab_size)
    fresh = saturation_layers(model, [DEFAULT_PROMPT], k=k,
                              rank_cap=min(model.vocab_size, max(50, k)), sample_positions=0,
                              edits=[], progress=False)
    xr.testing.assert_equal(page.prompt_result, fresh)
    # a second warm-up finds the entry there and computes nothing
    again = rw.warm_result_cache("tiny-llama", ["saturation"])
    assert [(slug, state) for slug, state, _ in again] == [("saturation", "cached")]
    assert [prompt for _, prompt, _ in prompt_calls] == [DEFAULT_PROMPT]


def test_every_warmed_page_opens_from_the_cache(cache_on):
    done = rw.warm_result_cache("tiny-llama")
    assert [(slug, state) for slug, state, _ in done] == [(s, "computed") for s in rw.WARM_PAGES]
    for slug in rw.WARM_PAGES:
        page = _opened(slug)
        if slug == "features":     # its feature index is read from the activation store
            assert page.cached is True and "from the cache" in page.status
            continue
        notes = [getattr(page, name, "") for name in ("result_note", "_scores_note")]
        assert any(str(n).startswith(NOTE) for n in notes), (slug, notes)


def test_the_warm_up_stays_off(cache_on, monkeypatch, prompt_calls):
    monkeypatch.setenv(rc.WARM_ENV_VAR, "off")
    assert not rc.warmup_wanted() and rc.start_warmup("tiny-llama") is None
    monkeypatch.setenv(rc.WARM_ENV_VAR, "on")
    monkeypatch.setenv(rc.ENV_VAR, "off")
    assert not rc.warmup_wanted() and rc.start_warmup("tiny-llama") is None
    assert rw.warm_result_cache("tiny-llama") == [] and prompt_calls == []
    with pytest.raises(ValueError, match="no gallery page 'lense'"):
        monkeypatch.setenv(rc.ENV_VAR, "on")
        rw.warm_result_cache("tiny-llama", ["lense"])


def test_the_child_process_fills_the_cache(cache_on):
    child = rc.start_warmup("tiny-llama")
    assert isinstance(child, subprocess.Popen)
    assert child.wait(timeout=600) == 0
    entries = [p for p in cache_on.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(entries) >= len(rw.WARM_PAGES)
    assert _opened("saturation").result_note.startswith(NOTE)


def test_serve_starts_the_warm_up_once_it_listens(monkeypatch):
    """The warm-up starts on the server's loop after the socket is bound: a connection to the
    port succeeds at that moment, and `serve` itself has returned control to the loop."""
    import apps.gallery as gallery

    port = free_port()
    seen: list[tuple[str, bool]] = []
    servers = []

    def fake_start(model: str) -> None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                listening = True
        except OSError:
            listening = False
        seen.append((model, listening))
        from tornado.ioloop import IOLoop

        IOLoop.current().stop()

    monkeypatch.setattr(gallery, "start_warmup", fake_start)

    def run(**options) -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())
        from tornado.ioloop import IOLoop

        if options:   # no warm-up to stop the loop: stop it a moment after it starts
            IOLoop.current().call_later(1.0, IOLoop.current().stop)
        servers.append(gallery.serve(model="tiny-llama", port=port, show=False, **options))

    for options in ({}, {"warm_cache": False}):
        thread = threading.Thread(target=run, kwargs=options, daemon=True)
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
        servers.pop().stop()
    assert seen == [("tiny-llama", True)]


def test_the_child_lowers_its_priority_and_says_why_it_stopped(cache_on, monkeypatch, capsys):
    niced, warmed = [], []
    monkeypatch.setattr(rw.os, "nice", lambda n: niced.append(n))
    monkeypatch.setattr(rw, "warm_result_cache",
                        lambda model, slugs, say: warmed.append((model, slugs)))
    assert rw.main(["--model", "tiny-llama", "--pages", "saturation,features"]) == 0
    assert niced == [rw.NICE] and rw.NICE > 0
    assert warmed == [("tiny-llama", ["saturation", "features"])]
    monkeypatch.undo()
    monkeypatch.setattr(rw.os, "nice", lambda n: None)
    monkeypatch.setenv("EXPLORER_CACHE", str(cache_on.parent))
    monkeypatch.setenv(rc.ENV_VAR, "on")
    assert rw.main(["--model", "tiny-llama", "--pages", "lense"]) == 1
    assert "stopped: ValueError: no gallery page 'lense'" in capsys.readouterr().err


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (no such process, or a zombie left to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_child_stops_when_its_server_is_killed(cache_on):
    """A server ended without running its exit handlers (SIGKILL, or SIGTERM's default) leaves
    no warm-up behind: the child sees its parent gone and exits."""
    import os
    import sys
    import time
    from pathlib import Path

    code = ("import os; from apps._result_cache import start_warmup; "
            "c = start_warmup('tiny-llama'); print(c.pid, flush=True); os._exit(0)")
    root = Path(rw.__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 30        # the warm-up itself takes minutes at its priority
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _gone(pid)
