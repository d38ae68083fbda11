"""The view base (apps/_view.py): runners, posting from workers, progress, errors, close.

A served session is stood in by a Bokeh document whose next-tick callbacks run on a loop thread
of their own (as the server's event loop runs them), so the tests can tell on which thread each
result and each posted value reaches the page.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import queue
import threading
import time
import weakref
from pathlib import Path

import panel as pn
import param
import pytest
from _browser import wait_until
from bokeh.document import Document
from panel.io.state import set_curdoc

from apps import theme
from apps._session import Cancelled
from apps._view import View, serve

APPS = Path(__file__).resolve().parents[1] / "apps"
NOT_VIEWS = {"gallery.py", "theme.py", "notebook.py"}   # and the helper modules, apps/_*.py



class _Request:
    arguments: dict = {}
    cookies: dict = {}
    headers: dict = {}


class _Context:
    id = "test-session"
    request = _Request()


class LoopDoc:
    """A document of a served session: next-tick callbacks run in order on ``thread``."""

    def __init__(self):
        self.doc = Document()
        self._context = _Context()      # the session context only has to exist
        self.doc._session_context = weakref.ref(self._context)
        self.doc.add_next_tick_callback = self._queue_put
        self._queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="session-loop", daemon=True)
        self.thread.start()
        pn.state._loaded[self.doc] = True

    def _queue_put(self, fn):
        self._queue.put(fn)

    def _loop(self):
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            fn()

    def drain(self, timeout=5):
        """Wait until every callback queued so far has run."""
        done = threading.Event()
        self._queue.put(done.set)
        assert done.wait(timeout), "the loop did not drain"

    def stop(self):
        self._queue.put(None)
        self.thread.join(5)
        pn.state._loaded.pop(self.doc, None)


@pytest.fixture
def loop_doc():
    loop = LoopDoc()
    yield loop
    loop.stop()


class Page(View):
    notify_title = "Lab"

    result = param.Parameter(default=None)

    def __init__(self, **params):
        super().__init__(**params)
        self.delivered_on: list[threading.Thread] = []
        self.runner("work", self._got, progress=True, heavy=False)  # two run side by side
        self.runner("other", self._got)

    def _got(self, value):
        self.delivered_on.append(threading.current_thread())
        self.result = value

    def __panel__(self):
        return pn.Column(pn.pane.Markdown(self.param.status), pn.pane.Markdown(self.param.error))


_wait_until = functools.partial(wait_until, timeout=5.0, interval=0.01)


@pytest.mark.parametrize("shown", [None, 7])
def test_the_stop_button_replaces_a_progress_line_and_a_page_cancel_does_not(shown):
    """The sidebar's stop button (`SessionHooks.stop_all`) stops a page's job: its last
    progress line gives way to "Stopped before it finished" (naming the result still shown)
    and the progress bar goes; a page superseding its own job says nothing."""
    from apps._session import session_hooks

    page = Page(background=True, result=shown)
    release = threading.Event()

    def job(token):
        page.post(status="scoring heads: 480/810, about 326 s left", progress=59,
                  progress_active=True)
        while not release.wait(0.01):
            token.check()

    try:
        page.submit("work", job)
        assert _wait_until(lambda: page.status.startswith("scoring heads"))
        page.cancel("work")                              # the page's own cancel
        assert page.status.startswith("scoring heads")
        page.submit("work", job)
        assert _wait_until(lambda: page._runners["work"].running)
        assert session_hooks(None).stop_all() >= 1       # the stop button
        assert page.status == ("Stopped before it finished: the previous result is still shown."
                               if shown is not None else "Stopped before it finished.")
        assert not page.progress_active and not page.running
    finally:
        release.set()
        page.close()


def test_results_and_posts_reach_the_page_on_the_documents_tick_not_the_worker(loop_doc):
    with set_curdoc(loop_doc.doc):
        page = Page()                  # served: jobs run in worker threads
    seen = []
    page.param.watch(lambda *events: seen.extend((e.name, e.new, threading.current_thread())
                                                 for e in events),
                     ["status", "progress", "progress_active"])
    workers = []

    def job(token):
        workers.append(threading.current_thread())
        page.post(status="half way")
        report = page.progress_fn(token)
        report(1, 4)
        report(2, 4)
        report(4, 4)
        return 42

    page.submit("work", job)
    assert _wait_until(lambda: page.result == 42)
    loop_doc.drain()
    (worker,) = workers
    assert worker is not loop_doc.thread and worker is not threading.main_thread()
    assert page.delivered_on == [loop_doc.thread]
    assert seen and all(thread is loop_doc.thread for *_, thread in seen)
    values = [(name, new) for name, new, _ in seen]
    assert values[0] == ("status", "half way")
    assert [v for n, v in values if n == "progress"] == [25, 50, 100]
    assert ("progress_active", True) in values and page.progress_active is False


def test_unserved_background_jobs_run_in_a_worker_and_inline_jobs_here():
    page = Page(background=True)
    page.submit("work", lambda token: threading.current_thread())
    page.wait(5)
    assert page.result is not threading.main_thread()
    inline = Page()                    # not served: inline (tests, notebooks)
    inline.submit("work", lambda token: threading.current_thread())
    assert inline.result is threading.main_thread() and inline.delivered_on == [threading.main_thread()]


def test_inline_jobs_on_a_served_page_post_at_once_so_their_result_comes_last(loop_doc):
    with set_curdoc(loop_doc.doc):
        page = Page(background=False)

    def job(token):
        page.post(status="working…")
        return "done"

    with set_curdoc(loop_doc.doc):
        page.submit("work", job)
    page.status = f"result {page.result}"
    loop_doc.drain()
    assert page.result == "done" and page.status == "result done"   # no late post overwrote it


def test_cancel_stops_a_running_job_and_drops_its_result():
    page = Page(background=True)
    started, stopped = threading.Event(), threading.Event()

    def job(token):
        started.set()
        try:
            for _ in range(500):
                token.check()
                time.sleep(0.01)
        except Cancelled:
            stopped.set()
            raise
        return "finished"

    page.submit("work", job)
    assert started.wait(5)
    assert _wait_until(lambda: page.busy)           # past the runner's busy delay
    page.cancel("work")
    assert stopped.wait(5)                          # the job saw the cancel and stopped
    page.wait(5)
    assert page.result is None and page.busy is False


def test_a_failing_job_shows_in_the_error_pane_and_clears_busy(notes):
    page = Page(background=True)
    layout = page.__panel__()
    status_pane, error_pane = layout
    gate = threading.Event()

    def job(token):
        gate.wait(5)
        raise RuntimeError("boom")

    page.submit("work", job)
    assert _wait_until(lambda: page.busy)
    gate.set()
    page.wait(5)
    assert page.busy is False and page.running is False and page.result is None
    assert page.error == "RuntimeError: boom" and error_pane.object == "RuntimeError: boom"
    assert page.status == "Failed: RuntimeError: boom" == status_pane.object
    assert notes == [("error", "Lab: RuntimeError: boom")]
    page.submit("work", lambda token: (_ for _ in ()).throw(ValueError("`n` must be positive")))
    page.wait(5)
    assert page.error == "`n` must be positive"    # a user's error: its message alone


def test_show_error_words_user_errors_and_busy_changes_only_when_it_changes(notes):
    import explorer

    page = Page()
    page.show_error(explorer.ExplorerError("`steps` must be an int in [1, 100]; got 0."))
    assert page.status == "Failed: `steps` must be an int in [1, 100]; got 0."
    assert notes[-1] == ("error", "Lab: `steps` must be an int in [1, 100]; got 0.")
    page.show_error(RuntimeError("boom"))           # not a user error: its type is shown
    assert page.status == "Failed: RuntimeError: boom"
    seen = []
    page.param.watch(lambda e: seen.append(e.new), "busy")
    page._runner_busy("work", True), page._runner_busy("work", True), page._runner_busy("work", False)
    assert seen == [True, False]                     # no event when nothing changes


def test_busy_stays_while_another_runner_is_still_busy():
    page = Page(background=True)
    gate = threading.Event()
    page.submit("work", lambda token: gate.wait(5) and "slow")
    page.submit("other", lambda token: (time.sleep(0.5), "quick")[1])
    assert _wait_until(lambda: page.result == "quick")
    page._runners["other"].wait(5)
    assert page.busy                                # "work" is still going
    gate.set()
    page.wait(5)
    assert page.result == "slow" and page.busy is False


def test_close_cancels_every_runner_and_refuses_new_jobs():
    page = Page(background=True)
    stopped = {"work": threading.Event(), "other": threading.Event()}
    started = {"work": threading.Event(), "other": threading.Event()}

    def job(name):
        def run(token):
            started[name].set()
            while not token.cancelled:
                time.sleep(0.01)
            stopped[name].set()
            token.check()
        return run

    page.submit("work", job("work"))
    page.submit("other", job("other"))
    assert started["work"].wait(5) and started["other"].wait(5)
    page.close()
    assert stopped["work"].wait(5) and stopped["other"].wait(5)
    assert page.submit("work", lambda token: "late") is None
    page.wait(5)
    assert page.result is None


def test_status_reporter_throttles_and_reports_the_cancel(loop_doc):
    with set_curdoc(loop_doc.doc):
        page = Page()
    statuses = []
    page.param.watch(lambda e: statuses.append(e.new), "status")
    out = []

    def job(token):
        report = page.status_reporter(token, lambda d, t, s: f"step {d}/{t}", every=60)
        out.extend(report(i, 5) for i in range(1, 6))
        token.cancel()
        out.append(report(5, 5))
        return None

    page.submit("work", job)
    assert _wait_until(lambda: len(out) == 6)
    loop_doc.drain()
    assert statuses[:2] == ["step 1/5", "step 5/5"]  # the first, then nothing until the end
    assert out == [True] * 5 + [False]


def test_serve_does_nothing_on_import_and_serves_under_panel_serve(monkeypatch):
    built = []
    monkeypatch.setattr(pn.template.FastListTemplate, "servable",
                        lambda self, *a, **k: built.append(self) or self)
    serve("apps.anything", lambda m: built.append(m), title="T", model=False)
    assert built == []
    serve("bokeh_app_0123", lambda m: pn.pane.Markdown(f"model {m}"), title="A page", model=False)
    assert len(built) == 1 and built[0].title == "A page"


# -- every view uses the base ----------------------------------------------------------------

def _view_modules() -> list[str]:
    return sorted(p.stem for p in APPS.glob("*.py")
                  if p.name not in NOT_VIEWS and not p.name.startswith("_"))


def test_no_view_keeps_its_own_plumbing():
    offenders = []
    for name in _view_modules():
        tree = ast.parse((APPS / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in {
                    "_show_error", "_post", "_set_busy", "_failed"}:
                offenders.append(f"apps/{name}.py:{node.lineno} defines {node.name}")
            if isinstance(node, ast.Attribute) and node.attr == "add_next_tick_callback":
                offenders.append(f"apps/{name}.py:{node.lineno} schedules on the document itself")
    assert offenders == []


def test_every_view_derives_from_the_base():
    missing, found = [], {}
    for name in _view_modules():
        module = importlib.import_module(f"apps.{name}")
        viewers = [c for _, c in inspect.getmembers(module, inspect.isclass)
                   if c.__module__ == module.__name__ and issubclass(c, pn.viewable.Viewer)]
        found[name] = [c.__name__ for c in viewers]
        missing += [f"apps.{name}.{c.__name__}" for c in viewers if not issubclass(c, View)]
    assert missing == []
    assert all(found.values()), f"modules without a view: {[n for n, v in found.items() if not v]}"
    from apps._page_titles import PAGE_TITLES

    assert len(found) == len(PAGE_TITLES) + 2    # the gallery pages, the home page, the study app


def test_a_served_pages_job_progress_reaches_its_widgets_on_the_session_loop(loop_doc, tiny_model, notes):
    """The conflicts page once wrote its progress bar from the job thread: now every change of
    the bar's value and visibility, and the status the job reports, happen on the loop."""
    from explorer.analyses import conflicts as C
    from apps.conflicts import ConflictsView

    facts = [C.load_facts(["country_capital"])[i] for i in (0, 2)]
    with set_curdoc(loop_doc.doc):
        view = ConflictsView(tiny_model, facts=facts, closed_book=False, n_new=1)
    for _ in range(3):                               # example, then the bars it asks for
        view.wait(60)
        loop_doc.drain()
    assert view.bar_rows is not None
    changes = []
    view._progress.param.watch(lambda *events: changes.extend(
        (e.name, e.new, threading.current_thread()) for e in events), ["value", "visible"])
    statuses = []
    view.param.watch(lambda e: statuses.append((e.new, threading.current_thread())), "status")
    view._request("split")                           # the button's callback
    view.wait(120)
    loop_doc.drain()
    assert view.accuracy is not None and view.accuracy.sizes["fact"] == 2
    job_changes = [c for c in changes if c[2] is not threading.main_thread()]
    assert job_changes and all(thread is loop_doc.thread for *_, thread in job_changes)
    assert ("value", 100, loop_doc.thread) in changes and changes[-1][:2] == ("visible", False)
    assert ("scoring 2 facts…", loop_doc.thread) in statuses
    assert statuses[-1] == ("split scored (2 facts)", loop_doc.thread)
    view.close()


