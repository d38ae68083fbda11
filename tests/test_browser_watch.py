"""The browser fixture's watch: console errors, uncaught page errors and failed requests on
any page are recorded (and fail the test that met them, see conftest)."""
from __future__ import annotations

import time

import pytest

from tests._browser import free_port

pytestmark = pytest.mark.browser


def test_every_page_reports_console_errors_page_errors_and_failed_requests(browser):
    port = free_port()                                  # nothing listens there
    page = browser.new_page()
    page.set_content(f"""<script>
        console.error("drawn badly");
        console.log("fine");
        fetch("http://127.0.0.1:{port}/data.json").catch(() => null);
        setTimeout(() => {{ throw new Error("boom in a callback"); }}, 0);
    </script>""")
    deadline = time.time() + 30   # until the three kinds have been reported
    while not all(any(p.startswith(kind) for p in browser.problems)
                  for kind in ("console error", "page error", "request failed")):
        assert time.time() < deadline, browser.problems
        page.wait_for_timeout(50)
    page.close()
    problems = browser.take_problems()
    assert any(p.startswith("console error") and "drawn badly" in p for p in problems), problems
    error = next(p for p in problems if p.startswith("page error"))
    assert "boom in a callback" in error.splitlines()[0], error
    # a page error's report carries its stack and the console messages before it
    assert "log: fine" in error and "error: drawn badly" in error, error
    assert any(p.startswith("request failed: GET") and str(port) in p for p in problems)
    assert not any("fine" in p.splitlines()[0] for p in problems)  # a log is no problem itself
    assert browser.take_problems() == []                # taken: this test ends clean
