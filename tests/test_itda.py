"""Tests for explorer.analyses.itda: matching pursuit, dictionary building, measures, SAE.

References: brute-force least squares over every atom subset, orthogonal projections,
hand-worked two-dimensional dictionaries, numpy formulas for error and FVE, and a plain
torch forward hook for the zero-ablated and reconstructed losses.
"""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses.itda import (
    ITDA,
    SparseAutoencoder,
    cached_activations,
    itda_atom_examples,
    itda_downstream_loss,
    itda_reconstruction,
    itda_tau_sweep,
    itda_vs_sae,
    matching_pursuit,
)
from explorer.store import ActivationStore
from explorer.trace import trace

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "One two three four five six seven eight nine ten.",
    "Water boils at one hundred degrees at sea level.",
    "In 1905 the physicist wrote four papers that changed how people think.",
    "She said that he would come back tomorrow.",
    "The capital of France is Paris; the capital of Italy is Rome.",
]


def unit_rows(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=1, keepdims=True)


def best_subset_error(x: np.ndarray, atoms: np.ndarray, k: int) -> float:
    """Brute force: the least-squares error of the best k-atom subset."""
    best = np.inf
    for subset in itertools.combinations(range(len(atoms)), k):
        a = atoms[list(subset)].T                              # [d, k]
        coef, *_ = np.linalg.lstsq(a, x, rcond=None)
        best = min(best, float(((x - a @ coef) ** 2).sum()))
    return best


def code_to_dense(idx: np.ndarray, coef: np.ndarray, m: int) -> np.ndarray:
    out = np.zeros(m)
    for j, c in zip(idx, coef):
        if j >= 0:
            out[j] += c
    return out


# -- matching pursuit against brute force --------------------------------------------------------

@pytest.mark.parametrize("method", ["mp", "omp"])
def test_pursuit_on_an_orthonormal_dictionary_finds_the_best_subset(method):
    rng = np.random.default_rng(1)
    atoms, _ = np.linalg.qr(rng.normal(size=(6, 6)))          # orthonormal rows
    atoms = atoms.T.copy()
    x = rng.normal(size=(5, 6))
    idx, coef = matching_pursuit(torch.tensor(x), torch.tensor(atoms), 3, method=method)
    for i in range(5):
        dense = code_to_dense(idx[i].numpy(), coef[i].numpy(), 6)
        err = float(((x[i] - dense @ atoms) ** 2).sum())
        assert err == pytest.approx(best_subset_error(x[i], atoms, 3), abs=1e-9)
        # the coefficients are the projections on the three largest |<x, d>|
        proj = atoms @ x[i]
        top = np.argsort(-np.abs(proj))[:3]
        np.testing.assert_allclose(dense[top], proj[top], atol=1e-10)


@pytest.mark.parametrize("method", ["mp", "omp"])
def test_one_step_picks_the_best_single_atom(method):
    rng = np.random.default_rng(2)
    atoms = unit_rows(rng.normal(size=(9, 5)))
    x = rng.normal(size=(20, 5))
    idx, coef = matching_pursuit(torch.tensor(x), torch.tensor(atoms), 1, method=method)
    for i in range(20):
        a = atoms[idx[i, 0]]
        err = float(((x[i] - coef[i, 0].item() * a) ** 2).sum())
        assert err == pytest.approx(best_subset_error(x[i], atoms, 1), abs=1e-9)


def test_omp_coefficients_are_least_squares_on_the_chosen_atoms():
    rng = np.random.default_rng(3)
    atoms = unit_rows(rng.normal(size=(8, 6)))
    x = rng.normal(size=(10, 6))
    idx, coef = matching_pursuit(torch.tensor(x), torch.tensor(atoms), 3, method="omp")
    for i in range(10):
        chosen = idx[i].numpy()
        assert len(set(chosen.tolist())) == 3                   # OMP never re-picks
        a = atoms[chosen].T
        ls, *_ = np.linalg.lstsq(a, x[i], rcond=None)
        np.testing.assert_allclose(coef[i].numpy(), ls, atol=1e-9)
        # and it is never better than the brute-force optimum
        err = float(((x[i] - a @ ls) ** 2).sum())
        assert err >= best_subset_error(x[i], atoms, 3) - 1e-9