def test_every_gallery_page_has_the_one_serving_footer():
    """Each gallery page's standalone footer is `serve(__name__, ...)`; the study app (one
    session per participant, served by `explorer study run`) keeps its own `serve(folder)`."""
    wrong = []
    for name in _view_modules():
        if name == "study":
            continue
        tree = ast.parse((APPS / f"{name}.py").read_text())
        footers = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                   and getattr(n.value.func, "id", None) == "serve"
                   and getattr(n.value.args[0], "id", None) == "__name__"]
        own = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and n.attr in {"servable", "served"}]
        if len(footers) != 1 or own:
            wrong.append(f"apps/{name}.py: {len(footers)} serve footers, own serving at lines {own}")
    assert wrong == []


# -- reproducibility: export and code ------------------------------------------------------------

def _awkward() -> "xr.Dataset":
    import numpy as np
    import xarray as xr

    return xr.Dataset(
        {"score": (("layer", "head"), np.arange(6, dtype=np.float32).reshape(2, 3),
                   {"provenance": {"page": "x", "n": 3}, "unit": None}),
         "half": ("layer", np.array([0.5, 1.25], dtype=np.float16)),
         "big": ("layer", np.array([2**40, -3], dtype=np.int64)),
         "flag": ("layer", np.array([True, False])),
         "label": ("layer", np.array(["a", "bé"], dtype=object)),
         "curve": ("step", np.linspace(0, 1, 4)),
         "grid": (("a", "b", "c"), np.zeros((2, 2, 2)))},
        coords={"layer": [0, 1], "head": [0, 1, 2], "step": [10, 20, 30, 40],
                "name": ("head", ["L0.H0", "L0.H1", "L0.H2"])},
        attrs={"model_spec": {"n_layers": 2}, "remote": False, "note": None, "taus": [0.1, 0.2],
               "nested": [[1, 2]], "count": 3})


