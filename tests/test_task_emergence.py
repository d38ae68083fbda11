"""Task-vector emergence (Han et al., ICML 2025): the task mixture's invariants, the model's
token layout and causality, a tiny training run, checkpoint round trips (store and
safetensors), and task decodability / ICL loss over steps against direct computations
(forward hooks, scikit-learn's k-NN, closed-form posterior means)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import task_emergence as te
from explorer.analyses.task_emergence import runs as te_runs
from tests._cli import OneCommand

TINY = {"d": 4, "n_tasks": 2, "rank": 2, "n_examples": 4, "noise_std": 0.1, "coef_mean": 1.0,
        "coef_std": 0.5, "n_layers": 2,
        "d_model": 16, "n_heads": 2, "lr": 3e-3, "warmup": 0, "lr_decay": "none", "batch_size": 32, "steps": 60,
        "checkpoint_every": 20, "seed": 0}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_run(one_torch_thread):
    return te.train_task_emergence(**TINY)


# -- tasks ----------------------------------------------------------------------------

def test_bases_are_disjoint_and_orthonormal():
    bases = te.task_bases(16, 4, 4, seed=3)
    assert bases.shape == (4, 16, 4)
    columns = bases.transpose(1, 0, 2).reshape(16, 16)                 # all tasks' columns
    np.testing.assert_allclose(columns.T @ columns, np.eye(16), atol=1e-10)
    np.testing.assert_allclose(bases[0].T @ bases[2], 0, atol=1e-10)
    np.testing.assert_array_equal(te.task_bases(16, 4, 4, seed=3), bases)
    with pytest.raises(InputError, match=r"`n_tasks \* rank` must be at most `d` \(8\).*got 4 \* 3 = 12"):
        te.task_bases(8, 4, 3)


def test_prompts_follow_their_task_subspace_and_the_linear_rule():
    bases = te.task_bases(8, 4, 2, seed=0)
    tasks = [0, 1, 2, 3, 3, 1]
    ds = te.sample_task_prompts(bases, 6, 5, tasks=tasks, noise_std=0.0, seed=2)
    assert ds["x"].shape == (6, 6, 8) and ds["y"].shape == (6, 6)
    np.testing.assert_array_equal(ds["task"].values, tasks)
    w = ds["w"].values.astype(np.float64)
    for p, t in enumerate(tasks):
        proj = bases[t] @ bases[t].T
        np.testing.assert_allclose(proj @ w[p], w[p], atol=1e-5)     # w lies in B_t's span
        for other in set(range(4)) - {t}:
            np.testing.assert_allclose(bases[other].T @ w[p], 0, atol=1e-5)
    np.testing.assert_allclose(ds["y"].values, np.einsum("ped,pd->pe", ds["x"].values, w), atol=1e-5)
    noisy = te.sample_task_prompts(bases, 4000, 1, noise_std=0.5, seed=1)
    resid = noisy["y"].values - np.einsum("ped,pd->pe", noisy["x"].values, noisy["w"].values)
    assert resid.std() == pytest.approx(0.5, rel=0.05)
    assert set(np.unique(noisy["task"].values)) == {0, 1, 2, 3}
    with pytest.raises(InputError, match="one task per prompt"):
        te.sample_task_prompts(bases, 3, 2, tasks=[0, 1])
    with pytest.raises(InputError, match=r"`tasks\[i\]` must be an int in \[0, 3\]"):
        te.sample_task_prompts(bases, 1, 2, tasks=[4])


# -- model ----------------------------------------------------------------------------

def test_tokens_pair_x_with_y_and_hide_the_query_answer():
    model = te.TaskICLTransformer(2, 2, n_layers=1, d_model=8, n_heads=2)
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    y = torch.tensor([[7.0, 8.0, 9.0]])
    expected = [[1, 2, 7, 0], [3, 4, 8, 0], [5, 6, 0, 1]]
    np.testing.assert_array_equal(model.tokens(x, y)[0].numpy(), expected)


def test_prediction_reads_the_context_but_not_the_query_answer():
    model = te.TaskICLTransformer(4, 5, n_layers=2, d_model=16, n_heads=4, seed=1)
    with torch.no_grad():
        for par in model.parameters():                                  # make it non-trivial
            par.add_(torch.randn(par.shape, generator=torch.Generator().manual_seed(0)) * 0.3)
    x, y = torch.randn(3, 6, 4), torch.randn(3, 6)
    hidden, context = y.clone(), y.clone()
    hidden[:, -1] += 5.0                                                # the query's answer
    context[:, 2] += 5.0                                                # an example's answer
    with torch.no_grad():
        a, b, c = model(x, y), model(x, hidden), model(x, context)
    assert a.shape == (3,)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert (a - c).abs().min() > 1e-6


def test_model_rejects_bad_shapes():
    with pytest.raises(InputError, match=r"`d_model` \(10\) must be a multiple of `n_heads`; got 4"):
        te.TaskICLTransformer(4, 3, d_model=10, n_heads=4)


# -- training and checkpoints ---------------------------------------------------------

def _direct_loss(model: te.TaskICLTransformer, ds) -> float:
    x, y = torch.as_tensor(ds["x"].values), torch.as_tensor(ds["y"].values)
    with torch.no_grad():
        return float(((model(x, y) - y[:, -1]) ** 2).mean())


def test_tiny_run_layout_and_loss_decreases(tiny_run):
    run = tiny_run
    np.testing.assert_array_equal(run["step"].values, [0, 20, 40, 60])
    n_params = sum(p.numel() for p in te.TaskICLTransformer(4, 4, n_layers=2, d_model=16, n_heads=2).parameters())
    assert run["weights"].shape == (4, n_params)
    assert run.attrs["params"]["n_layers"] == 2 and run.attrs["cancelled"] is False
    assert np.all(np.diff(run["wall_seconds"].values) >= 0)
    assert np.all(np.diff(run["cpu_seconds"].values) >= 0)
    held_out = te.sample_task_prompts(run["bases"].values, 256, 4, noise_std=0.1, coef_mean=1.0,
                                      coef_std=0.5, seed=99)
    first = _direct_loss(te.task_emergence_model(run, 0), held_out)
    last = _direct_loss(te.task_emergence_model(run, 60), held_out)
    assert last < 0.8 * first
    assert run["train_loss"].values[-1] < run["train_loss"].values[1]


def test_learning_rate_warms_up_and_decays_to_zero():
    # Adam's first update moves every parameter with a non-negligible gradient by the
    # learning rate itself (m / sqrt(v) = sign(g) after bias correction), so the largest
    # change after step 1 reads off the rate of step 1.
    lr = 1e-3
    warm = te.train_task_emergence(**{**TINY, "lr": lr, "warmup": 4, "steps": 6, "checkpoint_every": 1})
    w = warm["weights"].values
    assert np.abs(w[1] - w[0]).max() == pytest.approx(lr * 1 / 4, rel=1e-3)
    steps = 5
    cos = te.train_task_emergence(**{**TINY, "lr": lr, "lr_decay": "cosine", "steps": steps,
                                     "checkpoint_every": 1})
    w = cos["weights"].values
    assert np.abs(w[1] - w[0]).max() == pytest.approx(lr * 0.5 * (1 + np.cos(np.pi / steps)), rel=1e-3)
    np.testing.assert_array_equal(w[-1], w[-2])   # the rate of the last step is 0
    with pytest.raises(InputError, match="lr_decay"):
        te.train_task_emergence(**{**TINY, "lr_decay": "linear"})


def test_training_is_seeded_and_can_be_cancelled():
    a = te.train_task_emergence(**{**TINY, "steps": 4, "checkpoint_every": 2})
    b = te.train_task_emergence(**{**TINY, "steps": 4, "checkpoint_every": 2})
    np.testing.assert_array_equal(a["weights"].values, b["weights"].values)
    cut = te.train_task_emergence(**{**TINY, "steps": 10, "checkpoint_every": 2},
                                  progress=lambda done, total: done < 4)
    np.testing.assert_array_equal(cut["step"].values, [0, 2, 4])
    assert cut.attrs["cancelled"] is True


def test_checkpoint_weights_round_trip_through_model_store_and_safetensors(tiny_run, tmp_path):
    from safetensors import safe_open

    from explorer.store import ActivationStore

    model = te.task_emergence_model(tiny_run, 40)
    np.testing.assert_array_equal(model.flat_weights(), tiny_run["weights"].sel(step=40).values)
    path = te.save_run_safetensors(tiny_run, tmp_path / "run.safetensors")
    with safe_open(str(path), framework="pt") as f:
        tensor = f.get_tensor("step_40/blocks.1.qkv.weight")
    np.testing.assert_array_equal(tensor.numpy(), model.blocks[1].qkv.weight.detach().numpy())
    back = te.load_run_safetensors(path)
    for name in ("weights", "bases", "train_loss", "step", "wall_seconds"):
        np.testing.assert_array_equal(back[name].values, tiny_run[name].values)
    assert back.attrs == json.loads(json.dumps(tiny_run.attrs))
    with pytest.raises(InputError, match="no safetensors run at"):
        te.load_run_safetensors(tmp_path / "missing.safetensors")
    # The store (zarr) keeps the run: trained once, then read back.
    store = ActivationStore(tmp_path / "cache")
    calls = []
    small = {**TINY, "steps": 2, "checkpoint_every": 1}
    first = te.task_emergence_run(store=store, progress=lambda d, t: calls.append(d), **small)
    again = te.task_emergence_run(store=store, progress=lambda d, t: calls.append(d), **small)
    assert calls == [1, 2]
    np.testing.assert_array_equal(first["weights"].values, again["weights"].values)
    with pytest.raises(InputError, match="unknown task-emergence training parameter 'step'"):
        te.task_emergence_run(store=store, step=3)


# -- analysis against direct computations ---------------------------------------------

def test_td_and_icl_loss_over_steps_match_a_direct_computation(tiny_run):
    from sklearn.neighbors import KNeighborsClassifier

    analysis = te.task_emergence_analysis(tiny_run, n_per_task=15, k=5, seed=7)
    assert analysis["td"].dims == ("step", "layer")
    assert analysis["td"].shape == (4, 2)
    assert analysis["icl_loss"].shape == (4, 2)
    assert analysis["projection"].shape == (4, 2, 30, 2)
    # Direct computation at step 40: the same evaluation prompts, residuals by forward hooks.
    p = tiny_run.attrs["params"]
    labels = np.repeat([0, 1], 15)
    ds = te.sample_task_prompts(tiny_run["bases"].values, 30, p["n_examples"], tasks=labels,
                                noise_std=p["noise_std"], coef_mean=1.0, coef_std=0.5, seed=7)
    model = te.task_emergence_model(tiny_run, 40)
    kept = []
    hooks = [b.register_forward_hook(lambda mod, inp, out: kept.append(out[:, -1].numpy()))
             for b in model.blocks]
    x, y = torch.as_tensor(ds["x"].values), torch.as_tensor(ds["y"].values)
    with torch.no_grad():
        pred = model(x, y).numpy()
    for h in hooks:
        h.remove()
    at = analysis.sel(step=40)
    for layer, h in enumerate(kept):
        # Leave-one-out 5-NN with two classes (no ties): ask for 6 neighbours, drop the point itself.
        knn = KNeighborsClassifier(n_neighbors=6).fit(h, labels)
        _, idx = knn.kneighbors(h)
        votes = np.array([np.bincount(labels[row[row != i][:5]], minlength=2).argmax()
                          for i, row in enumerate(idx)])
        assert float(at["td"].sel(layer=layer)) == pytest.approx((votes == labels).mean())
        # PCA: the projection spans the top-2 principal directions of the centred residuals.
        centred = h - h.mean(0)
        _, s, _ = np.linalg.svd(centred.astype(np.float64), full_matrices=False)
        got = at["projection"].sel(layer=layer).values.astype(np.float64)
        np.testing.assert_allclose(np.sort(np.linalg.norm(got, axis=0))[::-1], s[:2], rtol=1e-3)
    err = (pred - ds["y"].values[:, -1]) ** 2
    np.testing.assert_allclose(at["icl_loss"].values, [err[:15].mean(), err[15:].mean()], rtol=1e-5)
    # Oracle: Bayesian regression on the task's own 2-d coordinates c ~ N(1, 0.5^2 I), closed form.
    oracle = []
    m, var = np.ones(2), 0.5**2
    for t in (0, 1):
        B = tiny_run["bases"].values[t].astype(np.float64)
        for i in np.flatnonzero(labels == t):
            Z = ds["x"].values[i, :-1] @ B                              # [example, rank]
            r = ds["y"].values[i, :-1] - Z @ m
            c = m + np.linalg.solve(Z.T @ Z + p["noise_std"] ** 2 / var * np.eye(2), Z.T @ r)
            oracle.append((ds["x"].values[i, -1] @ B @ c - ds["y"].values[i, -1]) ** 2)
    np.testing.assert_allclose(analysis["oracle_loss"].values,
                               [np.mean(oracle[:15]), np.mean(oracle[15:])], rtol=1e-4)
    # Knowing the task, ignoring the examples: the task's mean weights B_t (1, 1).
    mean_err = [(ds["x"].values[i, -1] @ tiny_run["bases"].values[t].astype(np.float64) @ m
                 - ds["y"].values[i, -1]) ** 2 for t in (0, 1) for i in np.flatnonzero(labels == t)]
    np.testing.assert_allclose(analysis["task_mean_loss"].values,
                               [np.mean(mean_err[:15]), np.mean(mean_err[15:])], rtol=1e-5)
    np.testing.assert_allclose(analysis["zero_loss"].values,
                               [np.mean(ds["y"].values[:15, -1] ** 2), np.mean(ds["y"].values[15:, -1] ** 2)],
                               rtol=1e-5)
    assert analysis.attrs["best_layer"] == int(np.argmax(analysis["td"].values[-1]))


def test_analysis_round_trips_through_safetensors(tiny_run, tmp_path):
    analysis = te.task_emergence_analysis(tiny_run, n_per_task=6, k=3, seed=2)
    back = te.load_analysis_safetensors(te.save_analysis_safetensors(analysis, tmp_path / "a.safetensors"))
    for name in analysis.data_vars:
        if name == "projection":   # stored as float16
            np.testing.assert_array_equal(back[name].values,
                                          analysis[name].values.astype(np.float16).astype(np.float32))
        else:
            np.testing.assert_array_equal(back[name].values, analysis[name].values)
        assert back[name].dims == analysis[name].dims
    assert list(back["component"].values) == ["pc1", "pc2"]
    np.testing.assert_array_equal(back["cpu_seconds"].values, analysis["cpu_seconds"].values)
    assert back.attrs == json.loads(json.dumps(analysis.attrs))


@pytest.mark.skipif(not te.SHIPPED_ANALYSIS.is_file(), reason="the shipped analysis is missing")
def test_default_analysis_reads_the_shipped_one_without_training(tmp_path, monkeypatch):
    from explorer.store import ActivationStore

    monkeypatch.setattr(te_runs, "train_task_emergence", lambda **kw: pytest.fail("trained instead of reading"))
    a = te.default_analysis(store=ActivationStore(tmp_path))
    assert "shipped" in a.attrs["source"]
    assert {**a.attrs["params"]["run_params"], "seed": a.attrs["params"]["run_seed"]} == {**te.DEFAULTS, "seed": 0}
    # Its headline numbers are those of its own curves, recomputed here from the arrays
    td_last = a["td"].values[-1]
    best = int(np.argmax(td_last))
    r2_mean = 1 - a["icl_loss_mean"].values / a["zero_loss"].values.mean()
    from scipy.stats import pearsonr

    assert a.attrs["best_layer"] == best
    np.testing.assert_allclose(a.attrs["final_td"], td_last, atol=5e-5)
    assert a.attrs["td_icl_correlation"] == pytest.approx(
        pearsonr(a["td"].values[:, best], r2_mean)[0], abs=5e-5)
    np.testing.assert_allclose(a.attrs["final_icl_loss"], a["icl_loss"].values[-1], atol=5e-5)
    assert a["td"].shape == (a.sizes["step"], te.DEFAULTS["n_layers"])


def test_rise_step_hand_worked():
    steps = [0, 10, 20, 30, 40, 50]
    assert te.rise_step([0, 0, 0.2, 0.6, 1, 1], steps) == 30          # final 0.866.., half 0.433
    assert te.rise_step([0, 0, 0.2, 0.6, 1, 1], steps, fraction=0.1) == 20
    # a falling loss: final mean(0.5, 0.1, 0.1) = 0.233, half-way 1.117, first reached at 1 (step 20)
    assert te.rise_step([2, 2, 1, 0.5, 0.1, 0.1], steps) == 20
    assert te.rise_step([1, 1, 1], [0, 1, 2]) is None
    with pytest.raises(InputError, match="same length"):
        te.rise_step([1, 2], [0])


def test_analysis_of_a_single_checkpoint_has_no_rise_steps():
    run = te.train_task_emergence(**{**TINY, "steps": 0})
    analysis = te.task_emergence_analysis(run, n_per_task=4, k=3)
    assert analysis.sizes["step"] == 1
    assert analysis.attrs["td_rise_step_50"] is None and analysis.attrs["td_icl_correlation"] is None


def test_analysis_rejects_bad_runs_and_steps(tiny_run):
    with pytest.raises(TypeError, match="`run` must be an xarray.Dataset"):
        te.task_emergence_analysis({"weights": 1})
    with pytest.raises(InputError, match="not a task-emergence training run"):
        te.task_emergence_analysis(tiny_run[["train_loss"]])
    with pytest.raises(InputError, match=r"`step` must be a checkpoint step of the run \(0, 20, 40, \.\.\., 60\); got 5"):
        te.task_emergence_model(tiny_run, 5)
    with pytest.raises(InputError, match=r"`k` must be an int in \[1, 5\]"):
        te.task_emergence_analysis(tiny_run, n_per_task=3, k=6)


def test_cli_train_and_analyse(tmp_path, monkeypatch, capsys):
    command = OneCommand("task_emergence", monkeypatch, capsys)
    out = tmp_path / "run.safetensors"
    args = ["task-emergence", "train", "--steps", "4", "--checkpoint-every", "2", "--n-layers", "1",
            "--d-model", "16", "--json", "--cache", str(tmp_path)]
    trained = command.json(args + ["--out", str(out)])
    assert trained["n_checkpoints"] == 3 and trained["params"]["d_model"] == 16
    assert out.is_file()
    args[1] = "analyse"
    summary = command.json(args + ["--n-per-task", "5", "--k", "3"])
    assert len(summary["final_td"]) == 1 and len(summary["final_icl_loss"]) == 4
    # the printed figures are the library's on the same run and settings
    run = te.load_run_safetensors(out)
    expect = te.emergence_summary(te.task_emergence_analysis(run, n_per_task=5, k=3))
    assert {key: summary[key] for key in expect} == json.loads(json.dumps(expect))
    assert command(["task-emergence", "train", "--steps", "-1", "--cache", str(tmp_path)]) == 2
    assert "`steps` must be an int" in capsys.readouterr().err


# -- view -----------------------------------------------------------------------------

def test_view_follows_the_step_and_layer(tiny_run):
    pytest.importorskip("panel")
    from apps.task_emergence import TaskEmergenceView, plot_emergence_curves

    analysis = te.task_emergence_analysis(tiny_run, n_per_task=6, k=3)
    view = TaskEmergenceView(analysis=analysis, background=False)
    assert view.param.step.objects == [0, 20, 40, 60] and view.step == 60
    assert view.layer == analysis.attrs["best_layer"]
    view.param.update(step=20, layer=0)
    points = view._projection_plot()
    np.testing.assert_allclose(points.dimension_values("PC1"),
                               analysis["projection"].sel(step=20, layer=0, component="pc1").values)
    assert "step 20" in points.opts.get().kwargs["title"]
    assert view.summary().startswith(f"**Step 20**: TD after layer 0 = "
                                     f"{float(analysis['td'].sel(step=20, layer=0)):.2f}")
    curves = plot_emergence_curves(analysis, 20)
    assert len(curves) == 2
    import panel as pn

    layout = view.__panel__()
    sliders = [w for w in layout.select(pn.widgets.DiscreteSlider)
               if list(dict(w.options).values()) == [0, 20, 40, 60]]
    assert sliders and sliders[0].value == 20          # the page's step control follows
    assert len(layout.select(pn.pane.HoloViews)) >= 2  # projection and curves are on it


def test_view_titles_are_short_and_captions_and_tooltips_say_the_rest(tiny_run):
    pytest.importorskip("panel")
    import panel as pn

    from apps.task_emergence import TaskEmergenceView

    analysis = te.task_emergence_analysis(tiny_run, n_per_task=6, k=3)
    view = TaskEmergenceView(analysis=analysis, background=False)
    view.param.update(step=20, layer=0)
    titles = [view._projection_plot().opts.get().kwargs["title"], view._td_plot().opts.get().kwargs["title"],
              view._loss_plot().opts.get().kwargs["title"], view._td_curves_plot().opts.get().kwargs["title"]]
    assert titles == ["Query residual, layer 0, step 20", "TD by layer, step 20", "ICL loss per task",
                      "TD over training"]
    td = float(analysis["td"].sel(step=20, layer=0))
    assert f"TD) there = {td:.2f}" in view._projection_caption()
    agnostic = float(analysis["agnostic_loss"].mean())
    assert f"task-agnostic ridge (dot-dash, {agnostic:.3g})" in view._curves_caption()
    controls = view.controls()
    tips = [w.value for w in controls.select(pn.widgets.TooltipIcon)]
    assert tips == [view.param.step.doc, view.param.layer.doc]
    assert "<b>Layer</b>" in [str(p.object) for p in controls.select(pn.pane.HTML)]


def test_view_captions_name_the_plots_and_curve_plots_wrap_before_they_shrink(tiny_run):
    pytest.importorskip("panel")
    import panel as pn

    from apps.task_emergence import TaskEmergenceView

    analysis = te.task_emergence_analysis(tiny_run, n_per_task=6, k=3)
    view = TaskEmergenceView(analysis=analysis, background=False)
    # The plots stack on narrow windows, so the captions cannot say "left" and "right".
    for text in (view._projection_caption(), view._curves_caption()):
        assert "Left" not in text and "Right" not in text
    assert "The projection (first plot)" in view._projection_caption()
    # Each plot of a row keeps a minimum width (the row wraps) so that a frame with a legend
    # beside it is not squeezed to a sliver.
    widths = {p.css_classes[0]: p.min_width for p in view.__panel__().select(pn.pane.HoloViews)}
    assert widths == {"emergence-projection": 420, "emergence-td": 420,
                      "emergence-curves": 480, "emergence-td-curves": 480}