def test_mp_converges_to_the_orthogonal_projection_on_the_atoms_span():
    rng = np.random.default_rng(4)
    atoms = unit_rows(rng.normal(size=(3, 6)))                 # span is 3-d in 6-d
    x = rng.normal(size=(4, 6))
    idx, coef = matching_pursuit(torch.tensor(x), torch.tensor(atoms), 400, method="mp")
    xhat = np.stack([code_to_dense(idx[i].numpy(), coef[i].numpy(), 3) @ atoms for i in range(4)])
    a = atoms.T
    proj = a @ np.linalg.lstsq(a, x.T, rcond=None)[0]
    np.testing.assert_allclose(xhat, proj.T, atol=1e-8)


# -- building the dictionary -------------------------------------------------------------------

def test_hand_worked_two_dimensional_dictionary():
    e1, e2 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    diag = np.array([3.0, 3.0])                                # error with e1 or e2 alone: 0.5
    x = np.stack([e1, 2 * e1, e2, diag]).astype(np.float32)
    one_step = ITDA(tau=0.1, l0=1, batch_size=1).fit(x)
    assert one_step.n_atoms == 3                                # 2*e1 is e1; diag needs a 2nd atom
    np.testing.assert_allclose(one_step.atoms_[2], diag / np.linalg.norm(diag), atol=1e-6)
    np.testing.assert_array_equal(one_step.atom_pos_, [0, 2, 3])
    two_steps = ITDA(tau=0.1, l0=2, batch_size=1).fit(x)
    assert two_steps.n_atoms == 2                               # e1 + e2 rebuild diag exactly
    loose = ITDA(tau=0.6, l0=1, batch_size=1).fit(x)
    assert loose.n_atoms == 2                                    # error 0.5 <= 0.6: diag not added
    # the batch re-check gives the same dictionary when all four arrive together
    batched = ITDA(tau=0.1, l0=1, batch_size=4).fit(x)
    np.testing.assert_allclose(batched.atoms_, one_step.atoms_)


def test_a_dictionary_reconstructs_its_own_atoms_exactly(tiny_model):
    ds = trace(tiny_model, PROMPTS)
    itda = ITDA(tau=0.3, l0=4).fit(ds, layer=1)
    assert itda.n_atoms > 5
    scales = np.linspace(0.5, 4.0, itda.n_atoms)[:, None].astype(np.float32)
    x = itda.atoms_ * scales
    idx, coef = itda.encode(x)
    np.testing.assert_array_equal(idx[:, 0], np.arange(itda.n_atoms))   # itself, first step
    assert (idx[:, 1:] == -1).all()                                      # and nothing more
    np.testing.assert_allclose(itda.reconstruct(x), x, atol=1e-5)


def test_atoms_are_the_normalised_activations_of_their_labelled_tokens(tiny_model):
    ds = trace(tiny_model, PROMPTS)
    itda = ITDA(tau=0.2, l0=3).fit(ds, layer=2)
    x = ds["resid_post"].sel(layer=2).values
    for a in range(itda.n_atoms):
        p, q = itda.atom_prompt_[a], itda.atom_pos_[a]
        v = x[p, q]
        np.testing.assert_allclose(itda.atoms_[a], v / np.linalg.norm(v), atol=1e-6)
        assert itda.atom_token_[a] == str(ds["token"].values[p, q])
        assert itda.atom_token_id_[a] == int(ds["token_id"].values[p, q])
    assert itda.n_tokens_seen_ == int(ds["mask"].sum())


