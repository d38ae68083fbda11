"""Function vectors and task decodability, against sklearn, formulas and torch hooks."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.analyses import task_vectors as tv


def _ids(model, prompt):
    return torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])


def test_knn_decodability_on_synthetic_clusters_matches_sklearn():
    from sklearn.model_selection import LeaveOneOut, cross_val_score
    from sklearn.neighbors import KNeighborsClassifier

    rng = np.random.default_rng(0)
    centres = rng.normal(scale=4.0, size=(4, 8))
    y = np.repeat(np.arange(4), 15)
    separated = centres[y] + rng.normal(scale=0.3, size=(60, 8))
    assert tv.knn_loo_accuracy(separated, y, k=10) == 1.0
    noisy = centres[y] * 0.15 + rng.normal(size=(60, 8))
    ours = tv.knn_loo_predictions(noisy, y, k=9)   # odd k with 4 classes can still tie
    # point by point against scikit-learn's neighbours of each left-out point: without a tie
    # in votes the two predictions are the same; with one, sklearn takes the smallest tied
    # label and ours the tied label whose member is nearest (so the accuracies differ
    # exactly by the tied points, counted here)
    n_ties = 0
    for i in range(len(y)):
        rest = np.delete(np.arange(len(y)), i)
        clf = KNeighborsClassifier(n_neighbors=9).fit(noisy[rest], y[rest])
        near = y[rest][clf.kneighbors(noisy[i:i + 1], return_distance=False)[0]]
        votes = np.bincount(near, minlength=4)
        tied = np.flatnonzero(votes == votes.max())
        sk = clf.predict(noisy[i:i + 1])[0]
        if len(tied) == 1:
            assert ours[i] == sk == tied[0], i
        else:
            n_ties += 1
            assert sk == tied.min() and ours[i] == next(lab for lab in near if lab in tied), i
    acc = tv.knn_loo_accuracy(noisy, y, k=9)
    assert acc == np.mean(ours == y) and 0.25 < acc < 1.0
    ref = cross_val_score(KNeighborsClassifier(n_neighbors=9), noisy, y, cv=LeaveOneOut()).mean()
    assert n_ties > 0 or acc == ref               # with no tie, the accuracies are equal
    pure_noise = rng.normal(size=(60, 8))
    assert tv.knn_loo_accuracy(pure_noise, y, k=10) < 0.5


def test_knn_leaves_the_point_out_and_breaks_ties_by_distance():
    x = np.array([[0.0], [0.1], [5.0], [5.2], [5.3]])
    y = np.array(["a", "a", "b", "b", "b"])
    # k=1: each point's nearest *other* point; point 0 -> 1 ("a")
    assert tv.knn_loo_predictions(x, y, k=1).tolist() == ["a", "a", "b", "b", "b"]
    # k=2 for point 1: neighbours 0 ("a", d=0.1) and 2 ("b", d=4.9): tie -> closest, "a"
    assert tv.knn_loo_predictions(x, y, k=2)[1] == "a"
    with pytest.raises(InputError, match="`k` must be an int in"):
        tv.knn_loo_predictions(x, y, k=5)


def test_r_squared_is_the_squared_correlation():
    x = np.array([0.0, 1.0, 2.0, 3.0])
    assert tv.r_squared(x, 2 * x + 1) == pytest.approx(1.0)
    y = np.array([1.0, 0.0, 2.0, 1.5])
    slope, icept = np.polyfit(x, y, 1)
    resid = y - (slope * x + icept)
    assert tv.r_squared(x, y) == pytest.approx(1 - resid.var() / y.var())
    assert np.isnan(tv.r_squared([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_function_vector_is_the_o_proj_of_the_selected_heads_means(tiny_model):
    m = tiny_model
    rng = np.random.default_rng(0)
    mz = rng.normal(size=(m.spec.n_layers, m.spec.n_heads, m.spec.d_head))
    heads = [(1, 0), (1, 3), (2, 2)]
    vec = tv.function_vector(m, mz, heads)
    expect = np.zeros(m.spec.d_model)
    for layer in (1, 2):
        z = torch.zeros(m.spec.n_heads * m.spec.d_head)
        for lh in heads:
            if lh[0] == layer:
                z[lh[1] * m.spec.d_head:(lh[1] + 1) * m.spec.d_head] = torch.tensor(mz[lh])
        out = m.o_proj(layer)(z[None].float())[0]
        if m.o_proj(layer).bias is not None:
            out = out - m.o_proj(layer).bias
        expect += out.double().numpy()
    np.testing.assert_allclose(vec, expect, atol=1e-5)


def test_function_vector_accuracy_adds_the_vector_at_the_layer(tiny_model):
    m = tiny_model
    fv_score = np.zeros((m.spec.n_layers, m.spec.n_heads))
    fv_score[0, 2] = 1.0
    ds = tv.function_vector_accuracy(m, ["uppercase"], fv_score, layer=1, top_fraction=0.05,
                                     alpha=30.0, n_prompts=4, n_shots=2, seed=0)
    assert ds.attrs["layer"] == 1 and ds.attrs["heads"] == [[0, 2]]
    clean, _ = ih.icl_prompts("uppercase", n_prompts=4, n_shots=2, seed=0)
    mz = ih.task_mean_z(m, clean)
    np.testing.assert_allclose(ds.function_vector.values[0], tv.function_vector(m, mz, [(0, 2)]))
    queries, answers = ih.icl_prompts("uppercase", n_prompts=4, n_shots=0, seed=1)
    vec = torch.tensor(ds.function_vector.values[0], dtype=torch.float32)

    def add(mod, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h.clone()
        h[:, -1] += 30.0 * vec
        return (h, *out[1:]) if isinstance(out, tuple) else h

    target = [m.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in answers]
    hits, plain_hits = [], []
    handle = m.hf_layer(1).register_forward_hook(add)
    try:
        for q, t in zip(queries, target):
            hits.append(int(m.hf(_ids(m, q)).logits[0, -1].argmax()) == t)
    finally:
        handle.remove()
    for q, t in zip(queries, target):
        plain_hits.append(int(m.hf(_ids(m, q)).logits[0, -1].argmax()) == t)
    assert float(ds.fv_accuracy[0]) == pytest.approx(np.mean(hits))
    assert float(ds.zero_shot_accuracy[0]) == pytest.approx(np.mean(plain_hits))


def test_task_decodability_on_tiny_model(tiny_model):
    m = tiny_model
    ds = tv.task_decodability(m, ["antonym", "uppercase", "choose-first-of-3"], n_prompts=6,
                              n_shots=2, k=3, seed=0)
    assert list(ds.task.values) == ["antonym", "uppercase", "choose-first-of-3", "null"]
    assert ds.projection.shape == (m.spec.n_layers, 24, 2)
    assert np.isnan(float(ds.icl_accuracy.sel(task="null")))
    # TD at layer 1 is the k-NN LOO accuracy of the last-token residuals (plain hf run)
    tasks = [ih.load_icl_task(t) for t in ["antonym", "uppercase", "choose-first-of-3"]]
    tasks.append(tv.null_task(tasks, 0))
    prompts = []
    for t in tasks:
        prompts += ih.icl_prompts(t, n_prompts=6, n_shots=2, seed=0)[0]
    resid = np.stack([m.hf(_ids(m, p), output_hidden_states=True).hidden_states[2][0, -1].numpy()
                      for p in prompts])                                  # resid_post of layer 1
    labels = np.repeat([t.name for t in tasks], 6)
    assert list(ds.prompt_task.values) == list(labels)
    assert float(ds.td[1]) == pytest.approx(tv.knn_loo_accuracy(resid, labels, k=3))
    assert ds.attrs["best_layer"] == int(np.argmax(ds.td.values))
    with pytest.raises(InputError, match="at least 2 tasks"):
        tv.task_decodability(m, ["antonym"])


def test_cli_task_vectors_json(capsys):
    from explorer.commands.task_vectors import register_cli

    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    args = parser.parse_args(["task-vectors", "--model", "tiny-llama", "--tasks",
                              "antonym,uppercase", "--n-prompts", "4", "--n-shots", "2",
                              "--k", "3", "--function-vectors", "--top-fraction", "0.1",
                              "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["td"]) == 3 and set(out["fv_accuracy"]) == {"antonym", "uppercase"}
    assert out["fv_layer"] == 1


# -- out of core with dask ----------------------------------------------------------------

def _stored_clusters(tmp_path, n_tasks=4, per_task=12, n_layers=4, d_model=16):
    """Clustered last-token residuals [prompt, pos=1, layer, d_model], stored in small chunks.

    Cluster separation grows with the layer, so TD differs from layer to layer."""
    import xarray as xr
    from unittest import mock

    import explorer.store as store_module
    from explorer.store import ActivationStore

    rng = np.random.default_rng(3)
    labels = np.repeat([f"task{i}" for i in range(n_tasks)], per_task)
    centres = rng.normal(size=(n_tasks, n_layers, d_model))
    codes = np.repeat(np.arange(n_tasks), per_task)
    scale = np.linspace(0.1, 1.5, n_layers)[None, :, None]
    x = (centres[codes] * scale + rng.normal(size=(len(codes), n_layers, d_model)))
    x = x.astype(np.float32)                                          # [prompt, layer, d_model]
    ds = xr.Dataset({"resid_post": (("prompt", "pos", "layer", "d_model"), x[:, None])},
                    coords={"prompt": np.arange(len(codes)), "layer": np.arange(n_layers)})
    store = ActivationStore(tmp_path)
    row_bytes = n_layers * d_model * 4
    with mock.patch.object(store_module, "_TARGET_CHUNK_BYTES", 10 * row_bytes):
        store.put("td-clusters", ds, parts={"method": "test"})
    return store, x, labels


@pytest.mark.parametrize("scheduler", ["synchronous", "threads", "local"])
def test_decodability_over_store_equals_knn_per_layer_in_memory(tmp_path, scheduler):
    store, x, labels = _stored_clusters(tmp_path)
    lazy = store.get("td-clusters")
    assert len(lazy.resid_post.chunks[0]) > 1                         # several dask chunks
    # one in-process worker, no memory limit (explorer.distributed refuses one in-process)
    options = (dict(n_workers=1, processes=False) if scheduler == "local"
               else None)
    out = tv.decodability_over_store(lazy, labels, k=5, scheduler=scheduler,
                                     scheduler_options=options)
    assert out.attrs["scheduler"] == scheduler
    expect_td = [tv.knn_loo_accuracy(x[:, layer], labels, k=5) for layer in range(x.shape[1])]
    assert out.td.values.tolist() == expect_td                         # exactly
    assert len(set(expect_td)) > 1 and max(expect_td) > 0.9
    for layer in range(x.shape[1]):
        pred = tv.knn_loo_predictions(x[:, layer], labels, k=5)
        assert out.predicted.values[layer].tolist() == pred.tolist()
        ok = pred == labels
        assert out.td_per_task.values[layer].tolist() == [ok[labels == t].mean()
                                                          for t in out.task.values]
        centred = x[:, layer].astype(np.float64) - x[:, layer].astype(np.float64).mean(0)
        sv = np.linalg.svd(centred, compute_uv=False)
        # the 2-D projection keeps the two leading principal directions' variance
        np.testing.assert_allclose((out.projection.values[layer] ** 2).sum(0), sv[:2] ** 2,
                                   rtol=1e-9)
    assert list(out.task.values) == ["task0", "task1", "task2", "task3"]


def test_decodability_over_store_rejects_bad_input(tmp_path):
    store, x, labels = _stored_clusters(tmp_path)
    lazy = store.get("td-clusters")
    with pytest.raises(InputError, match=r"`scheduler` must be one of 'threads', "
                                         r"'synchronous', 'local'; got 'thread'"):
        tv.decodability_over_store(lazy, labels, scheduler="thread")
    with pytest.raises(InputError, match=r"`labels` must have one label per prompt \(48\)"):
        tv.decodability_over_store(lazy, labels[:-1])
    with pytest.raises(InputError, match=r"`site` 'attn_z' is not in the Dataset"):
        tv.decodability_over_store(lazy, labels, site="attn_z")
    with pytest.raises(InputError, match=r"`k` must be an int in"):
        tv.decodability_over_store(lazy, labels, k=48)


def test_task_decodability_through_the_store_and_dask_is_the_same(tiny_model, tmp_path):
    from explorer.store import ActivationStore

    m, store = tiny_model, ActivationStore(tmp_path)
    kw = dict(n_prompts=5, n_shots=2, k=3, seed=0)
    tasks = ["antonym", "uppercase"]
    plain = tv.task_decodability(m, tasks, **kw)
    via_dask = tv.task_decodability(m, tasks, store=store, scheduler="synchronous", **kw)
    [entry] = store.ls()
    assert entry["parts"]["method"] == "last_token_residuals"
    again = tv.task_decodability(m, tasks, store=store, **kw)          # from the cache, in memory
    threads = tv.task_decodability(m, tasks, scheduler="threads", **kw)  # no store
    for ds in (via_dask, again, threads):
        for name in ("td", "td_per_task", "projection", "prompt_task"):
            np.testing.assert_array_equal(ds[name].values, plain[name].values, err_msg=name)
        assert ds.attrs["best_layer"] == plain.attrs["best_layer"]
    assert len(store.ls()) == 1
    with pytest.raises(InputError, match=r"`scheduler` must be one of .*got 'nope'"):
        tv.task_decodability(m, tasks, scheduler="nope", **kw)


def test_cli_task_vectors_scheduler_option(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    from explorer.cli import build_parser

    parser = build_parser()  # the whole CLI: a flag clashing with a global one fails here
    base = ["task-vectors", "--model", "tiny-llama", "--tasks", "antonym,uppercase",
            "--n-prompts", "4", "--n-shots", "2", "--k", "3", "--json"]
    args = parser.parse_args(base + ["--scheduler", "synchronous", "--store-residuals"])
    assert args.scheduler == "synchronous"
    assert args.func(args) == 0
    cached = json.loads(capsys.readouterr().out)
    args = parser.parse_args(base)
    assert args.scheduler == "threads" and not args.store_residuals
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["td"] == cached["td"]
    assert any((tmp_path / "activations").iterdir())
    args = parser.parse_args(base + ["--scheduler", "thread"])
    with pytest.raises(InputError, match=r"`scheduler` must be one of .*got 'thread'"):
        args.func(args)
