"""Browser test of the task-vector emergence page: served on a free local port with a tiny
training run made here, driven in headless chromium. The test waits for the Bokeh canvases,
moves the training-step slider and checks that the summary and the projection plot follow."""
from __future__ import annotations

import time

import pytest
from _browser import open_page, press_until, served_in_process, wait_for_canvas, wait_for_text

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def analysis():
    import torch

    from explorer.analyses import task_emergence as te

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = te.train_task_emergence(d=4, n_tasks=2, rank=2, n_examples=4, n_layers=2, d_model=16,
                                      n_heads=2, steps=20, checkpoint_every=10, batch_size=16, seed=0)
        return te.task_emergence_analysis(run, n_per_task=10, k=5)
    finally:
        torch.set_num_threads(before)


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
    """The title of the projection plot, read from the Bokeh document (canvas text is not in the DOM)."""
    return page.evaluate("""() => {
        for (const doc of Bokeh.documents) {
            for (const m of doc.all_models) {
                if (m.type === 'Title' && m.text.startsWith('Query residual')) return m.text;
            }
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
