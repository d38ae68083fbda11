"""Shared fixtures: tiny random-init models (fast) and the packaged SmolLM2 (integration)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


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


CHROMIUM = "/usr/bin/chromium"  # Debian's chromium; Playwright never downloads a browser here
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


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
        def console(msg: Any) -> None:
            if msg.type == "error":
                self.problems.append(f"console error on {msg.page.url if msg.page else '?'}: "
                                     f"{msg.text}")

        def failed(request: Any) -> None:
            # closing a page or navigating away cancels what is in flight: not a page fault
            if request.failure != "net::ERR_ABORTED":
                self.problems.append(f"request failed: {request.method} {request.url} "
                                     f"({request.failure})")

        context.on("console", console)
        context.on("weberror", lambda err: self.problems.append(f"page error: {err.error}"))
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
    """Headless chromium driven by Playwright, one per test module, every page watched."""
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


@pytest.fixture(autouse=True)
def _browser_problems_fail_the_test(request):
    """After a test that used the browser: any console error, page error or failed request
    its pages met fails it."""
    yield
    if "browser" in request.fixturenames:
        problems = request.getfixturevalue("browser").take_problems()
        if problems:
            pytest.fail("the browser reported:\n" + "\n".join(problems[:20]), pytrace=False)