class DataPage(View):
    scores = param.ClassSelector(class_=object, default=None, precedence=-1)
    curve = param.Parameter(default=None, precedence=-1)
    runs = param.Dict(default={}, precedence=-1)
    table = param.Parameter(default=None, precedence=-1)
    layer = param.Integer(default=1)
    prompt = param.String(default="hello")


def test_netcdf_ready_keeps_every_value_and_turns_awkward_attrs_into_json():
    import io
    import json

    import numpy as np
    import xarray as xr

    from apps._view import JSON_ATTRS, netcdf_ready

    ds = _awkward()
    data = netcdf_ready(ds).to_netcdf(engine="scipy")      # raises on a dict / None / int64 attr
    back = xr.open_dataset(io.BytesIO(data), engine="scipy").load()
    np.testing.assert_array_equal(back["score"].values, ds["score"].values)
    np.testing.assert_array_equal(back["half"].values, [0.5, 1.25])
    np.testing.assert_array_equal(back["big"].values, [2.0**40, -3.0])   # past int32: as floats
    assert back["flag"].values.tolist() == [True, False]
    assert back["label"].values.tolist() == ["a", "bé"]
    assert back["name"].values.tolist() == ["L0.H0", "L0.H1", "L0.H2"]
    assert json.loads(back.attrs["model_spec"]) == {"n_layers": 2}
    assert json.loads(back.attrs["note"]) is None and json.loads(back.attrs["remote"]) is False
    assert sorted(json.loads(back.attrs[JSON_ATTRS])) == ["model_spec", "nested", "note", "remote"]
    assert back.attrs["count"] == 3 and list(back.attrs["taus"]) == [0.1, 0.2]
    assert json.loads(back["score"].attrs["provenance"]) == {"page": "x", "n": 3}
    assert ds.attrs["model_spec"] == {"n_layers": 2} and ds["big"].dtype == np.int64  # untouched


