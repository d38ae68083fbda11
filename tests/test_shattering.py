"""Representation shattering (Nishi et al., ICML 2025): graph generator, training, ROME, MEMIT
and fine-tuning edits, the shattering ratio R, storage and the command line, on tiny settings."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import shattering as sh

TINY = {"n_entities": 16, "n_orders": 2, "max_hops": 2, "heldout_fraction": 0.1, "walk_length": 4,
        "d_model": 32, "n_layers": 2, "n_heads": 2, "d_mlp": 64, "steps": 150, "batch_size": 64,
        "lr": 1e-2, "seed": 0}

# tiny models: one thread is much faster than two on a shared machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def km(one_torch_thread):
    return sh.train_knowledge_model(**TINY)


@pytest.fixture(scope="module")
def cov(km):
    return sh.key_covariance(km, 0, n_walks=300)


# -- graph ----------------------------------------------------------------------------

def test_graph_orders_are_cycles_and_relations_follow_them():
    g = sh.knowledge_graph(20, 3, max_hops=4, seed=3)
    n = 20
    for o in range(3):
        assert sorted(g.orders[o].tolist()) == list(range(n))          # a permutation
        assert (g.orders[o, g.position[o]] == np.arange(n)).all()       # position inverts it
    objects = g.objects()
    assert g.n_relations == 3 * 4 * 2
    for r, (o, h) in enumerate(g.relations):
        for e in range(n):
            # hand-walk |h| single steps along the cycle
            place = int(np.nonzero(g.orders[o] == e)[0][0])
            assert objects[e, r] == g.orders[o, (place + h) % n]
            assert objects[objects[e, r], g.inverse(r)] == e             # inverse undoes it
    # k hops = k single hops
    one = g.relations.index((1, 1))
    two = g.relations.index((1, 2))
    assert (objects[objects[:, one], one] == objects[:, two]).all()
    # walking n single steps around a cycle returns to the start
    e = np.arange(n)
    for _ in range(n):
        e = objects[e, one]
    assert (e == np.arange(n)).all()


def test_graph_held_out_splits_are_consistent():
    g = sh.knowledge_graph(40, 2, max_hops=4, heldout_fraction=0.2, seed=1)
    objects = g.objects()
    n_pairs = 40 * 2 * 4
    counts = {s: int((g.split == s).sum()) for s in sh.SPLITS}
    assert counts["logical"] == round(0.2 * n_pairs)
    assert counts["compositional"] == 2 * round(0.2 * n_pairs)
    for e, r in zip(*np.nonzero(g.split == "logical")):
        assert g.split[objects[e, r], g.inverse(r)] == "direct"         # inverse is trained
    for e, r in zip(*np.nonzero(g.split == "compositional")):
        assert g.split[objects[e, r], g.inverse(r)] == "compositional"  # inverse held out too


def test_random_walks_use_only_trained_facts():
    g = sh.knowledge_graph(16, 2, max_hops=2, heldout_fraction=0.2, seed=0)
    walks = sh.random_walks(g, 200, 6, rng=np.random.default_rng(0))
    assert walks.shape == (200, 11)
    objects = g.objects()
    n = g.n_entities
    for i in range(1, 11, 2):
        e, r, e2 = walks[:, i - 1], walks[:, i] - n, walks[:, i + 1]
        assert (r >= 0).all() and (e < n).all()
        assert (objects[e, r] == e2).all()
        assert (g.split[e, r] == "direct").all()


def test_graph_rejects_bad_values():
    with pytest.raises(InputError, match="`n_orders` must be an int in"):
        sh.knowledge_graph(16, 0)
    with pytest.raises(InputError, match="`heldout_fraction` must be a number in"):
        sh.knowledge_graph(16, 1, heldout_fraction=0.9)
    with pytest.raises(InputError, match="unknown training parameter 'd_modle'"):
        sh.train_knowledge_model(d_modle=8)
    with pytest.raises(InputError, match="`relation` must be one of .*Did you mean 'A\\+1'"):
        sh.knowledge_graph(16, 1).relation_index("A+1 ")


# -- training -------------------------------------------------------------------------

def test_training_reduces_the_loss(km):
    loss = km.history["loss"]
    assert loss[-1] < 0.5 * loss[0]
    # chance over 16 entities is log(16) = 2.77 nats
    assert loss[0] > 2.0


def test_training_is_reproducible_with_a_seed():
    with torch.enable_grad():
        a = sh.train_knowledge_model(**{**TINY, "steps": 5})
        b = sh.train_knowledge_model(**{**TINY, "steps": 5})
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n


def test_save_and_load_round_trip(km, tmp_path):
    path = sh.save_knowledge_model(km, tmp_path / "m.safetensors")
    back = sh.load_knowledge_model(path)
    tokens = torch.tensor([[0, 16, 3, 17]])
    assert torch.equal(back.model(tokens), km.model(tokens))
    assert back.params == km.params
    assert (back.graph.orders == km.graph.orders).all()
    with pytest.raises(InputError, match="no stored knowledge model"):
        sh.load_knowledge_model(tmp_path / "missing.safetensors")


def test_fact_accuracy_matches_a_plain_forward(km):
    acc = sh.fact_accuracy(km)
    g = km.graph
    objects = g.objects()
    right = {s: [] for s in sh.SPLITS}
    for e in range(g.n_entities):
        for r in range(g.n_relations):
            logits = km.model(torch.tensor([[e, g.n_entities + r]]))[0, -1, :g.n_entities]
            right[g.split[e, r]].append(int(logits.argmax()) == objects[e, r])
    for s in sh.SPLITS:
        assert acc["accuracy"].sel(split=s).item() == pytest.approx(np.mean(right[s]))
    assert acc["accuracy"].sel(split="direct").item() > 0.5   # it learned the trained facts


# -- ROME -----------------------------------------------------------------------------

def test_rome_update_hits_the_value_and_keeps_c_orthogonal_keys():
    gen = torch.Generator().manual_seed(0)
    d_out, d_in = 5, 7
    W = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)
    A = torch.randn(d_in, 20, generator=gen, dtype=torch.float64)
    C = A @ A.T / 20                                                     # SPD second moment
    k = torch.randn(d_in, generator=gen, dtype=torch.float64)
    v = torch.randn(d_out, generator=gen, dtype=torch.float64)
    W2 = W + sh.rome_update(W, C, k, v)
    torch.testing.assert_close(W2 @ k, v, rtol=0, atol=1e-10)
    u = torch.linalg.solve(C, k)
    for _ in range(5):
        x = torch.randn(d_in, generator=gen, dtype=torch.float64)
        x = x - (u @ x) / (u @ u) * u                                    # u^T x = 0
        torch.testing.assert_close(W2 @ x, W @ x, rtol=0, atol=1e-10)
    assert torch.linalg.matrix_rank(W2 - W) == 1
    with pytest.raises(InputError, match="shapes must be"):
        sh.rome_update(W, C, v, k)


def test_rome_edit_on_the_model_writes_v_star_and_changes_one_matrix(km, cov):
    g = km.graph
    edit = sh.edit_fact(km, 3, 1, 2, method="rome", layer=0, cov=cov)
    assert edit.new_object == g.step(int(g.objects()[3, 1]), g.relations[1][0], 2)
    assert list(edit.delta) == ["blocks.0.mlp.proj.weight"]
    model = sh.edited_model(km, edit)
    proj = model.blocks[0].mlp["proj"]
    key, value = edit.info["key"], edit.info["value"]
    torch.testing.assert_close(proj(key), value.float(), rtol=1e-4, atol=1e-4)
    # the edited fact: strength 0 gives the old model back exactly
    same = sh.edited_model(km, edit, 0.0)
    for (n, p), (_, q) in zip(same.named_parameters(), km.model.named_parameters()):
        assert torch.equal(p, q), n


# -- fine-tuning ----------------------------------------------------------------------

def test_finetune_edit_changes_only_the_chosen_layer(km):
    edit = sh.edit_fact(km, 5, 0, 3, method="finetune", layer=1)
    assert edit.delta and all(n.startswith("blocks.1.mlp.") for n in edit.delta)
    model = sh.edited_model(km, edit)
    changed = {n for (n, p), (_, q) in zip(model.named_parameters(), km.model.named_parameters())
               if not torch.equal(p, q)}
    assert changed and all(n.startswith("blocks.1.mlp.") for n in changed)
    prompt = torch.tensor([[5, km.graph.n_entities + 0]])
    p_new = torch.softmax(model(prompt)[0, -1, :16], -1)[edit.new_object]
    p_old = torch.softmax(km.model(prompt)[0, -1, :16], -1)[edit.new_object]
    assert p_new > p_old


# -- MEMIT ----------------------------------------------------------------------------

def _spd(gen, d, n=40):
    A = torch.randn(d, n, generator=gen, dtype=torch.float64)
    return A @ A.T / n


def _memit_problem(seed: int, d_out: int, d_in: int, n_edits: int):
    """A random MEMIT problem drawn from ``seed`` and its update: the key covariance C
    (symmetric positive definite, [d_in, d_in]), the keys K [d_in, n_edits], the residuals R
    [d_out, n_edits] (float64 tensors) and Δ = `memit_update`(C, K, R) as an array."""
    gen = torch.Generator().manual_seed(seed)
    C = _spd(gen, d_in)
    K = torch.randn(d_in, n_edits, generator=gen, dtype=torch.float64)
    R = torch.randn(d_out, n_edits, generator=gen, dtype=torch.float64)
    return C, K, R, sh.memit_update(C, K, R).numpy()


def test_memit_update_one_key_matches_the_hand_derived_closed_form():
    # One key k, residual r: Δ (C + k k^T) = r k^T, and by Sherman-Morrison
    # Δ = r (C^{-1} k)^T / (1 + s), s = k^T C^{-1} k, so Δ k = r s / (1 + s).
    C, K, R, delta = _memit_problem(1, d_out=5, d_in=7, n_edits=1)
    Cn, kn, rn = C.numpy(), K.numpy()[:, 0], R.numpy()[:, 0]
    u = np.linalg.solve(Cn, kn)
    s = kn @ u
    np.testing.assert_allclose(delta, np.outer(rn, u) / (1 + s), rtol=0, atol=1e-12)
    np.testing.assert_allclose(delta @ kn, rn * s / (1 + s), rtol=0, atol=1e-12)
    np.testing.assert_allclose(delta @ (Cn + np.outer(kn, kn)), np.outer(rn, kn), rtol=0, atol=1e-12)
    assert np.linalg.matrix_rank(delta) == 1


def test_memit_update_is_the_regularised_least_squares_solution():
    # Δ minimises ||Δ K - R||² + ||Δ C^{1/2}||²: an ordinary least-squares problem on the
    # stacked system Δ [K, C^{1/2}] = [R, 0], solved here by numpy.linalg.lstsq.
    d_out, d_in, n_edits = 4, 6, 3
    C, K, R, delta = _memit_problem(2, d_out, d_in, n_edits)
    w, v = np.linalg.eigh(C.numpy())
    c_half = v @ np.diag(np.sqrt(w)) @ v.T
    A = np.hstack([K.numpy(), c_half])                                   # [d_in, n_edits + d_in]
    B = np.hstack([R.numpy(), np.zeros((d_out, d_in))])
    lstsq = np.linalg.lstsq(A.T, B.T, rcond=None)[0].T                   # Δ A = B
    np.testing.assert_allclose(delta, lstsq, rtol=0, atol=1e-10)
    with pytest.raises(InputError, match="shapes must be"):
        sh.memit_update(C, R, K)


def test_memit_update_keeps_keys_c_inverse_orthogonal_to_the_edited_ones():
    # Woodbury: Δ = R (I + K^T C^{-1} K)^{-1} K^T C^{-1}, so K^T C^{-1} x = 0 gives Δ x = 0.
    d_in, n_edits = 8, 3
    C, K, _, delta = _memit_problem(3, d_out=5, d_in=d_in, n_edits=n_edits)
    U = np.linalg.solve(C.numpy(), K.numpy())                            # C^{-1} K, [d_in, n_edits]
    q, _ = np.linalg.qr(U)
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = rng.normal(size=d_in)
        x -= q @ (q.T @ x)                                                # U^T x = 0
        assert np.abs(U.T @ x).max() < 1e-10
        np.testing.assert_allclose(delta @ x, 0.0, rtol=0, atol=1e-10)
    assert np.linalg.matrix_rank(delta) == n_edits
    # a key that is not C^{-1}-orthogonal does move
    assert np.abs(delta @ K.numpy()[:, 0]).max() > 1e-3


def test_memit_with_no_edits_changes_nothing(km, cov):
    assert torch.equal(sh.memit_update(cov, torch.zeros(64, 0), torch.zeros(32, 0)), torch.zeros(32, 64,
                                                                                                 dtype=torch.float64))
    delta, info = sh.memit_edits(km, [], layers=[0, 1], covs={0: cov})
    assert sorted(delta) == ["blocks.0.mlp.proj.weight", "blocks.1.mlp.proj.weight"]
    assert all(torch.equal(d, torch.zeros_like(d)) for d in delta.values())
    model = sh.edited_model(km, sh.KnowledgeEdit(0, 0, 0, 0, 0, "memit", 1, delta))
    for (n, p), (_, q) in zip(model.named_parameters(), km.model.named_parameters()):
        assert torch.equal(p, q), n


def test_memit_one_layer_on_the_model_writes_the_closed_form_residual(km, cov):
    # One block, which is also the critical one: the residual after it is linear in Δ, so the
    # edited model's residual moves by exactly Δ k = r s / (1 + s) from the unedited one.
    edit = sh.edit_fact(km, 3, 1, 2, method="memit", layer=0, cov=cov)
    assert list(edit.delta) == ["blocks.0.mlp.proj.weight"] and edit.info["layers"] == [0]
    prompt = torch.tensor([[3, km.graph.n_entities + 1]])
    key = km.model.mlp_keys(prompt, 0)[0, 1].double()
    h0 = km.model(prompt, resid_layer=0)[0, 1].double()
    r = edit.info["targets"][0] - h0
    s = key @ torch.linalg.solve(cov, key)
    h1 = sh.edited_model(km, edit)(prompt, resid_layer=0)[0, 1].double()
    torch.testing.assert_close(h1 - h0, r * s / (1 + s), rtol=1e-3, atol=1e-4)


def test_memit_changes_only_the_chosen_blocks_output_weights(km, cov):
    prompt = torch.tensor([[5, km.graph.n_entities + 0]])
    for layers, layer in (([0, 1], 1), ([1], 1), ([0], 1)):
        edit = sh.edit_fact(km, 5, 0, 3, method="memit", layer=layer, layers=layers, cov={0: cov})
        expected = {f"blocks.{l}.mlp.proj.weight" for l in layers}
        assert set(edit.delta) == expected
        model = sh.edited_model(km, edit)
        changed = {n for (n, p), (_, q) in zip(model.named_parameters(), km.model.named_parameters())
                   if not torch.equal(p, q)}
        assert changed == expected, layers
        p_new = torch.softmax(model(prompt)[0, -1, :16], -1)[edit.new_object]
        p_old = torch.softmax(km.model(prompt)[0, -1, :16], -1)[edit.new_object]
        assert p_new > p_old, layers


def test_memit_edits_several_facts_at_once(km, cov):
    g = km.graph
    facts = [(1, 0), (6, 2), (9, 3)]
    requests = [(e, r, sh.counterfactual_target(g, e, r, 2)) for e, r in facts]
    delta, info = sh.memit_edits(km, requests, layers=[0, 1], covs={0: cov})
    assert len(info["p_target_at_z"]) == 3 and info["targets"].shape == (3, 32)
    model = sh.edited_model(km, sh.KnowledgeEdit(0, 0, 0, 0, 0, "memit", 1, delta))
    for e, r, t in requests:
        prompt = torch.tensor([[e, g.n_entities + r]])
        p_new = torch.softmax(model(prompt)[0, -1, :16], -1)[t]
        p_old = torch.softmax(km.model(prompt)[0, -1, :16], -1)[t]
        assert p_new > p_old
    with pytest.raises(InputError, match=r"`layer` \(the last critical block\) must be >="):
        sh.memit_edits(km, requests, layer=0, layers=[1])

def test_edit_rejects_bad_values(km):
    with pytest.raises(InputError, match="`method` must be one of 'rome', 'memit', 'finetune'; "
                                         "got 'memet'.*Did you mean 'memit'"):
        sh.edit_fact(km, 0, 0, 1, method="memet")
    with pytest.raises(InputError, match="`layers` is for method 'memit' only"):
        sh.edit_fact(km, 0, 0, 1, method="rome", layers=[0])
    with pytest.raises(InputError, match=r"`distance` must be an int in \[1, 15\]; got 16"):
        sh.edit_fact(km, 0, 0, 16)
    with pytest.raises(InputError, match=r"`layer` must be an int in \[0, 1\]; got 2"):
        sh.edit_fact(km, 0, 0, 1, layer=2)
    with pytest.raises(InputError, match="`position` must be one of 'last', 'subject'; got 'first'"):
        sh.rome_edit(km, 0, 0, 1, position="first")


# -- shattering ratio -----------------------------------------------------------------

def test_shattering_ratio_hand_worked_and_invariances():
    d0 = np.array([[0.0, 1.0], [1.0, 0.0]])
    assert sh.shattering_ratio(d0, 2 * d0) == pytest.approx(1.0)        # ||D0|| / ||D0||
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 4))
    y = x + 0.3 * rng.normal(size=(10, 4))
    d_x, d_y = sh.distance_matrix(x), sh.distance_matrix(y)
    assert sh.shattering_ratio(d_x, d_x) == 0.0
    # distances equal a direct computation
    assert d_x[2, 7] == pytest.approx(np.linalg.norm(x[2] - x[7]))
    R = sh.shattering_ratio(d_x, d_y)
    assert R > 0
    for c in (0.1, 7.0):
        assert sh.shattering_ratio(sh.distance_matrix(c * x), sh.distance_matrix(c * y)) == pytest.approx(R)
    with pytest.raises(InputError, match="all zero"):
        sh.shattering_ratio(np.zeros((2, 2)), d0)
    with pytest.raises(InputError, match="of one shape"):
        sh.shattering_ratio(d0, d_x)


def test_edit_embedding_is_unchanged_at_strength_zero(km, cov):
    edit = sh.edit_fact(km, 2, 2, 1, method="rome", cov=cov)
    emb = sh.edit_embedding(km, edit, [0.0, 0.5, 1.0])
    assert emb["R"].values[0] == 0.0
    assert emb["R"].values[2] > 0
    reps = sh.entity_representations(sh.edited_model(km, edit), 16).double().numpy()
    base = sh.entity_representations(km.model, 16).double().numpy()
    R = np.linalg.norm(sh.distance_matrix(reps) - sh.distance_matrix(base)) / np.linalg.norm(
        sh.distance_matrix(base))
    assert emb["R"].values[2] == pytest.approx(R)


def test_edit_sweep_fits_drop_on_r(km):
    sweep = sh.edit_sweep(km, n_edits=4, distances=[1, 2], method="finetune")
    assert sweep.sizes["edit"] == 4
    assert sweep["distance"].values.tolist() == [1, 2, 1, 2]
    R = sweep["R"].values
    drop = sweep["accuracy_drop"].sel(split="all").values
    slope, intercept = np.polyfit(R, drop, 1)
    assert sweep.attrs["slope"] == pytest.approx(slope)
    pred = slope * R + intercept
    r2 = 1 - ((drop - pred) ** 2).sum() / ((drop - drop.mean()) ** 2).sum()
    assert sweep.attrs["r2"] == pytest.approx(r2)
    assert sweep.attrs["R_by_distance"]["1"] == pytest.approx(R[[0, 2]].mean())


# -- command line ---------------------------------------------------------------------

def test_cli_edit_json(tmp_path, monkeypatch, capsys):
    from explorer.cli import main

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    args = ["shattering", "edit", "--steps", "20", "--n-entities", "16", "--n-orders", "1",
            "--d-model", "32", "--d-mlp", "64", "--batch-size", "32", "--relation", "A-2",
            "--entity", "4", "--distance", "3", "--json"]
    with torch.enable_grad():
        assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["entity"] == "e4" and out["relation"] == "A-2" and out["distance"] == 3
    assert out["R"] > 0
    assert list((tmp_path / "shattering").glob("*.safetensors"))
    assert main(["shattering", "edit", "--steps", "20", "--n-entities", "16", "--n-orders", "1",
                 "--d-model", "32", "--d-mlp", "64", "--batch-size", "32", "--relation", "Z+9",
                 "--json"]) != 0
    assert "`relation` must be one of" in capsys.readouterr().err
    assert main(["shattering", "edit", "--steps", "20", "--n-entities", "16", "--n-orders", "1",
                 "--d-model", "32", "--d-mlp", "64", "--batch-size", "32", "--relation", "A-2",
                 "--entity", "4", "--distance", "3", "--method", "memit", "--layer", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "memit" and out["layers"] == [0, 1] and out["R"] > 0


# -- view (headless) ------------------------------------------------------------------

@pytest.mark.slow
def test_view_follows_the_strength_slider(km):
    import holoviews as hv

    from apps.shattering import ShatteringView, scatter_caption

    sweep = sh.edit_sweep(km, n_edits=4, distances=[1, 2], method="finetune")
    view = ShatteringView(km=km, sweep=sweep, method="finetune", entity="e3", relation="A+1",
                          distance=2, background=False)
    assert view.edit.entity == 3 and view.edit.distance == 2
    assert "strength 1.00" in view.summary()
    R1 = float(view.embedding()["R"].values[-1])
    assert R1 > 0
    view.strength = 0.0
    assert float(view.embedding()["R"].values[-1]) == 0.0
    assert "R = 0.000" in view.summary()
    view.order = 1
    assert isinstance(view._embedding_plot(), hv.Overlay)
    assert f"r² = {sweep.attrs['r2']:.2f}" in scatter_caption(sweep)
    assert "4 finetune edits" in scatter_caption(sweep)
    view.param.update(method="memit", layer=1, strength=1.0)
    assert view.edit.method == "memit" and view.edit.info["layers"] == [0, 1]
    assert "memit at blocks 0, 1" in view.summary()
    view.close()


def _block_outputs(model, tokens):
    """Residual stream after the last block, read with a plain forward hook."""
    seen = {}
    handle = model.blocks[-1].register_forward_hook(lambda mod, inp, out: seen.update(out=out.detach()))
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        handle.remove()
    return seen["out"]


def _points(overlay, vdim):
    """The coloured entity points of `plot_embedding` (the Points layer with ``vdim``)."""
    import holoviews as hv

    (pts,) = [el for el in overlay if isinstance(el, hv.Points) and vdim in [d.name for d in el.vdims]]
    return pts


def test_view_draws_the_chosen_components_of_an_independent_pca(km):
    import holoviews as hv

    from apps.shattering import ShatteringView

    sweep = sh.edit_sweep(km, n_edits=2, distances=[1], method="finetune")
    view = ShatteringView(km=km, sweep=sweep, method="finetune", entity="e5", relation="B-1",
                          distance=3, strength=0.7, background=False)
    n = km.graph.n_entities
    tokens = torch.arange(n)[:, None]
    base = _block_outputs(km.model, tokens)[:, 0].double().numpy()
    edited = _block_outputs(sh.edited_model(km, view.edit, 0.7), tokens)[:, 0].double().numpy()
    # PCA by numpy's SVD of the centred unedited representations
    mean = base.mean(0)
    _, s, vt = np.linalg.svd(base - mean, full_matrices=False)
    for axes, (i, j) in {"1-3": (0, 2), "2-3": (1, 2), "1-2": (0, 1)}.items():
        view.axes = axes
        pts = _points(view._embedding_plot(), "place")
        x, y = (pts.dimension_values(k) for k in (0, 1))
        assert [d.name for d in pts.kdims] == [f"PC{i + 1}", f"PC{j + 1}"]
        for got, c in ((x, i), (y, j)):
            want = (edited - mean) @ vt[c]
            sign = np.sign(want @ got)          # a principal axis is defined up to its sign
            np.testing.assert_allclose(got, sign * want, atol=1e-9)
        # labels carry numpy's explained variance
        title = view._embedding_plot().opts.get().kwargs["xlabel"]
        assert f"{s[i] ** 2 / (s ** 2).sum():.0%} of variance" in title
    # the unedited ring (grey points) is the same projection of the unedited model
    view.axes = "1-3"
    (ghost,) = [el for el in view._embedding_plot() if isinstance(el, hv.Points) and not el.vdims]
    np.testing.assert_allclose(np.abs(ghost.dimension_values(1)), np.abs((base - mean) @ vt[2]), atol=1e-9)
    # Isomap: the plot's components are Isomap's, and strength 0 places the entities where
    # a fresh Isomap of the unedited representations does.
    from sklearn.manifold import Isomap

    view.param.update(projection="isomap", strength=0.0, axes="1-2")
    pts = _points(view._embedding_plot(), "place")
    assert [d.name for d in pts.kdims] == ["Isomap1", "Isomap2"]
    ref = Isomap(n_neighbors=8, n_components=3).fit(base).transform(base)
    for k in (0, 1):
        got = pts.dimension_values(k)
        np.testing.assert_allclose(got, np.sign(ref[:, k] @ got) * ref[:, k], atol=1e-6)
    with pytest.raises(InputError, match="`projection` must be one of"):
        sh.edit_embedding(km, view.edit, [0.0], projection="tsne")
    view.close()


def test_widgets_built_before_the_model_arrives_get_its_options(km):
    """As in the gallery: the page's widgets exist while its model loads in a worker; once it
    arrives, the Entity and Relation selects offer the graph's names and show the first."""
    import threading

    import panel as pn

    from apps.shattering import ShatteringView

    arrive = threading.Event()
    sweep = sh.edit_sweep(km, n_edits=2, distances=[1], method="finetune")

    class Loading(ShatteringView):
        def _load(self, token):
            assert arrive.wait(60)
            return km

        def _request_sweep(self):
            self._swept(sweep)

    view = Loading(method="finetune", background=True)
    selects = {w.name: w for w in view.controls().select(pn.widgets.Select)}
    try:
        assert len(selects["Entity (subject)"].options) == 0 and view.km is None
    finally:
        arrive.set()
    view.wait()
    view.wait()                               # the edit job the model's arrival started
    assert list(selects["Entity (subject)"].options) == km.graph.entity_names
    assert list(selects["Relation"].options) == km.graph.relation_names
    assert selects["Entity (subject)"].value == "e0" and selects["Relation"].value == km.graph.relation_names[0]
    cycles = range(km.graph.orders.shape[0])
    assert list(selects["Cycle drawn"].options) == [f"cycle {'ABCDEFGH'[o]}" for o in cycles]
    (layer,) = [w for w in view.controls().select(pn.widgets.IntSlider) if w.name == "Edited block (MLP)"]
    assert layer.end == km.n_layers - 1
    assert view.edit is not None and view.edit.entity == 0 and view.edit.relation == 0
    view.close()


