"""`_browser.settle_gallery_page` in the gallery: a page counts as settled only once the
session has no job in flight, even when nothing on the page shows the job.

The gallery's only page starts a job as it opens that shows no spinner and no status and
leaves the plot as it is for `JOB_S` seconds, then retitles the plot. A wait that only
watched the plots (unchanged for 1.5 s) would return with the first title; the settle
must return with the second, because the sidebar's stop button is live while the job runs.
"""
from __future__ import annotations

import time

import pytest
from _browser import _SIGNATURE, served_in_process, settle_gallery_page

pytestmark = pytest.mark.browser

JOB_S = 6.0
FIRST, LAST = "Before the job", "After the job"


def _late_page(model):
    import holoviews as hv
    import panel as pn

    from apps._view import View

    class LatePage(View):
        """A plot retitled by a job that shows nothing while it runs."""

        def __init__(self):
            super().__init__()
            self.plot = pn.pane.HoloViews(self._curve(FIRST), sizing_mode="stretch_width")
            self.runner("late", lambda _: setattr(self.plot, "object", self._curve(LAST)),
                        busy=False)
            self.submit("late", lambda token: time.sleep(JOB_S))

        @staticmethod
        def _curve(title):
            return hv.Curve([1, 3, 2]).opts(title=title, responsive=True, height=300)

        def __panel__(self):
            return pn.Column(self.plot, sizing_mode="stretch_width")

    return LatePage()


@pytest.fixture(scope="module")
def gallery_url():
    pytest.importorskip("panel")
    from apps.gallery import Gallery

    with served_in_process({"gallery": lambda: Gallery(
            "tiny-llama", views=[("Late", "late", _late_page)], view="late").template()}) as url:
        yield f"{url}/gallery"


def test_settle_waits_for_a_job_the_page_does_not_show(browser, gallery_url):
    tab = browser.new_page(viewport={"width": 1280, "height": 900})
    tab.goto(gallery_url, timeout=120_000)
    tab.wait_for_selector("canvas", state="attached", timeout=120_000)
    deadline = time.time() + 60
    while True:   # the first plot drawn, the job still running: its title, the stop button live
        sig = tab.evaluate(_SIGNATURE, None)
        titles = [p[5] for p in sig["plots"]] if sig else []
        if FIRST in titles or time.time() > deadline:
            break
        tab.wait_for_timeout(100)
    assert titles == [FIRST] and sig["active"], sig
    started = time.time()
    assert settle_gallery_page(tab, timeout=60)
    titles = [p[5] for p in tab.evaluate(_SIGNATURE, None)["plots"]]
    assert titles == [LAST], f"settled with {titles} after {time.time() - started:.1f} s"
    tab.close()