def test_the_default_export_finds_the_views_datasets_tables_and_writes_a_zip():
    import numpy as np
    import pandas as pd
    import xarray as xr

    from apps._view import EXPORT_FORMAT, read_export

    ds = _awkward()
    frame = pd.DataFrame({"metric": ["a", "b"], "score": [0.25, 0.5]})
    page = DataPage(scores=ds, curve=ds["curve"], runs={2: ds[["score"]], "x": 3}, table=frame)
    assert sorted(page.export_datasets()) == ["curve", "runs_2", "scores"]
    tables = page.export_tables()
    # one long table per set of dimensions; the 3-D variable is not flattened
    assert sorted(tables) == ["curve", "runs_2", "scores_head_layer", "scores_layer",
                              "scores_step", "table"]
    sl = tables["scores_head_layer"]
    assert len(sl) == 6 and set(sl.columns) >= {"layer", "head", "score", "name"}
    assert sl.set_index(["layer", "head"])["score"].loc[(1, 2)] == 5.0
    assert tables["table"] is frame
    for fmt in ("netcdf", "zarr"):
        data = page.export_bytes(fmt, extra={"workspace": {"prompts": ["hello"]}})
        if fmt == "zarr":
            import io
            import zipfile

            names = zipfile.ZipFile(io.BytesIO(data)).namelist()
            assert any(n.startswith("scores.zarr/") for n in names)
            continue
        back = read_export(data)
        m = back["manifest"]
        assert m["format"] == EXPORT_FORMAT and m["page"] == "DataPage" and m["prompt"] == "hello"
        assert m["parameters"] == {"layer": 1, "prompt": "hello"}
        assert m["workspace"] == {"prompts": ["hello"]} and m["versions"]["xarray"] == xr.__version__
        assert back["datasets"]["scores"].attrs["model_spec"] == {"n_layers": 2}
        assert back["datasets"]["scores"].attrs["note"] is None
        xr.testing.assert_allclose(back["datasets"]["scores"]["score"], ds["score"])
        np.testing.assert_allclose(back["tables"]["table"]["score"], [0.25, 0.5])
        assert back["code"] == page.code_snippet()
    with pytest.raises(ValueError, match="fmt"):
        page.export_bytes("pickle")


