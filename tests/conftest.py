"""Shared fixtures (tiny random-init models, the packaged SmolLM2, the browser) and how the
suite runs in parallel workers (pytest-xdist). The rules for a new test are in tests/README.md.

Parallel runs (`make test`, `make test-fast`: ``-n 2 --dist loadfile --no-loadscope-reorder``):

- Each test process has its own cache folder (``$EXPLORER_CACHE``, under the process's own
  pytest temp folder); the converted SmolLM2 in the user's cache is linked into it, read only.
- A file's tests run in one worker, in file order, so module-scoped fixtures are built once.
- Files start in order of their expected cost, the costliest first (the slowest file must
  not start last): the seconds they took in the last parallel run on this machine (pytest's
  cache), else in the full run recorded in tests/file-seconds.json, else an estimate from
  their marks (``browser``, ``slow``, ``integration``).
- A test marked ``timing`` (it asserts a wall-clock time) runs while no other test runs:
  the other workers finish the test they are in and wait (a reader-writer lock on a file
  shared by the session's workers), so the load it is timed under is its own.
- Torch gets the cores divided among the workers (one thread each on 2 cores), and the BLAS
  thread variables say the same to the servers the tests start.
- Each test process starts one page server (`shared_server`) for the pages that browser test
  modules declare with `_browser.shared_page`; chromium is started per module (`browser`).
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from explorer.benches.serve import CHROMIUM, CHROMIUM_ARGS

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")                # "gw0", ... in an xdist worker
_N_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _share_the_cores() -> None:
    """In an xdist worker: torch (and, through the environment, the servers tests start) on
    cores / workers threads, so the workers do not oversubscribe the machine."""
    if _WORKER is None or _N_WORKERS < 2:
        return
    threads = max(1, (os.cpu_count() or 1) // _N_WORKERS)
    for name in _THREAD_ENV:
        os.environ.setdefault(name, str(threads))
    torch.set_num_threads(threads)


_share_the_cores()


# -- parallel runs: files in order of cost, the timing lock --------------------------------
#
# The suite distributes whole files (``--dist loadfile``). ``--dist loadgroup`` does not group
# with pytest 9.2: xdist 3.8 names a test's group by editing ``item._nodeid``, which pytest no
# longer reads, so ``xdist_group`` marks have no effect and are not used here.

_SECONDS_KEY = "explorer/file-seconds"


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _estimated_seconds(items: list[pytest.Item]) -> float:
    """A file's cost guessed from its marks when no earlier run here measured it."""
    fixed, each = 0.0, 0.5
    if any(i.get_closest_marker("browser") for i in items):
        fixed, each = 60.0, 5.0
    elif any(i.get_closest_marker("slow") for i in items):
        fixed, each = 40.0, 5.0
    elif any(i.get_closest_marker("integration") for i in items):
        fixed, each = 20.0, 2.0
    return fixed + each * len(items)


