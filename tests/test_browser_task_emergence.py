"""Browser test of the task-vector emergence page: served on a free local port with a tiny
training run made here, driven in headless chromium. The test waits for the Bokeh canvases,
moves the training-step slider and checks that the summary and the projection plot follow."""
from __future__ import annotations

import time

import pytest
from _browser import open_page, press_until, served_in_process, wait_for_canvas, wait_for_text

from explorer.commands._common import torch_threads

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def analysis():
    from explorer.analyses import task_emergence as te

    with torch_threads(1):
        run = te.train_task_emergence(d=4, n_tasks=2, rank=2, n_examples=4, n_layers=2, d_model=16,
                                      n_heads=2, steps=20, checkpoint_every=10, batch_size=16, seed=0)
        return te.task_emergence_analysis(run, n_per_task=10, k=5)


@pytest.fixture(scope="module")
def server(analysis):
    pytest.importorskip("panel")
    from apps import theme
    from apps.task_emergence import TaskEmergenceView

    def page():
        return theme.page([TaskEmergenceView(analysis=analysis)], title="Task emergence")

    with served_in_process({"task_emergence": page}) as url:
        yield url


def _projection_title(page) -> str:
    """The title of the projection plot shown, read from Bokeh's views of the plots on the
    page (canvas text is not in the DOM; a document's models can include a replaced plot's)."""
    return page.evaluate("""() => {
        for (const v of Bokeh.index.all_views()) {
            const t = v.model.title
            if ((v.model.type === 'Figure' || v.model.type === 'Plot') && v.el.isConnected
                && t != null && String(t.text).startsWith('Query residual')) return String(t.text);
        }
        return '';
    }""")


def test_task_emergence_page_scrubs_training(server, browser, analysis):
    page, errors = open_page(browser, f"{server}/task_emergence", viewport={"width": 1500, "height": 1200})
    best = analysis.attrs["best_layer"]
    wait_for_text(page, ".emergence-summary", rf"Step 20\b.*TD after layer {best} =")
    for css in (".emergence-projection", ".emergence-td", ".emergence-curves"):
        wait_for_canvas(page, css)
    assert _projection_title(page) == f"Query residual, layer {best}, step 20"
    press_until(page, ".emergence-controls .noUi-handle", "Home", ".emergence-summary", r"Step 0\b")
    deadline = time.time() + 60
    while not _projection_title(page).endswith("step 0") and time.time() < deadline:
        page.wait_for_timeout(250)
    assert _projection_title(page).endswith("step 0")
    td0 = float(analysis["td"].sel(step=0, layer=best))
    wait_for_text(page, ".emergence-projection-caption", rf"at step 0\b.*TD\) there = {td0:.2f}")
    assert not errors, errors
    page.close()


def test_icl_loss_axis_reads_in_1_2_5_steps(server, browser, analysis):
    """The log y axis of "ICL loss per task" has a label at each 1, 2 and 5 times a power of
    ten inside its range (it read only 1 and 0.1 with Bokeh's own log ticker)."""
    import math

    from _ticks import axis_ticks

    page, errors = open_page(browser, f"{server}/task_emergence", viewport={"width": 1280, "height": 900})
    wait_for_canvas(page, ".emergence-curves")
    deadline = time.time() + 60
    while not (axes := [a for a in axis_ticks(page, "ICL loss per task") if a["axis"] == "y"]) \
            and time.time() < deadline:
        page.wait_for_timeout(250)
    [axis] = axes
    assert axis["type"] == "LogAxis"
    # the range the plot asks for (plot_icl_loss_curves): the oracle loss / 1.5 .. the
    # largest of the ICL and task-agnostic losses x 1.2
    low = min(float(analysis["oracle_loss"].mean()), float(analysis["icl_loss"].min())) / 1.5
    high = max(float(analysis["icl_loss"].max()), float(analysis["agnostic_loss"].mean())) * 1.2
    expected = [m * 10.0 ** e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
                for m in (1, 2, 5) if low <= m * 10.0 ** e <= high]
    assert 3 <= len(expected) <= 8, (low, high)   # this run's range: no thinning to the 1s
    assert [round(t, 12) for t in axis["ticks"]] == [round(t, 12) for t in expected], (low, high, axis)
    assert all(axis["labels"]) and len(set(axis["labels"])) == len(axis["labels"]), axis
    assert not errors, errors
    page.close()
