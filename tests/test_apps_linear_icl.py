"""The Linear ICL page headless: it opens on the shipped runs without training, its captions
carry the numbers (checked against the weights by hand), every control has a label and a
tooltip, and "Retrain" trains the run shown again, as `train_linear_icl` does."""
from __future__ import annotations

import math

import numpy as np
import pytest

pn = pytest.importorskip("panel")
hv = pytest.importorskip("holoviews")

from explorer.analyses import linear_icl as icl  # noqa: E402
from explorer.analyses.linear_icl import runs as icl_runs  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_runs(one_torch_thread):
    return {H: icl.train_linear_icl(n_heads=H, steps=40, checkpoint_every=20, batch_size=32,
                                    n_test=32, test_lengths=[10, 40], seed=0) for H in (1, 2)}


def _omega_by_hand(run, step):
    at = run.sel(step=step)
    kq = np.einsum("hik,hjk->hij", at["W_Q"].values.astype(np.float64), at["W_K"].values)
    return np.diagonal(kq[:, :-1, :-1], axis1=1, axis2=2).mean(-1) / math.sqrt(kq.shape[-1])


def test_captions_carry_the_numbers_the_titles_leave_out(tiny_runs):
    from apps.linear_icl import LinearICLView, plot_kq_heatmaps

    view = LinearICLView(runs=tiny_runs, background=False)
    assert view.n_heads == 2 and view.step == 40
    omega = _omega_by_hand(tiny_runs[2], 40)
    caption = view._kq_caption()
    for h, w in enumerate(omega):
        assert f"toy head {h}: ω {w:+.3f}" in caption
    # Titles are short names (the numbers went to the caption).
    titles = [p.opts.get().kwargs["title"] for p in plot_kq_heatmaps(view.patterns())]
    assert titles == ["toy head 0", "toy head 1"]
    view.step = 20
    assert f"toy head 0: ω {_omega_by_hand(tiny_runs[2], 20)[0]:+.3f}" in view._kq_caption()
    assert "H = 1: " in view._loss_caption() and "H = 2: " in view._loss_caption()


def test_every_control_has_a_label_and_a_tooltip(tiny_runs):
    import panel as pn

    from apps.linear_icl import LinearICLView

    view = LinearICLView(runs=tiny_runs, background=False)
    controls = view.controls()
    tips = [w.value for w in controls.select(pn.widgets.TooltipIcon)]
    assert view.param.n_heads.doc in tips and view.param.step.doc in tips
    labels = " ".join(str(p.object) for p in controls.select(pn.pane.HTML))
    assert "Heads (H)" in labels
    sliders = controls.select(pn.widgets.DiscreteSlider)
    assert [s.name for s in sliders] == ["Training step"]
    buttons = {b.label: b.description for b in controls.select(pn.widgets.Button)}
    assert set(buttons) == {"Retrain this run", "Stop retraining"} and all(buttons.values())


def test_retrain_trains_the_run_shown_again_from_its_seed(tiny_runs):
    from apps.linear_icl import LinearICLView

    view = LinearICLView(runs=tiny_runs, background=False)
    view.n_heads = 1
    old = view.runs[1]
    view.retrain()                                             # inline: done when it returns
    p = dict(old.attrs["params"])
    want = icl.train_linear_icl(**p, seed=old.attrs["seed"])
    new = view.runs[1]
    assert new is not old and not view.retraining and not view.progress_active
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        np.testing.assert_array_equal(new[name].values, want[name].values)
    assert view.retrain_status.startswith("Retrained H = 1 in ")
    assert view.runs[2] is tiny_runs[2]                        # the other run is untouched


@pytest.mark.slow
def test_page_opens_on_the_shipped_runs_without_training(tmp_path, monkeypatch):
    if not icl.SHIPPED_RUNS.is_file():
        pytest.skip("the shipped runs are missing")
    from apps.linear_icl import DEFAULT_HEADS, LinearICLView

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    monkeypatch.setattr(icl_runs, "train_linear_icl", lambda **kw: pytest.fail("trained on open"))
    monkeypatch.setattr(icl_runs, "linear_icl_analysis", lambda *a, **kw: pytest.fail("analysed on open"))
    view = LinearICLView(background=False)
    assert sorted(view.runs) == list(DEFAULT_HEADS) and view.step == 20000
    assert "shipped (float16)" in view.status
    view.__panel__()


def test_plots_and_retrain_note_are_readable(tiny_runs):
    from apps.linear_icl import LinearICLView, loss_caption, retrain_estimate

    view = LinearICLView(runs=tiny_runs, background=False)
    view.n_heads = 2
    # The loss-by-length y axis spans the data (its 1-2-5 ticks come from the theme's log
    # ticker: tests/test_browser_theme.py).
    plot = view._length_plot()
    assert plot.opts.get().kwargs["logy"] and "yticks" not in plot.opts.get().kwargs
    low, high = plot.opts.get().kwargs["ylim"]
    drawn = np.concatenate([c.dimension_values(1) for c in plot if isinstance(c, hv.Curve)])
    assert low <= drawn.min() and drawn.max() <= high          # every curve inside the range
    # The caption names the plots, not their place (they stack on narrow windows).
    text = loss_caption(view.analyses, 2)
    assert "Left" not in text and "Right" not in text and "first plot" in text
    # The estimate is the run's own training time: steps x (train_seconds / steps).
    run = tiny_runs[2]
    note = retrain_estimate(run)
    secs = run.attrs["train_seconds"]
    assert f"about {secs:.0f} s" in note and "40 steps" in note
    assert f"{secs / 40 * 1e3:.1f} ms a step" in note
    shown = [p for p in view.controls().select(pn.pane.Markdown) if "icl-retrain-estimate" in p.css_classes]
    assert len(shown) == 1 and shown[0].visible