def _shipped_file_seconds() -> dict[str, float]:
    """The seconds each file took in a full parallel run on a 2-core machine
    (tests/file-seconds.json), for a fresh clone, whose pytest cache holds none yet."""
    import json

    try:
        return json.loads((Path(__file__).parent / "file-seconds.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist, in the controller, per worker: the seconds each file took in the last parallel
    run here (pytest's cache), so that every worker orders its collection alike."""
    cache = getattr(node.config, "cache", None)          # None with -p no:cacheprovider
    node.workerinput["explorer_file_seconds"] = cache.get(_SECONDS_KEY, {}) if cache else {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the files in order of expected cost, costliest first (ties in
    file order; each file's tests keep theirs). With ``--no-loadscope-reorder`` the
    controller hands out files in this order, so the slowest file does not start last."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(_file_of(item.nodeid), []).append(item)
    measured = {**_shipped_file_seconds(), **workerinput.get("explorer_file_seconds", {})}
    cost = {name: float(measured.get(name) or _estimated_seconds(members))
            for name, members in files.items()}
    order = {name: rank for rank, name in enumerate(files)}
    ranked = sorted(files, key=lambda name: (-cost[name], order[name]))
    items[:] = [item for name in ranked for item in files[name]]


class _FileClock:
    """In the controller of a parallel run: the seconds each file's tests took (setup, call
    and teardown), kept in pytest's cache at the end for the next run's order."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = _file_of(report.nodeid)
        self.seconds[name] = self.seconds.get(name, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        cache = getattr(self.config, "cache", None)
        if cache is None or not self.seconds:
            return
        known = dict(cache.get(_SECONDS_KEY, {}))
        known.update({k: round(v, 1) for k, v in self.seconds.items()})
        cache.set(_SECONDS_KEY, known)


class _CpuLog:
    """With ``EXPLORER_TEST_CPU_LOG=path``: one JSON line per test appended to ``path``, its
    wall seconds and the CPU seconds of the test process and the children it waited for
    (setup, call and teardown), to mark tests ``slow`` by what they cost on a quiet machine
    rather than by their wall time on a busy one (tests/README.md)."""

    def __init__(self, path: str):
        self.path = path

    @staticmethod
    def _cpu() -> float:
        import resource

        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        import json
        import time

        wall, used = time.perf_counter(), self._cpu()
        yield
        line = {"test": item.nodeid, "wall": round(time.perf_counter() - wall, 2),
                "cpu": round(self._cpu() - used, 2),
                "marks": sorted({m.name for m in item.iter_markers()} & {
                    "integration", "browser", "slow", "timing"})}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("EXPLORER_TEST_CPU_LOG"):
        config.pluginmanager.register(_CpuLog(os.environ["EXPLORER_TEST_CPU_LOG"]),
                                      "explorer-cpu-log")
    if _WORKER is None and config.getoption("numprocesses", default=None):
        config.pluginmanager.register(_FileClock(config), "explorer-file-clock")


@contextlib.contextmanager
def _flock(path: Path, mode: int):
    with open(path, "a+") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _lock_files(item: pytest.Item) -> tuple[Path, Path]:
    """The turnstile and the lock: files in the session's temp folder (each worker's temp
    folder is one of its folders)."""
    folder = item.config._tmp_path_factory.getbasetemp().parent
    return folder / "timing-turnstile.lock", folder / "timing.lock"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """In an xdist worker, a test marked ``timing`` holds the session's lock alone for its
    setup, call and teardown; every other test shares it. A test first passes the turnstile,
    which a waiting ``timing`` test holds, so tests that come later queue behind it (writer
    priority). The wait happens outside the test's timeout (this wrapper runs first)."""
    if _WORKER is None:
        yield
        return
    turnstile, lock = _lock_files(item)
    if item.get_closest_marker("timing") is not None:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(lock, fcntl.LOCK_EX):
            yield
        return
    with _flock(turnstile, fcntl.LOCK_EX):
        pass
    with _flock(lock, fcntl.LOCK_SH):
        yield


# -- the test process's own cache folder ----------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _own_cache_folder(tmp_path_factory):
    """``$EXPLORER_CACHE`` points into this process's temp folder for the whole session, so
    workers never share (or race on) stored results and nothing lands in the user's cache;
    the converted SmolLM2 there is linked in, to be read only (a re-conversion into the link
    fails instead of replacing it). Tests that need an empty cache still set their own. The
    pages' result cache (`apps._result_cache`) is off, so every page computes what a test
    checks; tests/test_page_result_cache.py turns it on."""
    from explorer.models import DEFAULT_MODEL, cache_dir

    converted = cache_dir() / "models" / DEFAULT_MODEL
    folder = tmp_path_factory.mktemp("explorer-cache")
    if (converted / "explorer-source.json").exists():
        (folder / "models").mkdir()
        (folder / "models" / DEFAULT_MODEL).symlink_to(converted.resolve(), target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXPLORER_CACHE", str(folder))
        mp.setenv("EXPLORER_RESULT_CACHE", "off")
        yield folder


@pytest.fixture(scope="session", autouse=True)
def _no_grad():
    torch.set_grad_enabled(False)
    yield


def _torch_globals() -> dict:
    return {"threads": torch.get_num_threads(), "dtype": torch.get_default_dtype(),
            "grad": torch.is_grad_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "thread_env": {k: os.environ.get(k) for k in _THREAD_ENV}}


@pytest.fixture(autouse=True)
def _torch_globals_unchanged():
    """A test that leaves torch's thread count, default dtype, grad mode, matmul settings or
    the BLAS thread variables of the environment (inherited by servers started later) changed
    makes later comparisons (remote against local, bit for bit) depend on test order;
    it errors here, and the settings are put back."""
    before = _torch_globals()
    yield
    after = _torch_globals()
    if after != before:
        torch.set_num_threads(before["threads"])
        torch.set_default_dtype(before["dtype"])
        torch.set_grad_enabled(before["grad"])
        torch.use_deterministic_algorithms(before["deterministic"])
        torch.set_float32_matmul_precision(before["matmul_precision"])
        for k, v in before["thread_env"].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
        pytest.fail(f"the test left torch settings changed (before, after): {changed}")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module's tests (tiny models run fastest so, and timings are
    steadier on a shared machine); its count is put back afterwards. A module asks for it
    with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """``$EXPLORER_CACHE`` set to an empty folder of this test's, which it returns: nothing
    stored by an earlier test is read back. A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("empty_cache")``."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("EXPLORER_CACHE", str(folder))
    return folder


@pytest.fixture
def notes(monkeypatch):
    """Notifications the pages send (outside a server they are only logged)."""
    from apps import theme

    sent = []
    monkeypatch.setattr(theme, "notify", lambda kind, message, **kw: sent.append((kind, message)))
    return sent


@pytest.fixture(scope="session")
def tiny_model():
    """A seeded random-init Llama-family model (3 layers, 4 heads, 2 KV heads, d_model 64)."""
    from explorer import load_model

    return load_model("tiny-llama")


@pytest.fixture(scope="session")
def tiny_gpt2():
    from explorer import load_model

    return load_model("tiny-gpt2")


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct (converted once into the cache folder)."""
    from explorer import load_model

    return load_model("smollm2-135m")


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    """The pages' result cache (`apps._result_cache`) on, in an empty folder of this test's,
    with no warm-up asked for by the environment; the folder of its entries."""
    from apps import _result_cache as rc

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    monkeypatch.setenv(rc.ENV_VAR, "on")
    monkeypatch.delenv(rc.WARM_ENV_VAR, raising=False)
    return tmp_path / "page-results"


@pytest.fixture
def prompt_calls(monkeypatch):
    """The Saturation page's prompt jobs (`prompt_saturation` runs), as they run: (model
    name, prompt, number of edits) each."""
    from apps import _saturation_prompt as sp

    calls = []
    real = sp.prompt_saturation

    def counted(model, prompt, **kw):
        calls.append((model.spec.name, prompt, len(kw.get("edits", ()))))
        return real(model, prompt, **kw)

    monkeypatch.setattr(sp, "prompt_saturation", counted)
    return calls


class WatchedBrowser:
    """A Playwright browser whose every page reports console errors, uncaught page errors and
    failed requests into ``problems`` (the autouse check below fails the test on any).

    A test that provokes an error on purpose reads and clears them with `take_problems`.
    """

    def __init__(self, browser: Any):
        self._browser = browser
        self.problems: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._browser, name)

    def new_context(self, **kwargs: Any) -> Any:
        context = self._browser.new_context(**kwargs)
        self._watch(context)
        return context

    def new_page(self, **kwargs: Any) -> Any:
        page = self._browser.new_page(**kwargs)
        self._watch(page.context)
        return page

    def take_problems(self) -> list[str]:
        problems, self.problems = self.problems, []
        return problems

    def _watch(self, context: Any) -> None:
        recent: collections.deque[str] = collections.deque(maxlen=8)  # for a page error's report

        def console(msg: Any) -> None:
            recent.append(f"{msg.type}: {msg.text[:300]}")
            if msg.type == "error":
                self.problems.append(f"console error on {msg.page.url if msg.page else '?'}: "
                                     f"{msg.text}")

        def page_error(err: Any) -> None:
            stack = (getattr(err.error, "stack", "") or "").splitlines()[:8]
            from _patch_log import explain

            self.problems.append(f"page error: {err.error}\n  stack: " + "\n    ".join(stack)
                                 + "\n  console before it:\n    " + "\n    ".join(recent)
                                 + explain(str(err.error)))

        def failed(request: Any) -> None:
            # closing a page or navigating away cancels what is in flight: not a page fault
            if request.failure != "net::ERR_ABORTED":
                self.problems.append(f"request failed: {request.method} {request.url} "
                                     f"({request.failure})")

        context.on("console", console)
        context.on("weberror", page_error)
        context.on("requestfailed", failed)


def _browser_unavailable(reason: str) -> None:
    """Skip the browser tests with ``reason``, or fail when the test command requires them
    (``EXPLORER_REQUIRE_BROWSER=1``, set by `make test`)."""
    if os.environ.get("EXPLORER_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason}; the test command runs the browser tests: set them up with "
                    "./scripts/setup.sh --browser", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    """Headless chromium driven by Playwright, one per test module, every page watched.

    Not one per test process: Playwright's sync API marks its event loop as running in this
    thread while chromium is up, so a later module's own Playwright, or `asyncio.run`, would
    refuse to start."""
    try:
        from playwright import sync_api
    except ImportError:
        _browser_unavailable("Playwright is not installed")
    if not Path(CHROMIUM).exists():
        _browser_unavailable(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        except sync_api.Error as err:
            _browser_unavailable(f"chromium at {CHROMIUM} does not start: "
                                 f"{str(err).splitlines()[0]}")
        yield WatchedBrowser(b)
        b.close()


@pytest.fixture(scope="session")
def shared_server():
    """One Panel server in this test process (started on first use, once per worker) for the
    pages that browser test modules declare with `_browser.shared_page`; yields its base URL.
    Serving a page costs no interpreter start and no second copy of a model."""
    from _browser import serve_shared

    with serve_shared() as url:
        yield url


@pytest.fixture(autouse=True)
def _browser_problems_fail_the_test(request):
    """After a test that used the browser: any console error, page error or failed request
    its pages met fails it."""
    yield
    if "browser" in request.fixturenames:
        problems = request.getfixturevalue("browser").take_problems()
        if problems:
            pytest.fail("the browser reported:\n" + "\n".join(problems[:20]), pytrace=False)