def test_the_default_snippet_compiles_and_names_the_pages_settings():
    code = DataPage(layer=2).code_snippet()
    compile(code, "<snippet>", "exec")
    assert "import explorer" in code and "'layer': 2" in code and "prompt = 'hello'" in code


# -- the order of what reaches a page ------------------------------------------------------------
def _on_loop(loop, fn):
    loop._queue_put(fn)
    loop.drain()


def test_schedule_waits_for_the_page_to_load_and_keeps_the_order(loop_doc):
    from apps._session import schedule

    pn.state._loaded[loop_doc.doc] = False         # the page is still connecting
    ran = []
    threads = [threading.Thread(target=schedule, args=(loop_doc.doc, lambda k=k: ran.append(k)))
               for k in ("a", "b")]
    for t in threads:
        t.start()
        t.join()
    loop_doc.drain()
    assert ran == []                               # nothing is applied before the page loads
    _on_loop(loop_doc, lambda: pn.state._on_load(loop_doc.doc))
    assert ran == ["a", "b"]
    assert pn.state._loaded[loop_doc.doc] is True
    schedule(loop_doc.doc, lambda: ran.append("c"))
    loop_doc.drain()
    assert ran == ["a", "b", "c"]


def test_a_status_posted_before_a_result_is_never_applied_after_it(loop_doc):
    """A callback that waits for the page's load holds back every one scheduled after it,
    even one whose tick finds the page marked loaded before the waiting ones have run."""
    from apps._session import schedule

    pn.state._loaded[loop_doc.doc] = False
    ran = []
    schedule(loop_doc.doc, lambda: ran.append("status"))
    loop_doc.drain()
    pn.state._loaded[loop_doc.doc] = True          # marked loaded; the onload queue not yet run
    schedule(loop_doc.doc, lambda: ran.append("result"))
    loop_doc.drain()
    assert ran == []
    pn.state._loaded[loop_doc.doc] = False
    _on_loop(loop_doc, lambda: pn.state._on_load(loop_doc.doc))
    assert ran == ["status", "result"]