def test_every_token_is_within_tau_or_an_atom_when_built_one_by_one(tiny_model):
    ds = trace(tiny_model, PROMPTS)
    mask = ds["mask"].values
    x = ds["resid_post"].sel(layer=1).values[mask]
    tau = 0.25
    itda = ITDA(tau=tau, l0=4, batch_size=1).fit(ds, layer=1)
    # replay: each token, against the atoms added before it, either was within tau or became one
    added = {(int(p), int(q)) for p, q in zip(itda.atom_prompt_, itda.atom_pos_)}
    prompt_idx, pos_idx = np.nonzero(mask)
    order = {lab: i for i, lab in enumerate(zip(itda.atom_prompt_.tolist(), itda.atom_pos_.tolist()))}
    atoms = torch.tensor(itda.atoms_)
    n_before = 0
    for row, (p, q) in enumerate(zip(prompt_idx, pos_idx)):
        xi = torch.tensor(x[row: row + 1])
        i, c = matching_pursuit(xi, atoms[:n_before], 4)
        xhat = (c[0, i[0] >= 0, None] * atoms[:n_before][i[0][i[0] >= 0]]).sum(0)
        err = float(((xi[0] - xhat) ** 2).sum() / (xi ** 2).sum())
        if (int(p), int(q)) in added:
            assert err > tau and order[(int(p), int(q))] == n_before
            n_before += 1
        else:
            assert err <= tau


@pytest.mark.parametrize("method", ["mp", "omp"])
def test_every_atom_was_beyond_tau_for_the_atoms_before_it(tiny_model, method):
    # batched build: the in-batch re-check (and its same-path shortcut) must keep this invariant
    ds = trace(tiny_model, PROMPTS)
    tau = 0.15
    itda = ITDA(tau=tau, l0=3, method=method, batch_size=32).fit(ds, layer=2)
    atoms = torch.tensor(itda.atoms_)
    assert itda.n_atoms > 40
    for k in range(1, itda.n_atoms):
        i, c = matching_pursuit(atoms[k: k + 1], atoms[:k], 3, method=method)
        xhat = sum(float(c[0, t]) * atoms[i[0, t]] for t in range(3) if i[0, t] >= 0)
        assert float(((atoms[k] - xhat) ** 2).sum()) > tau, k


def test_streaming_over_store_chunks_matches_the_in_memory_build(tiny_model, tmp_path):
    store = ActivationStore(tmp_path)
    lazy = cached_activations(tiny_model, PROMPTS, layers=[1], store=store)
    assert lazy["resid_post"].chunks is not None                  # dask-backed, from the store
    chunked = lazy.chunk({"prompt": 2})                            # three chunks streamed
    seen = []
    streamed = ITDA(tau=0.3, l0=4, batch_size=1,
                    progress=lambda n, m: seen.append(n)).fit(chunked, layer=1)
    mem = trace(tiny_model, PROMPTS, layers=[1])
    x = mem["resid_post"].sel(layer=1).values[mem["mask"].values]
    direct = ITDA(tau=0.3, l0=4, batch_size=1).fit(x)
    np.testing.assert_allclose(streamed.atoms_, direct.atoms_, atol=1e-6)
    assert seen[-1] == x.shape[0]
    # a second call reads the stored entry instead of tracing again
    again = cached_activations(tiny_model, PROMPTS, layers=[1], store=store)
    assert len(store.ls()) == 1 and again["resid_post"].chunks is not None