def test_every_control_has_a_label_and_a_tooltip(km):
    import panel as pn

    from apps.shattering import ShatteringView

    sweep = sh.edit_sweep(km, n_edits=2, distances=[1], method="finetune")
    view = ShatteringView(km=km, sweep=sweep, method="finetune", background=False)
    panel = view.controls()
    widgets = list(panel.select(pn.widgets.Widget))
    tips = [t.value for t in panel.select(pn.widgets.TooltipIcon)]
    shown = [w.name for w in widgets] + [str(h.object) for h in panel.select(pn.pane.HTML)]
    for name in ("method", "entity", "relation", "distance", "strength", "order", "projection", "axes",
                 "layer", "retrain"):
        p = view.param[name]
        assert p.doc, name
        assert p.doc in tips or any(getattr(w, "description", None) == p.doc for w in widgets), name
        assert any(p.label in text for text in shown), name
    view.close()


# -- the shipped model and sweep (datasets/shattering/) -------------------------------------------

def test_shipped_model_starts_as_a_fresh_default_run_does():
    """Retraining the default settings for 50 steps gives the shipped run's first losses."""
    from apps.shattering import SHIPPED_MODEL

    shipped = sh.load_knowledge_model(SHIPPED_MODEL)
    assert shipped.params == sh.DEFAULTS
    assert shipped.history["step"][-1] == sh.DEFAULTS["steps"]
    fresh = sh.train_knowledge_model(progress=lambda done, total: done < 50, **sh.DEFAULTS)
    assert fresh.history["step"] == shipped.history["step"][:5]
    np.testing.assert_allclose(fresh.history["loss"], shipped.history["loss"][:5], rtol=2e-3)