def test_a_failing_callback_does_not_drop_the_ones_after_it(loop_doc, caplog):
    from apps._session import schedule

    ran = []

    def fail():
        raise RuntimeError("boom")

    for fn in (lambda: ran.append(1), fail, lambda: ran.append(2)):
        schedule(loop_doc.doc, fn)
    loop_doc.drain()
    assert ran == [1, 2]
    assert "a scheduled page update failed" in caplog.text


def test_a_job_started_while_another_runs_says_it_shares_the_model(loop_doc):
    with set_curdoc(loop_doc.doc):
        first, second = Page(), Page()
    release = threading.Event()
    started = threading.Event()

    def slow(token):
        started.set()
        release.wait(10)
        return 1

    first.submit("work", slow)
    assert started.wait(5)
    second.status = "computing scores…"
    second.submit("work", lambda token: 2)
    assert second.status == ("computing scores… (shares the model with 1 other job running on "
                             "this server: it takes longer)")
    assert _wait_until(lambda: second.result == 2)
    second.submit("other", lambda token: 4)      # a second job: the note is not repeated
    assert second.status.count("shares the model") == 1
    release.set()
    assert _wait_until(lambda: first.result == 1)
    from apps._session import jobs_running
    assert _wait_until(lambda: jobs_running() == 0)
    third = Page(background=False)
    third.status = "computing…"
    third.submit("work", lambda token: 3)       # inline: nothing else runs, no note
    assert third.status == "computing…" and third.result == 3


# -- what every page repeats, owned by the base -------------------------------------------------

def test_a_page_cache_computes_once_per_key_keeps_its_limit_and_empties_on_close():
    view = View(background=False)
    calls = []

    def compute(key):
        calls.append(key)
        return None if key == "none" else key * 2

    assert view.cached("a", 3, lambda: compute(3)) == 6
    assert view.cached("a", 3, lambda: compute(3)) == 6            # a hit: not computed again
    assert view.cached("a", "none", lambda: compute("none")) is None
    assert view.cached("a", "none", lambda: compute("none")) is None   # None is kept as a value
    assert calls == [3, "none"]
    # limit=1: a store already holding more than one entry is emptied before the next one
    for key in (1, 2, 4):
        view.cached("b", key, lambda k=key: compute(k), limit=1)
    assert view.cache_get("b", 1) is None and view.cache_get("b", 2) is None
    assert view.cache_get("b", 4) == 8
    assert view.cache_put("c", "k", [1], limit=0) == [1]
    assert view.cache_put("c", "j", [2], limit=0) == [2] and view.cache_get("c", "k") is None
    # limit=0 keeps one value: the old one is dropped before the new one is computed
    seen_during = []
    view.cached("c", "i", lambda: seen_during.append(view.cache_get("c", "j")) or [3], limit=0)
    assert seen_during == [None] and view.cache_get("c", "i") == [3]
    assert view.cache_get("c", "j") is None
    view.cache_put("c", "j", [2], limit=0)
    view.forget("a")
    assert view.cache_get("a", 3, "missing") == "missing" and view.cache_get("b", 4) == 8
    view.close()
    assert view.cache_get("b", 4) is None and view.cache_get("c", "j") is None


def test_a_bounded_page_cache_drops_the_entry_used_longest_ago_and_forget_can_pick_keys():
    import numpy as np

    view = View(background=False)
    view.bound_cache("lru", max_items=2, max_bytes=None)
    view.cache_put("lru", "a", 1)
    view.cache_put("lru", "b", 2)
    assert view.cache_get("lru", "a") == 1          # "a" read last: "b" is the oldest now
    view.cache_put("lru", "c", 3)
    assert [view.cache_get("lru", k, "gone") for k in "abc"] == [1, "gone", 3]
    view.forget("lru")                               # the bound outlives an emptying
    for k in "xyz":
        view.cache_put("lru", k, k)
    assert [view.cache_get("lru", k) for k in "xyz"] == [None, "y", "z"]
    # 100 float64 values are 800 bytes: a store of at most 1600 bytes keeps the newest two
    view.bound_cache("bytes", max_items=10, max_bytes=1600)
    for k in range(3):
        view.cache_put("bytes", k, np.zeros(100))
    assert [view.cache_get("bytes", k) is None for k in range(3)] == [True, False, False]
    with pytest.raises(ValueError, match="max_items"):
        view.bound_cache("none", max_items=0)
    # where: only the entries whose key it is true for go
    keys = [(1, 0), (1, 1), (2, 0)]
    for key in keys:
        view.cache_put("plain", key, key[1])
    view.forget("plain", where=lambda key: key[0] == 1)
    assert [view.cache_get("plain", k, "gone") for k in keys] == ["gone", "gone", 0]
    view.close()
    assert view._page_caches == {}