def test_build_over_the_store_on_a_local_cluster_matches_in_memory(tiny_model, tmp_path):
    from distributed import get_task_stream

    from explorer.distributed import dask_scheduler

    store = ActivationStore(tmp_path)
    cached_activations(tiny_model, PROMPTS, layers=[1], store=store)
    lazy = cached_activations(tiny_model, PROMPTS, layers=[1], store=store).chunk({"prompt": 2})
    with dask_scheduler("local", n_workers=1, processes=False) as client:
        with get_task_stream(client) as tasks:
            on_cluster = ITDA(tau=0.3, l0=4, batch_size=8).fit(lazy, layer=1, min_pos=1)
            rec = itda_reconstruction(on_cluster, lazy, layer=1, min_pos=1)
    assert len(tasks.data) > 0                                      # the reads ran on the cluster
    mem = trace(tiny_model, PROMPTS, layers=[1])
    direct = ITDA(tau=0.3, l0=4, batch_size=8).fit(mem, layer=1, min_pos=1)
    np.testing.assert_allclose(on_cluster.atoms_, direct.atoms_, atol=1e-6)
    np.testing.assert_array_equal(on_cluster.atom_prompt_, direct.atom_prompt_)
    ref = itda_reconstruction(direct, mem, layer=1, min_pos=1)
    assert float(rec["fve"]) == pytest.approx(float(ref["fve"]), abs=1e-6)


def test_chunked_store_entries_stream_as_one(tiny_model, tmp_path):
    store = ActivationStore(tmp_path)
    parts = cached_activations(tiny_model, PROMPTS, layers=[1], store=store, chunk_prompts=4)
    assert len(parts) == 2 and len(store.ls()) == 2
    assert parts[1]["prompt"].values.tolist() == [4, 5]                 # global prompt ids
    chunked = ITDA(tau=0.3, l0=4, batch_size=1).fit(parts, layer=1)
    whole = ITDA(tau=0.3, l0=4, batch_size=1).fit(trace(tiny_model, PROMPTS, layers=[1]), layer=1)
    np.testing.assert_allclose(chunked.atoms_, whole.atoms_, atol=1e-6)
    np.testing.assert_array_equal(chunked.atom_prompt_, whole.atom_prompt_)
    rec = itda_reconstruction(chunked, parts, layer=1)
    assert rec.sizes["token"] == chunked.n_tokens_seen_


def test_lower_tau_gives_more_atoms_and_less_error(tiny_model):
    ds = trace(tiny_model, PROMPTS)
    sweep = itda_tau_sweep(ds, taus=(0.05, 0.2, 0.5), l0=4, layer=1)
    n = sweep["n_atoms"].values
    err = sweep["mean_error"].values
    assert n[0] > n[1] > n[2]
    assert err[0] < err[1] < err[2]
    assert (sweep["mean_l0"].values <= 4).all()