@pytest.mark.slow
def test_shipped_sweep_matches_two_edits_recomputed():
    """The shipped sweep belongs to the shipped weights, and two of its edits recomputed with
    ROME and R from the distance matrices give its numbers."""
    from apps.shattering import SHIPPED_MODEL, SWEEP_EDITS, load_shipped_sweep

    km = sh.load_knowledge_model(SHIPPED_MODEL)
    sweep = load_shipped_sweep(km)
    assert sweep is not None and sweep.sizes["edit"] == SWEEP_EDITS
    assert sweep.attrs["params"]["edit_method"] == "rome"
    cov = sh.key_covariance(km, 0)
    n = km.graph.n_entities
    d0 = sh.distance_matrix(sh.entity_representations(km.model, n))
    for i in (0, 1):
        e, r, d = (int(sweep[v].values[i]) for v in ("entity", "relation", "distance"))
        edit = sh.edit_fact(km, e, r, d, method="rome", layer=0, cov=cov)
        assert edit.new_object == int(sweep["new_object"].values[i])
        model = sh.edited_model(km, edit)
        R = sh.shattering_ratio(d0, sh.distance_matrix(sh.entity_representations(model, n)))
        np.testing.assert_allclose(R, float(sweep["R"].values[i]), rtol=1e-3)
    # a different model's weights do not read it
    other = sh.train_knowledge_model(**TINY)
    assert load_shipped_sweep(other) is None