def test_a_pasted_item_goes_through_the_page_parser_and_a_refused_one_shows_its_message():
    from explorer._checks import InputError

    view = View(background=False)
    used = []

    def parse(text):
        if ":" not in text:
            raise InputError(f"line 1: {text!r} has no ':'.")
        return tuple(text.split(":"))

    def use(item):
        used.append((item, view.error))

    view.error = "an earlier failure"
    assert view.adopt_own("a:b", parse, use) == ("a", "b")
    assert used == [(("a", "b"), "")] and view.error == ""     # cleared before the page uses it
    assert view.adopt_own("ab", parse, use) is None
    assert view.error == "line 1: 'ab' has no ':'." and len(used) == 1
    assert view.status == "Failed: line 1: 'ab' has no ':'."
    # the job the item starts may fail: its message stays
    assert view.adopt_own("c:d", parse, lambda item: view.show_error(ValueError("no room"))) \
        == ("c", "d")
    assert view.error == "no room"
    with pytest.raises(ZeroDivisionError):                    # not the user's text: raised
        view.adopt_own("e:f", lambda text: 1 / 0, use)


def test_the_base_progress_bar_and_status_text_follow_the_page():
    view = View(background=False)
    bar = view.progress_bar(height=10)
    assert (bar.value, bar.visible, bar.height, bar.max) == (0, False, 10, 100)
    view.param.update(progress=40, progress_active=True)
    assert (bar.value, bar.visible) == (40, True)
    busy_bar = view.progress_bar(visible=view.param.busy)          # another condition to show
    assert busy_bar.visible is False
    view.busy = True
    assert busy_bar.visible is True
    text = view.status_text("x-status")
    view.status = "reading <b>file</b> & co"
    assert text.css_classes == ["x-status"]
    assert text.object == "reading &lt;b&gt;file&lt;/b&gt; &amp; co"     # shown as text


def test_no_page_builds_its_own_progress_bar():
    offenders = []
    for path in sorted(APPS.glob("*.py")):
        if path.name == "_view.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Progress":
                value = next((k.value for k in node.keywords if k.arg == "value"), None)
                if ast.unparse(value or ast.Constant(None)) in {"self.param.progress",
                                                                "self.progress"}:
                    offenders.append(f"apps/{path.name}:{node.lineno}")
    assert offenders == []


def test_no_page_keeps_a_lock_of_its_own_but_the_preview_slot():
    """Caches go in the base's (one lock for them all); the live sliders' preview path keeps
    the lock of its single waiting slot (`apps._preview_slot`: a busy flag and the request
    waiting, no cache)."""
    locks = []
    for path in sorted(APPS.glob("*.py")):
        if path.name in {"_view.py", "_page_cache.py", "_session.py", "_server.py"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") in {"Lock", "RLock"}
                    and isinstance(node.func, ast.Attribute)):
                locks.append(f"{path.name}:{ast.unparse(node)}")
    assert locks == ["_preview_slot.py:threading.Lock()"]


def test_the_workspace_lists_of_every_page_have_the_types_the_gallery_sets():
    from explorer.interventions import Edit

    kinds = {"edits": Edit, "highlighted": str, "selected_positions": int}
    seen = set()
    for name in _view_modules():
        module = importlib.import_module(f"apps.{name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not issubclass(cls, View):
                continue
            for pname, kind in kinds.items():
                if pname in cls.param:
                    p = cls.param[pname]
                    assert isinstance(p, param.List) and p.item_type is kind, (cls, pname)
                    assert p.default == [] and p.precedence == -1 and p.doc, (cls, pname)
                    seen.add(pname)
    assert seen == set(kinds)