def test_reconstruction_measures_match_numpy_formulas(tiny_model):
    ds = trace(tiny_model, PROMPTS)
    itda = ITDA(tau=0.4, l0=3).fit(ds, layer=2)
    rec = itda_reconstruction(itda, ds, layer=2)
    x = ds["resid_post"].sel(layer=2).values[ds["mask"].values].astype(np.float64)
    xhat = itda.reconstruct(x.astype(np.float32)).astype(np.float64)
    rel = ((x - xhat) ** 2).sum(1) / (x ** 2).sum(1)
    np.testing.assert_allclose(rec["error"].values, rel, rtol=1e-4, atol=1e-6)
    fve = 1 - ((x - xhat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    assert float(rec["fve"]) == pytest.approx(fve, abs=1e-4)
    dense = itda.dense_codes(x.astype(np.float32))
    np.testing.assert_array_equal(rec["l0"].values, (np.abs(dense) > 1e-6 * np.linalg.norm(x, axis=1, keepdims=True)).sum(1))


def test_to_dataset_round_trip_through_the_store(tiny_model, tmp_path):
    ds = trace(tiny_model, PROMPTS)
    itda = ITDA(tau=0.3, l0=4).fit(ds, layer=0)
    store = ActivationStore(tmp_path)
    store.put("dictionary", itda.to_dataset())
    back = ITDA.from_dataset(store.get("dictionary").load())
    np.testing.assert_allclose(back.atoms_, itda.atoms_)
    np.testing.assert_array_equal(back.atom_token_, itda.atom_token_)
    x = ds["resid_post"].sel(layer=0).values[ds["mask"].values]
    np.testing.assert_allclose(back.reconstruct(x), itda.reconstruct(x), atol=1e-6)


def test_atom_examples_rank_the_largest_coefficients(tiny_model):
    ds = trace(tiny_model, PROMPTS)
    itda = ITDA(tau=0.3, l0=4).fit(ds, layer=1)
    ex = itda_atom_examples(itda, ds, k=3, atoms=[0, 1], layer=1)
    x = ds["resid_post"].sel(layer=1).values
    mask = ds["mask"].values
    dense = itda.dense_codes(x[mask])
    prompt_idx, pos_idx = np.nonzero(mask)
    for a in (0, 1):
        col = dense[:, a]
        order = np.argsort(-col, kind="stable")[:3]
        order = order[col[order] != 0]
        got = ex["coefficient"].sel(atom=a).values
        np.testing.assert_allclose(got[: len(order)], col[order], rtol=1e-5)
        np.testing.assert_array_equal(ex["prompt"].sel(atom=a).values[: len(order)], prompt_idx[order])
        assert int(ex["n_uses"].sel(atom=a)) == int((col != 0).sum())
        assert ex["source_token"].sel(atom=a).item() == itda.atom_token_[a]


# -- downstream loss --------------------------------------------------------------------------

def hook_losses(model, prompt: str, layer: int, replace) -> float:
    """Next-token loss with a plain torch forward hook replacing the layer's output."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])

    def hook(mod, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        new = torch.as_tensor(replace(hidden[0].detach().numpy()), dtype=hidden.dtype)[None]
        return (new, *out[1:]) if isinstance(out, tuple) else new

    handle = model.hf_layer(layer).register_forward_hook(hook)
    try:
        logits = model.hf(input_ids=ids).logits[0]
    finally:
        handle.remove()
    return float(torch.nn.functional.cross_entropy(logits[:-1].double(), ids[0, 1:]))


def test_downstream_loss_matches_a_torch_hook(tiny_model):
    ds = trace(tiny_model, PROMPTS, layers=[1])
    itda = ITDA(tau=0.4, l0=2).fit(ds, layer=1)
    out = itda_downstream_loss(tiny_model, PROMPTS[:2], itda, layer=1)
    for i, prompt in enumerate(PROMPTS[:2]):
        zero = hook_losses(tiny_model, prompt, 1, lambda h: np.zeros_like(h))
        recon = hook_losses(tiny_model, prompt, 1, itda.reconstruct)
        clean = hook_losses(tiny_model, prompt, 1, lambda h: h)
        assert float(out["loss_zero"][i]) == pytest.approx(zero, abs=1e-4)
        assert float(out["loss_reconstructed"][i]) == pytest.approx(recon, abs=1e-4)
        assert float(out["loss_clean"][i]) == pytest.approx(clean, abs=1e-4)
    h = out[["loss_clean", "loss_reconstructed", "loss_zero"]].mean()
    expected = (h["loss_reconstructed"] - h["loss_zero"]) / (h["loss_clean"] - h["loss_zero"])
    assert float(out["ce_loss_score"]) == pytest.approx(float(expected))
    assert out.attrs["method"] == "itda_downstream_loss"


def test_an_exact_dictionary_scores_one(tiny_model):
    ds = trace(tiny_model, PROMPTS[:2], layers=[2])
    exact = ITDA(tau=0.0, l0=1).fit(ds, layer=2)               # every token is an atom
    out = itda_downstream_loss(tiny_model, PROMPTS[:2], exact, layer=2)
    np.testing.assert_allclose(out["loss_reconstructed"], out["loss_clean"], atol=1e-4)
    assert float(out["ce_loss_score"]) == pytest.approx(1.0, abs=1e-3)


# -- the SAE baseline --------------------------------------------------------------------------

def test_sae_trains_to_a_target_error_and_the_comparison_reports_the_ratio():
    rng = np.random.default_rng(0)
    # low-rank data an SAE and a dictionary can both fit
    basis = rng.normal(size=(6, 24))
    x = (np.abs(rng.normal(size=(600, 6))) @ basis).astype(np.float32)
    sae = SparseAutoencoder(32, k=4, lr=1e-2, max_epochs=300, target_error=0.05, seed=0).fit(x)
    assert sae.reached_target_ and sae.error_ <= 0.05
    rel = (((x - sae.reconstruct(x)) ** 2).sum(1) / (x ** 2).sum(1)).mean()
    assert rel < 0.1
    assert sae.history_[0] > sae.history_[-1]
    cmp_ = itda_vs_sae(x, tau=0.1, l0=4, lr=1e-2, max_epochs=300)
    secs = cmp_["fit_seconds"].values
    assert float(cmp_["time_ratio"]) == pytest.approx(secs[0] / secs[1])
    assert int(cmp_["size"].sel(model_kind="sae")) == int(cmp_["size"].sel(model_kind="itda"))


def test_itda_vs_sae_times_are_the_time_each_fit_took(monkeypatch):
    """Slow each fit's inner step by a known amount: each reported time includes it, so the
    ratio follows the work done, not a figure computed on its own."""
    import time

    from explorer.analyses.itda import ITDA

    rng = np.random.default_rng(0)
    x = (np.abs(rng.normal(size=(300, 6))) @ rng.normal(size=(6, 24))).astype(np.float32)
    added = {"itda": 0.0, "sae": 0.0}
    fitting = []

    def slowed(kind, method, pause):
        def run(self, *args):
            if fitting:                              # only inside a fit (not reconstruct)
                time.sleep(pause)
                added[kind] += pause
            return method(self, *args)
        return run

    def flagged(method):
        def run(self, *args, **kwargs):
            fitting.append(True)
            try:
                return method(self, *args, **kwargs)
            finally:
                fitting.pop()
        return run

    monkeypatch.setattr(ITDA, "_add_batch", slowed("itda", ITDA._add_batch, 0.05))
    monkeypatch.setattr(SparseAutoencoder, "_forward",
                        slowed("sae", SparseAutoencoder._forward, 0.002))
    monkeypatch.setattr(ITDA, "fit", flagged(ITDA.fit))
    monkeypatch.setattr(SparseAutoencoder, "fit", flagged(SparseAutoencoder.fit))
    cmp_ = itda_vs_sae(x, tau=0.1, l0=4, lr=1e-2, max_epochs=20)
    itda_s, sae_s = (float(v) for v in cmp_["fit_seconds"].values)
    assert added["itda"] > 0 and added["sae"] > 0
    assert itda_s >= added["itda"] and sae_s >= added["sae"]
    assert float(cmp_["time_ratio"]) == pytest.approx(itda_s / sae_s)


# -- errors and the command line --------------------------------------------------------------

def test_user_errors_name_the_bad_value(tiny_model):
    with pytest.raises(InputError, match=r"`tau` must be a number in \[0.0, 1.0\]; got 1.5"):
        ITDA(tau=1.5)
    with pytest.raises(InputError, match="`method` must be one of 'mp', 'omp'"):
        ITDA(method="lasso")
    with pytest.raises(InputError, match=r"`l0` must be an int in \[1, inf\]"):
        ITDA(l0=0)
    with pytest.raises(InputError, match="call fit"):
        ITDA().encode(np.ones((1, 4)))
    ds = trace(tiny_model, PROMPTS[:2])
    with pytest.raises(InputError, match="pass `layer`"):
        ITDA().fit(ds)
    with pytest.raises(InputError, match="traced layers"):
        ITDA().fit(ds, layer=7)
    with pytest.raises(TypeError, match="must be an xarray"):
        ITDA().fit([[1.0, 2.0]])
    itda = ITDA().fit(ds, layer=0)
    with pytest.raises(InputError, match="needs `layer` >= 1"):
        itda_downstream_loss(tiny_model, PROMPTS[:1], itda, layer=0, site="resid_pre")
    with pytest.raises(InputError, match="at least 2"):
        itda_downstream_loss(tiny_model, ["One"], itda, layer=0)


def test_cli_itda_json(tiny_model, tmp_path, monkeypatch, capsys):
    from explorer import cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", ("explorer.commands.itda",))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:3]))
    code = cli.main(["itda", "--model", "tiny-llama", "--prompts", str(prompts), "--layer", "1",
                     "--tau", "0.3", "--l0", "4", "--taus", "0.2,0.5", "--downstream",
                     "--cache", str(tmp_path / "cache"), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    ds = trace(tiny_model, PROMPTS[:3], layers=[1])
    ref = ITDA(tau=0.3, l0=4).fit(ds, layer=1, min_pos=1)              # the CLI's default --min-pos 1
    assert out["n_atoms"] == ref.n_atoms
    assert out["n_tokens"] == int(ds["mask"].sum()) - 3
    assert [row["tau"] for row in out["sweep"]] == [0.2, 0.5]
    assert 0 < out["downstream"]["ce_loss_score"] <= 1.0 + 1e-6
    # stored in entries of two prompts, streamed back through a dask scheduler: same build
    for _ in range(2):  # the second run reads the stored entries
        code = cli.main(["itda", "--model", "tiny-llama", "--prompts", str(prompts), "--layer", "1",
                         "--tau", "0.3", "--l0", "4", "--chunk-prompts", "2", "--scheduler",
                         "synchronous", "--cache", str(tmp_path / "cache2"), "--json"])
        assert code == 0
        assert json.loads(capsys.readouterr().out)["n_atoms"] == ref.n_atoms
    code = cli.main(["itda", "--model", "tiny-llama", "--prompts", str(prompts), "--layer", "1",
                     "--scheduler", "thread", "--cache", str(tmp_path / "cache"), "--json"])
    assert code == 2
    assert "`scheduler` must be one of" in capsys.readouterr().err
    code = cli.main(["itda", "--model", "tiny-llama", "--prompts", str(prompts), "--layer", "9",
                     "--cache", str(tmp_path / "cache"), "--json"])
    assert code == 2
    assert "`layer` must be an int in [0, 2]; got 9" in capsys.readouterr().err


# -- the view (headless) ---------------------------------------------------------------------

@pytest.mark.slow
def test_itda_view_follows_its_parameters(tiny_model):
    import holoviews as hv
    import panel as pn

    from apps.itda import ITDAView, plot_similarity, plot_tau_curves, probe_prompts, similarity_caption
    from explorer.analyses.similarity import layer_similarity

    view = ITDAView(tiny_model, background=False, layer=1, tau=0.3, l0=4)
    prompts = probe_prompts(view.probe_text)
    ds = trace(tiny_model, prompts)
    ref = ITDA(tau=0.3, l0=4).fit(ds, layer=1, min_pos=1)           # first tokens left out
    assert view.n_atoms == ref.n_atoms
    n_tokens = int(ds["mask"].sum()) - len(prompts)
    assert view.summary.startswith(f"{ref.n_atoms} atoms from {n_tokens} tokens")
    sweep = view.sweep
    view.tau = 0.1
    assert view.sweep is sweep                                   # the curve is cached per layer/l0
    assert view.n_atoms == ITDA(tau=0.1, l0=4).fit(ds, layer=1, min_pos=1).n_atoms
    curves = plot_tau_curves(view.sweep, view.tau)
    assert isinstance(curves, hv.Layout) and len(curves) == 3
    vline = [el for el in curves.values()[0] if isinstance(el, hv.VLine)][0]
    assert vline.data == 0.1
    view.atom = 2
    assert view.examples["atom"].values.tolist() == [2]
    view.method = "itda"
    assert view.similarity is None               # the comparison waits for its button
    assert view.cache_get("others", view.noise) is None          # and no perturbed copy is made
    view.compare = True
    expected = layer_similarity(ds, trace(view._other(view.noise), prompts), method="itda", tau=0.1, l0=4,
                                min_pos=1)
    np.testing.assert_allclose(view.similarity["similarity"].values, expected["similarity"].values)
    assert isinstance(plot_similarity(view.similarity), hv.Overlay)
    assert f"on the diagonal for {float(expected['matched'].values.mean()):.0%}" in similarity_caption(
        view.similarity)
    view.tau = 0.2                                               # ITDA-Jaccard follows the dictionary's tau
    expected = layer_similarity(ds, trace(view._other(view.noise), prompts), method="itda", tau=0.2, l0=4,
                                min_pos=1)
    np.testing.assert_allclose(view.similarity["similarity"].values, expected["similarity"].values)
    assert isinstance(view.__panel__(), pn.Row)
    # every control shows its label and has its doc as a tooltip
    panel = pn.Column(view.controls(), view.similarity_controls())
    widgets = list(panel.select(pn.widgets.Widget))
    tips = [t.value for t in panel.select(pn.widgets.TooltipIcon)]
    labels = [w.name for w in widgets] + [str(h.object) for h in panel.select(pn.pane.HTML)]
    for name in ("probe_text", "layer", "tau", "l0", "atom", "method", "noise", "compare"):
        p = view.param[name]
        assert p.doc and (p.doc in tips or any(getattr(w, "description", None) == p.doc for w in widgets)), name
        assert any(p.label in text for text in labels), name
    shown = view.similarity
    view.probe_text = "   "
    assert "probing set is empty" in view.error and view.similarity is shown   # last result kept


def test_min_pos_leaves_the_first_tokens_out(tiny_model):
    ds = trace(tiny_model, PROMPTS[:3])
    itda = ITDA(tau=0.0, l0=1).fit(ds, layer=1, min_pos=1)          # every kept token is an atom
    assert itda.n_tokens_seen_ == int(ds["mask"].sum()) - 3
    assert itda.atom_pos_.min() == 1 and itda.n_atoms == itda.n_tokens_seen_
    rec = itda_reconstruction(itda, ds, layer=1, min_pos=1)
    assert rec.sizes["token"] == itda.n_tokens_seen_ and float(rec["mean_error"]) < 1e-10
    # downstream: position 0 keeps its real value, the others get the (exact) reconstruction
    lossy = ITDA(tau=0.5, l0=1).fit(ds, layer=1, min_pos=1)
    out = itda_downstream_loss(tiny_model, PROMPTS[:1], lossy, layer=1, min_pos=1)

    def replace_from_1(h):
        r = lossy.reconstruct(h)
        r[0] = h[0]
        return r

    assert float(out["loss_reconstructed"][0]) == pytest.approx(
        hook_losses(tiny_model, PROMPTS[0], 1, replace_from_1), abs=1e-4)
    zero = float(out["loss_zero"][0])
    assert zero == pytest.approx(hook_losses(tiny_model, PROMPTS[0], 1,
                                             lambda h: np.vstack([h[:1], np.zeros_like(h[1:])])), abs=1e-4)


def test_bench_itda_reports_the_ratio_of_its_own_times(tiny_model):
    from explorer.benches.itda import bench_itda

    out = bench_itda(tiny_model, n_prompts=10, sae_seconds=1.0)
    fig = out["figures"]
    assert fig["itda_vs_sae_time_ratio"] == pytest.approx(fig["itda_build_ms"] / fig["sae_train_ms"])
    assert out["params"]["layer"] == 1 and out["params"]["n_atoms"] > 0
    assert set(out["accuracy"]) >= {"itda_heldout_error", "sae_heldout_error", "sae_reached_target"}


def test_bench_itda_is_registered_from_the_bench_layer():
    import importlib

    from explorer.bench import ANALYSIS_BENCHES
    from explorer.benches.itda import bench_itda

    module, attr = ANALYSIS_BENCHES["itda"]
    assert getattr(importlib.import_module(module), attr) is bench_itda