def test_page_opens_on_the_shipped_result_without_training(tmp_path, monkeypatch):
    import time

    from apps.shattering import SHIPPED_MODEL, ShatteringView, load_shipped_sweep

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))      # nothing stored
    from explorer.analyses.shattering import storage

    import apps.shattering

    monkeypatch.setattr(storage, "train_knowledge_model", None)  # training would fail
    monkeypatch.setattr(apps.shattering, "stored_edit_sweep", None)  # and so would a sweep
    started = time.perf_counter()
    view = ShatteringView(background=False)
    seconds = time.perf_counter() - started
    shipped = sh.load_knowledge_model(SHIPPED_MODEL)
    assert view.km.weights_sha256() == shipped.weights_sha256()
    np.testing.assert_array_equal(view.sweep["R"].values, load_shipped_sweep(shipped)["R"].values)
    assert view.edit is not None and view.edit.method == "rome"
    assert not list(tmp_path.rglob("*.safetensors"))           # nothing trained or written
    print(f"shattering page opened in {seconds:.1f} s")
    view.close()


def test_retrain_reports_progress_with_the_time_left_and_shows_the_new_model(km, monkeypatch):
    import apps.shattering as page

    sweep = sh.edit_sweep(km, n_edits=2, distances=[1], method="finetune")
    view = page.ShatteringView(km=km, sweep=sweep, method="finetune", background=False)
    retrained = sh.train_knowledge_model(**{**TINY, "steps": 20})
    seen = []

    def fake_knowledge_model(*, retrain=False, progress=None, **params):
        assert retrain and params == sh.DEFAULTS
        for done in (10, 20, 30):
            progress(done, 40)
            seen.append((view.progress, view.progress_active, view.status))
        return retrained

    monkeypatch.setattr(page, "knowledge_model", fake_knowledge_model)
    monkeypatch.setattr(page, "stored_edit_sweep", lambda km_, **kw: sweep)
    view.retrain = True
    assert [p for p, _, _ in seen] == [25, 50, 75] and all(active for _, active, _ in seen)
    # the first report: 10 of 40 steps done, so three times as long again is left
    assert "step 10/40" in seen[0][2] and "left" in seen[0][2]
    assert view.km is retrained and not view.progress_active and not view.running
    assert view.edit is not None and view.status.startswith("Model: 16 entities")
    view.close()
