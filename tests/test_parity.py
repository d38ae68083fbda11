"""Streaming parity (van Rossem & Saxe, ICML 2025): automaton minimisation, state merging,
a hand-built parity RNN, and the training run's layout, each against an independent
computation (brute-force word equivalence, a numpy forward pass, hand-worked cases)."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
import xarray as xr

from explorer._checks import InputError
from explorer.analyses import parity as par
from explorer.analyses.automata import Automaton, merge_states, minimise_automaton
from explorer.analyses.parity import runs as par_runs
from explorer.commands._common import torch_threads
from tests._cli import OneCommand
from tests._threads import record_threads


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- helpers: independent computations ------------------------------------------------


def _words(n_symbols: int, max_len: int):
    for length in range(max_len + 1):
        yield from itertools.product(range(n_symbols), repeat=length)


def _signature(automaton: Automaton, state: int, max_len: int) -> tuple:
    """Outputs (None where a transition is undefined) of every word up to max_len from state."""
    out = []
    for word in _words(automaton.n_symbols, max_len):
        q = state
        for a in word:
            q = int(automaton.transitions[q, a]) if q != -1 else -1
        out.append(None if q == -1 else automaton.outputs[q].item())
    return tuple(out)


def _brute_force_classes(automaton: Automaton) -> dict[int, int]:
    """Equivalence classes of reachable states by comparing outputs on every word of length
    < n (Moore: n-1 symbols distinguish any two inequivalent states of an n-state machine)."""
    n = automaton.n_states
    reach = {automaton.initial}
    frontier = [automaton.initial]
    while frontier:
        q = frontier.pop()
        for nxt in automaton.transitions[q]:
            if nxt != -1 and int(nxt) not in reach:
                reach.add(int(nxt))
                frontier.append(int(nxt))
    sigs = {q: _signature(automaton, q, n) for q in sorted(reach)}
    labels: dict[tuple, int] = {}
    return {q: labels.setdefault(s, len(labels)) for q, s in sigs.items()}


def _numpy_rnn_outputs(weights: dict[str, np.ndarray], strings: np.ndarray) -> np.ndarray:
    """Plain numpy forward pass of h_t = relu(W_ih x_t + W_hh h_{t-1} + b), y = W_out h + b."""
    h = np.tile(weights["h0"].astype(np.float64), (strings.shape[0], 1))
    for t in range(strings.shape[1]):
        x = np.eye(2)[strings[:, t]]
        h = np.maximum(x @ weights["W_ih"].T + h @ weights["W_hh"].T + weights["b_h"], 0.0)
    return h @ weights["W_out"].T + weights["b_out"]


def _hand_parity_weights(hidden: int = 4) -> dict[str, np.ndarray]:
    """A ReLU RNN that computes parity exactly. Units are AND gates u[p, a] = 1 iff the
    parity so far was p and the symbol is a; the new parity is p xor a, so
    u'[p', a'] = relu(sum_{p xor a = p'} u[p, a] + x[a'] - 1). Extra units stay at 0."""
    pairs = [(0, 0), (0, 1), (1, 0), (1, 1)]  # unit index -> (parity before, symbol)
    W_hh = np.zeros((hidden, hidden))
    W_ih = np.zeros((hidden, 2))
    b = np.zeros(hidden)
    W_out = np.zeros((2, hidden))
    for i, (p_new, a_new) in enumerate(pairs):
        W_ih[i, a_new] = 1.0
        b[i] = -1.0
        for j, (p, a) in enumerate(pairs):
            if p ^ a == p_new:
                W_hh[i, j] = 1.0
        W_out[(pairs[i][0] ^ pairs[i][1]), i] = 1.0  # readout: the parity after this step
    h0 = np.zeros(hidden)
    h0[0] = 1.0  # "parity 0 after symbol 0": the empty string is even
    return {"W_ih": W_ih, "W_hh": W_hh, "b_h": b, "W_out": W_out, "b_out": np.zeros(2), "h0": h0}


def _single_checkpoint_run(weights: dict[str, np.ndarray]) -> xr.Dataset:
    model = par.ParityRNN.from_weights(**weights)
    return par.parity_run_from_models([model], steps=[0])


# -- Hopcroft minimisation ------------------------------------------------------------


def test_minimise_redundant_parity_machine_gives_the_two_state_parity_automaton():
    # States are (parity, last symbol): 4 states, but only the parity matters.
    pairs = [(0, 0), (0, 1), (1, 0), (1, 1)]
    index = {pq: i for i, pq in enumerate(pairs)}
    trans = np.array([[index[(p ^ a, a)] for a in (0, 1)] for p, _ in pairs])
    outputs = np.array([p for p, _ in pairs])
    minimal, block_of = minimise_automaton(Automaton(trans, outputs, initial=0))
    assert minimal.n_states == 2
    # Hand-worked: even --0--> even, even --1--> odd, odd --0--> odd, odd --1--> even.
    np.testing.assert_array_equal(minimal.transitions, [[0, 1], [1, 0]])
    np.testing.assert_array_equal(minimal.outputs, [0, 1])
    np.testing.assert_array_equal(block_of, [0, 0, 1, 1])


def test_minimise_mod3_counter_with_duplicates_and_unreachable_states():
    # States 0..5 count ones mod 3 twice over (q and q+3 are equivalent); state 6 is unreachable.
    trans = np.array([[0, 4], [1, 5], [2, 3], [3, 1], [4, 2], [5, 0], [6, 6]])
    outputs = np.array([0, 1, 2, 0, 1, 2, 0])
    minimal, block_of = minimise_automaton(Automaton(trans, outputs, initial=0))
    assert minimal.n_states == 3
    assert block_of[6] == -1
    assert block_of[0] == block_of[3] and block_of[1] == block_of[4] and block_of[2] == block_of[5]
    assert len({block_of[0], block_of[1], block_of[2]}) == 3


def test_minimise_textbook_dfa_needs_refinement_beyond_outputs():
    # Accepts strings over {a, b} that end in "abb" (Aho, Sethi & Ullman's example):
    # 5 states A..E, with A and C equivalent; outputs alone separate only E.
    A, B, C, D, E = range(5)
    trans = np.array([[B, C], [B, D], [B, C], [B, E], [B, C]])
    outputs = np.array([0, 0, 0, 0, 1])
    minimal, block_of = minimise_automaton(Automaton(trans, outputs, initial=A))
    assert minimal.n_states == 4
    assert block_of[A] == block_of[C]
    assert len(set(block_of.tolist())) == 4
    for word in _words(2, 6):
        expected = int(len(word) >= 3 and word[-3:] == (0, 1, 1))
        assert minimal.run(word) == expected


@pytest.mark.parametrize("seed", range(12))
def test_minimise_matches_brute_force_equivalence_on_random_automata(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    trans = rng.integers(0, n, size=(n, 2))
    if seed % 3 == 0:  # partial automata: some transitions undefined
        trans[rng.random((n, 2)) < 0.2] = -1
    outputs = rng.integers(0, 2, size=n)
    auto = Automaton(trans, outputs, initial=int(rng.integers(0, n)))
    minimal, block_of = minimise_automaton(auto)
    classes = _brute_force_classes(auto)
    assert minimal.n_states == len(set(classes.values()))
    for p in classes:
        for q in classes:
            assert (classes[p] == classes[q]) == (block_of[p] == block_of[q])
    for word in _words(2, 6):  # same language of outputs
        assert minimal.run(word) == auto.run(word)


def test_minimise_prefix_tree_merges_leaves_with_equal_outputs():
    # Prefix tree of depth 2 (no merging, undefined transitions at the leaves), output parity.
    names = ["", "0", "1", "00", "01", "10", "11"]
    trans = np.array([[1, 2], [3, 4], [5, 6], [-1, -1], [-1, -1], [-1, -1], [-1, -1]])
    outputs = np.array([s.count("1") % 2 for s in names])
    auto = Automaton(trans, outputs)
    assert not auto.complete
    minimal, block_of = minimise_automaton(auto)
    # Leaves: two classes (even, odd); depth-1: "0" and "1" differ by output; root alone.
    assert minimal.n_states == 5
    assert block_of[3] == block_of[6] and block_of[4] == block_of[5] and block_of[3] != block_of[4]


def test_automaton_rejects_bad_tables():
    with pytest.raises(InputError, match="outputs"):
        Automaton(np.array([[0, 0]]), np.array([0, 1]))
    with pytest.raises(InputError, match="transitions"):
        Automaton(np.array([[0, 3]]), np.array([0]))
    with pytest.raises(InputError, match="initial"):
        Automaton(np.array([[0, 0]]), np.array([0]), initial=2)


# -- merging hidden states ------------------------------------------------------------


def test_merge_states_groups_constructed_clusters_in_order_of_first_member():
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    order = [1, 0, 1, 2, 0, 2, 1]
    hidden = centres[order] + rng.normal(scale=0.01, size=(len(order), 3))
    groups = merge_states(hidden, merge_distance=0.5)
    # Groups are numbered by first appearance: centre 1 -> 0, centre 0 -> 1, centre 2 -> 2.
    np.testing.assert_array_equal(groups, [0, 1, 0, 2, 1, 2, 0])


def test_merge_states_is_greedy_and_strict():
    # b is within reach of a (first group) and c; it joins a. c is 1.0 from a: not < 1.0.
    hidden = np.array([[0.0], [1.0], [0.6]])
    np.testing.assert_array_equal(merge_states(hidden, merge_distance=1.0), [0, 1, 0])
    np.testing.assert_array_equal(merge_states(hidden, merge_distance=1.0001), [0, 0, 0])
    np.testing.assert_array_equal(merge_states(hidden, merge_distance=0.0), [0, 1, 2])
    # A diverged state never merges.
    np.testing.assert_array_equal(merge_states(np.array([[0.0], [np.nan], [0.0]]), 1.0), [0, 1, 0])


def test_merge_states_rejects_bad_input():
    with pytest.raises(InputError, match="merge_distance"):
        merge_states(np.zeros((3, 2)), -1.0)
    with pytest.raises(InputError, match="2-d"):
        merge_states(np.zeros(3), 1.0)


# -- a hand-built parity RNN ----------------------------------------------------------


def test_hand_set_rnn_computes_parity_as_a_numpy_forward_does():
    weights = _hand_parity_weights(hidden=6)
    model = par.ParityRNN.from_weights(**weights)
    rng = np.random.default_rng(1)
    strings = rng.integers(0, 2, size=(64, 300))
    with torch.no_grad():
        out, hidden = model(torch.as_tensor(strings))
    expected = _numpy_rnn_outputs(weights, strings)
    np.testing.assert_allclose(out[:, -1].numpy(), expected, atol=1e-5)
    np.testing.assert_array_equal(out[:, -1].argmax(-1).numpy(), strings.sum(1) % 2)
    np.testing.assert_array_equal(out.argmax(-1).numpy(), np.cumsum(strings, 1) % 2)


def test_hand_set_rnn_generalises_to_10000_symbols():
    run = _single_checkpoint_run(_hand_parity_weights())
    acc = par.parity_long_accuracy(run, lengths=[1, 7, 100, 10_000], n_strings=16, seed=3)
    np.testing.assert_array_equal(acc["accuracy"].values, 1.0)
    assert acc.attrs["generalisation_step"] == 0


def test_long_accuracy_of_a_wrong_rnn_matches_a_direct_count():
    # Readout of the hand RNN with outputs swapped for the "last symbol was 1" units:
    # the prediction is then (parity xor last symbol), right exactly when the last symbol is 0.
    weights = _hand_parity_weights()
    weights["W_out"] = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])  # = parity before
    run = _single_checkpoint_run(weights)
    acc = par.parity_long_accuracy(run, lengths=[5, 50], n_strings=40, seed=0)
    strings = np.random.default_rng(0).integers(0, 2, size=(40, 50), dtype=np.int8)
    np.testing.assert_allclose(acc["accuracy"].values[0],
                               [(strings[:, 4] == 0).mean(), (strings[:, 49] == 0).mean()])
    assert acc.attrs["generalisation_step"] is None


def test_hand_set_rnn_automaton_has_four_merged_and_two_minimal_states():
    run = _single_checkpoint_run(_hand_parity_weights())
    auto = par.parity_automaton(run, 0, max_length=6)
    # Hidden states are the 4 one-hot units; h0 equals the state after "0".
    assert auto.attrs["n_states"] == 4
    assert auto.attrs["finite"] is True
    assert auto.attrs["conflicts"] == 0
    assert auto.attrs["n_states_minimal"] == 2
    np.testing.assert_array_equal(auto["min_transitions"].values, [[0, 1], [1, 0]])
    np.testing.assert_array_equal(auto["min_output"].values, [0, 1])
    # Every prefix sits in a state whose output is its parity.
    state_out = auto["output"].values[auto["state_of"].values]
    np.testing.assert_array_equal(state_out, auto["parity"].values)
    sizes = par.parity_automaton_sizes(run, max_length=6)
    assert int(sizes["n_states_minimal"][0]) == 2 and bool(sizes["is_parity_automaton"][0])
    assert sizes.attrs["transition_step"] == 0


def test_automaton_of_an_untrained_tree_is_not_finite():
    # A random large-gain RNN separates every prefix: the automaton is the prefix tree.
    model = par.ParityRNN(32, gain=3.0, seed=0)
    run = par.parity_run_from_models([model], steps=[0])
    auto = par.parity_automaton(run, 0, max_length=4, threshold=0.01)
    assert auto.attrs["n_states"] == 2**5 - 1
    assert auto.attrs["finite"] is False
    sizes = par.parity_automaton_sizes(run, max_length=4)
    assert sizes.attrs["transition_step"] is None and not bool(sizes["is_parity_automaton"][0])


def test_hidden_states_follow_prefix_order_and_match_numpy():
    weights = {k: v for k, v in _hand_parity_weights().items()}
    rng = np.random.default_rng(5)
    weights["W_hh"] = weights["W_hh"] + rng.normal(scale=0.05, size=(4, 4))
    run = _single_checkpoint_run(weights)
    hs = par.parity_hidden_states(run, 0, max_length=3)
    assert list(hs["string"].values[:7]) == ["", "0", "1", "00", "01", "10", "11"]
    for i, s in enumerate(hs["string"].values):
        if not s:
            np.testing.assert_allclose(hs["hidden"].values[i], weights["h0"], atol=1e-6)
            continue
        h = weights["h0"].copy()
        for a in s:
            h = np.maximum(weights["W_ih"][:, int(a)] + weights["W_hh"] @ h + weights["b_h"], 0)
        np.testing.assert_allclose(hs["hidden"].values[i], h, atol=1e-5)
    np.testing.assert_array_equal(hs["parity"].values, [s.count("1") % 2 for s in hs["string"].values])


def test_hidden_pca_matches_an_svd_of_the_centred_states():
    model = par.ParityRNN(20, gain=1.0, seed=2)
    run = par.parity_run_from_models([model], steps=[0])
    pca = par.parity_hidden_pca(run, 0, max_length=5, n_components=2)
    h = par.parity_hidden_states(run, 0, max_length=5)["hidden"].values.astype(np.float64)
    centred = h - h.mean(0)
    cov_eig = np.sort(np.linalg.eigvalsh(centred.T @ centred))[::-1]
    # Component variances are the top eigenvalues of the scatter matrix.
    np.testing.assert_allclose((pca["pc"].values.astype(np.float64) ** 2).sum(0), cov_eig[:2],
                               rtol=1e-4)
    np.testing.assert_allclose(pca["explained_variance_ratio"].values, cov_eig[:2] / cov_eig.sum(),
                               rtol=1e-4)


# -- training -------------------------------------------------------------------------


def test_training_run_layout_and_loss_against_numpy_forward():
    run = par.train_parity_rnn(hidden_size=12, epochs=3, checkpoint_every=1, max_length=5, seed=4)
    steps_per_epoch = 5  # one minibatch per length (at most 32 strings of each length < 128)
    np.testing.assert_array_equal(run["step"].values, np.arange(4) * steps_per_epoch)
    np.testing.assert_array_equal(run["epoch"].values, np.arange(4))
    assert run["W_hh"].dims == ("step", "unit", "src_unit")
    np.testing.assert_array_equal(run["h0"].values, 1.0)
    # Training loss at every checkpoint from a numpy forward over all strings.
    symbols, lengths = par.parity_strings(5)
    target = np.eye(2)[symbols.sum(1) % 2]
    for step in run["step"].values:
        at = run.sel(step=step)
        w = {k: at[k].values.astype(np.float64) for k in ("W_ih", "W_hh", "b_h", "W_out", "b_out")}
        w["h0"] = run["h0"].values
        finals = np.stack([_numpy_rnn_outputs(w, symbols[i:i + 1, :lengths[i]])[0]
                           for i in range(len(lengths))])
        np.testing.assert_allclose(float(at["train_loss"]), ((finals - target) ** 2).mean(),
                                   rtol=1e-4)
    # SGD moved the weights, and the attrs are JSON-able provenance.
    assert not np.allclose(run["W_hh"].values[0], run["W_hh"].values[-1])
    json.dumps(run.attrs)
    assert run.attrs["method"] == "parity_rnn" and "van Rossem" in run.attrs["citation"]
    assert run.attrs["params"]["lr"] == 0.02 and run.attrs["seed"] == 4


def test_training_is_seeded():
    a = par.train_parity_rnn(hidden_size=8, epochs=2, max_length=4, seed=1)
    b = par.train_parity_rnn(hidden_size=8, epochs=2, max_length=4, seed=1)
    c = par.train_parity_rnn(hidden_size=8, epochs=2, max_length=4, seed=2)
    np.testing.assert_array_equal(a["W_hh"].values, b["W_hh"].values)
    assert not np.allclose(a["W_hh"].values[0], c["W_hh"].values[0])


def test_initialisation_is_xavier_normal_with_the_gain():
    model = par.ParityRNN(400, gain=0.1, seed=0)
    w = model.rnn.weight_hh_l0.detach().numpy()
    assert w.std() == pytest.approx(0.1 * np.sqrt(2 / 800), rel=0.02)
    assert float(model.rnn.bias_ih_l0.abs().sum()) == 0.0


def test_progress_callback_can_cancel_training():
    seen = []

    def progress(done, total):
        seen.append((done, total))
        return done < 2

    run = par.train_parity_rnn(hidden_size=8, epochs=10, max_length=4, checkpoint_every=5,
                               progress=progress)
    assert seen == [(1, 10), (2, 10)]
    assert run.attrs["cancelled"] is True
    np.testing.assert_array_equal(run["epoch"].values, [0, 2])


def test_parity_strings_order():
    symbols, lengths = par.parity_strings(3)
    assert len(lengths) == 14
    assert symbols[2**2 - 2 + 0b10].tolist()[:2] == [1, 0] and lengths[2**2 - 2 + 0b10] == 2
    assert symbols[-1].tolist() == [1, 1, 1]


@pytest.mark.parametrize("kwargs, match", [
    ({"hidden_size": 0}, "hidden_size"),
    ({"lr": -1.0}, "lr"),
    ({"max_length": 40}, "max_length"),
    ({"checkpoint_every": 0}, "checkpoint_every"),
])
def test_training_rejects_bad_parameters(kwargs, match):
    with pytest.raises(InputError, match=match):
        par.train_parity_rnn(**kwargs)


def test_analyses_reject_bad_steps_and_runs():
    run = _single_checkpoint_run(_hand_parity_weights())
    with pytest.raises(InputError, match="step"):
        par.parity_automaton(run, 7)
    with pytest.raises(TypeError, match="xarray.Dataset"):
        par.parity_automaton_sizes({"W_hh": 1})
    with pytest.raises(InputError, match="lengths"):
        par.parity_long_accuracy(run, lengths=[0])


# -- store and command line -----------------------------------------------------------


def test_parity_run_is_stored_and_reused(tmp_path):
    from explorer.store import ActivationStore

    store = ActivationStore(tmp_path)
    params = {"hidden_size": 8, "epochs": 2, "max_length": 4, "checkpoint_every": 1, "seed": 0}
    calls = []
    first = par.parity_run(store=store, progress=lambda d, t: calls.append(d), **params)
    again = par.parity_run(store=store, progress=lambda d, t: calls.append(d), **params)
    assert calls == [1, 2]  # trained once
    np.testing.assert_array_equal(first["W_hh"].values, again["W_hh"].values)
    with pytest.raises(InputError, match="unknown parity training parameter"):
        par.parity_run(store=store, epoch=3)


def test_cli_train_and_analyse(tmp_path, monkeypatch, capsys):
    command = OneCommand("parity", monkeypatch, capsys)
    args = ["parity", "train", "--epochs", "2", "--hidden-size", "8", "--checkpoint-every", "1",
            "--json", "--cache", str(tmp_path)]
    trained = command.json(args)
    assert trained["n_checkpoints"] == 3 and trained["params"]["hidden_size"] == 8
    args[1] = "analyse"
    summary = command.json(args + ["--max-length", "4", "--n-strings", "2"])
    assert set(summary["final_accuracy"]) == {str(n) for n in par.LONG_LENGTHS}
    assert summary["final_n_states"] >= 1
    assert command(["parity", "train", "--epochs", "-1", "--cache", str(tmp_path)]) == 2
    assert "`epochs` must be an int" in capsys.readouterr().err



def test_cli_trains_at_one_thread_and_restores_the_thread_count(tmp_path, monkeypatch, capsys):
    """`explorer parity` trains at one torch thread (or --threads N) and leaves the process's
    thread count as it found it, even when the command fails."""
    command = OneCommand("parity", monkeypatch, capsys)
    seen = record_threads(monkeypatch, par_runs, "train_parity_rnn")  # parity_run calls it there
    args = ["parity", "train", "--epochs", "1", "--hidden-size", "4", "--checkpoint-every", "1",
            "--json", "--cache", str(tmp_path)]
    with torch_threads(3):  # neither 1 nor 2, so a leaked count shows
        assert command(args) == 0
        assert torch.get_num_threads() == 3
        assert command(args + ["--threads", "2"]) == 0
        assert torch.get_num_threads() == 3
        assert command(["parity", "train", "--epochs", "-1", "--cache", str(tmp_path)]) == 2
        assert torch.get_num_threads() == 3
    assert seen == [1, 2, 1]  # the failing run is refused inside training, at one thread too
    capsys.readouterr()

# -- phase diagram ----------------------------------------------------------------------


def test_phase_diagram_cells_match_direct_runs():
    kwargs = {"epochs": 30, "hidden_size": 12, "checkpoint_every": 10, "analysis_max_length": 4,
              "lengths": [20], "n_strings": 4, "seed": 0}
    phase = par.parity_phase_diagram([0.1, 2.0], [3, 4], **kwargs)
    assert phase["is_parity_automaton"].dims == ("gain", "max_length")
    np.testing.assert_array_equal(phase["gain"].values, [0.1, 2.0])
    np.testing.assert_array_equal(phase["max_length"].values, [3, 4])
    # One cell again, computed directly with the training and automaton functions.
    run = par.train_parity_rnn(hidden_size=12, gain=2.0, epochs=30, max_length=4, checkpoint_every=10,
                               seed=0)
    sizes = par.parity_automaton_sizes(run, max_length=4)
    cell = phase.sel(gain=2.0, max_length=4)
    assert int(cell["final_n_states_minimal"]) == int(sizes["n_states_minimal"].values[-1])
    assert int(cell["final_n_states"]) == int(sizes["n_states"].values[-1])
    assert float(cell["final_train_loss"]) == pytest.approx(float(run["train_loss"].values[-1]))
    with torch.no_grad():  # worst accuracy over the lengths, by a direct count on the same strings
        strings = np.random.default_rng(0).integers(0, 2, size=(4, 20), dtype=np.int8)
        out, _ = par.parity_model(run, int(run["step"].values[-1]))(torch.as_tensor(strings, dtype=torch.long))
    want = (out[:, -1].argmax(-1).numpy() == strings.sum(1) % 2).mean()
    assert float(cell["long_accuracy"]) == pytest.approx(want)
    # A cell has a transition epoch exactly when it ends as the parity automaton.
    parity_cells = phase["is_parity_automaton"].values == 1
    np.testing.assert_array_equal(np.isfinite(phase["transition_epoch"].values), parity_cells)
    assert phase.attrs["total_seconds"] >= float(phase["train_seconds"].sum()) * 0.99


def test_phase_diagram_rejects_bad_grids_and_settings(tmp_path):
    from explorer.store import ActivationStore

    with pytest.raises(InputError, match="must not repeat"):
        par.parity_phase_diagram([0.1, 0.1], [3])
    with pytest.raises(InputError, match="at least one value"):
        par.parity_phase_diagram([], [3])
    with pytest.raises(InputError, match=r"`max_lengths\[i\]` must be an int in \[1, 16\]"):
        par.parity_phase_diagram([0.1], [0])
    with pytest.raises(InputError, match="unknown phase-diagram setting 'epoch'"):
        par.stored_parity_phase_diagram([0.1], [3], store=ActivationStore(tmp_path), epoch=3)
    assert par.stored_parity_phase_diagram([0.1], [3], store=ActivationStore(tmp_path), compute=False,
                                           epochs=2) is None


def test_cli_phase_is_stored_and_reused(tmp_path, monkeypatch, capsys):
    command = OneCommand("parity", monkeypatch, capsys)
    args = ["parity", "phase", "--gains", "0.1,1", "--max-lengths", "3", "--epochs", "4",
            "--hidden-size", "8", "--checkpoint-every", "2", "--n-strings", "2", "--json",
            "--cache", str(tmp_path)]
    first = command.json(args)
    assert first["gains"] == [0.1, 1.0] and first["max_lengths"] == [3]
    assert np.shape(first["is_parity_automaton"]) == (2, 1)
    assert first["settings"]["epochs"] == 4
    assert command.json(args) == first  # read back from the store: the same numbers
    assert command(args[:2] + ["--gains", "0.1,x", "--cache", str(tmp_path)]) == 2
    assert "`--gains` must be comma-separated numbers" in capsys.readouterr().err
    assert command(args[:2] + ["--max-lengths", "3.5", "--cache", str(tmp_path)]) == 2
    assert "`--max-lengths` must be comma-separated ints" in capsys.readouterr().err


def test_phase_heatmap_shows_each_cell():
    pytest.importorskip("panel")
    from apps.parity import phase_caption, plot_phase_diagram

    phase = xr.Dataset(
        {"is_parity_automaton": (("gain", "max_length"), [[1.0, 0.0]]),
         "transition_epoch": (("gain", "max_length"), [[540.0, np.nan]]),
         "final_n_states_minimal": (("gain", "max_length"), [[2.0, 13.0]]),
         "long_accuracy": (("gain", "max_length"), [[1.0, 0.5]])},
        coords={"gain": [0.1], "max_length": [6, 8]}, attrs={"params": {"epochs": 1000}})
    overlay = plot_phase_diagram(phase)
    heat, labels = overlay.values()
    assert heat.dimension_values("worst long-string accuracy").tolist() == [1.0, 0.5]
    assert labels.dimension_values("text").tolist() == ["epoch 540", "13 states"]
    assert heat.opts.get().kwargs["title"] == "Phase diagram"          # short: the rest is below
    assert phase_caption(phase).startswith("1 x 2 runs of 1000 epochs each")


# -- the shipped seed-0 run -------------------------------------------------------------


def test_safetensors_round_trip_keeps_layout_and_rounds_weights_to_float16(tmp_path):
    run = par.parity_run_from_models([par.ParityRNN(hidden_size=6, seed=s) for s in (3, 4)], steps=[0, 5])
    analysis = xr.Dataset({"n_states": ("step", np.array([7, 2])), "ok": ("step", np.array([False, True]))},
                          coords={"step": [0, 5]}, attrs={"transition_step": 5, "params": {"a": [1, 2]}})
    path = par.save_parity_run_safetensors(run, tmp_path / "run.safetensors", analysis=analysis)
    back, back_analysis = par.load_parity_run_safetensors(path)
    for name in ("W_ih", "W_hh", "b_h", "W_out", "b_out"):
        assert back[name].dtype == np.float32 and back[name].dims == run[name].dims
        np.testing.assert_array_equal(back[name].values, run[name].values.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(back["h0"].values, run["h0"].values)        # not rounded
    np.testing.assert_array_equal(back["train_loss"].values, run["train_loss"].values)
    np.testing.assert_array_equal(back["epoch"].values, run["epoch"].values)
    assert back.attrs == json.loads(json.dumps(run.attrs))
    xr.testing.assert_identical(back_analysis, analysis)
    with pytest.raises(InputError, match="no safetensors file"):
        par.load_parity_run_safetensors(tmp_path / "missing.safetensors")


@pytest.mark.skipif(not par.SHIPPED_RUN.is_file(), reason="the shipped run is missing")
def test_shipped_run_is_compact_and_its_analysis_matches_its_weights():
    assert par.SHIPPED_RUN.stat().st_size < 3_000_000
    run, analysis = par.load_parity_run_safetensors(par.SHIPPED_RUN)
    assert {**run.attrs["params"], "seed": run.attrs["seed"]} == par.DEFAULTS and run.sizes["step"] == 101
    steps = run["step"].values
    final = int(steps[-1])
    # The stored analysis is that of the shipped (float16) weights: recompute two checkpoints.
    for step in (int(steps[0]), final):
        auto = par.parity_automaton(run, step)
        at = analysis.sel(step=step)
        assert auto.attrs["n_states"] == int(at["n_states"])
        assert auto.attrs["n_states_minimal"] == int(at["n_states_minimal"])
    acc = par.parity_long_accuracy(run, steps=[final])
    np.testing.assert_array_equal(acc["accuracy"].values[0], analysis["accuracy"].sel(step=final).values)
    # And it is the paper's result: a 2-state parity automaton that solves every length.
    assert bool(analysis["is_parity_automaton"].sel(step=final)) and bool(analysis["all_correct"].sel(step=final))
    assert analysis.attrs["transition_step"] is not None


@pytest.mark.skipif(not par.SHIPPED_RUN.is_file(), reason="the shipped run is missing")
def test_empty_store_reads_the_shipped_run_and_analysis_without_training(tmp_path, monkeypatch):
    from explorer.store import ActivationStore

    store = ActivationStore(tmp_path)
    monkeypatch.setattr(par_runs, "train_parity_rnn", lambda **kw: pytest.fail("trained instead of reading"))
    monkeypatch.setattr(par_runs, "parity_analysis", lambda *a, **kw: pytest.fail("analysed instead of reading"))
    run = par.parity_run(store=store)
    assert "shipped" in run.attrs["source"]
    analysis = par.stored_parity_analysis(run, store=store)
    _, shipped_analysis = par.load_parity_run_safetensors(par.SHIPPED_RUN)
    np.testing.assert_array_equal(analysis["n_states"].values, shipped_analysis["n_states"].values)
    # Any other setting is trained, not read.
    with pytest.raises(pytest.fail.Exception, match="trained instead"):
        par.parity_run(store=store, seed=1)
    with pytest.raises(pytest.fail.Exception, match="analysed instead"):   # (that patch is live too)
        par.stored_parity_analysis(run, store=store, max_length=4)


@pytest.mark.slow
@pytest.mark.skipif(not par.SHIPPED_RUN.is_file(), reason="the shipped run is missing")
def test_cli_retraining_seed_0_reproduces_the_shipped_checkpoints(tmp_path, monkeypatch, capsys):
    from explorer.store import ActivationStore

    command = OneCommand("parity", monkeypatch, capsys)
    trained = command.json(["parity", "train", "--epochs", "30", "--json", "--cache", str(tmp_path)])
    assert trained["n_checkpoints"] == 4       # epochs 0, 10, 20, 30
    retrained = par.parity_run(store=ActivationStore(tmp_path), epochs=30)
    assert "source" not in retrained.attrs
    shipped, _ = par.load_parity_run_safetensors(par.SHIPPED_RUN)
    first = shipped.isel(step=slice(0, 4))
    np.testing.assert_array_equal(first["step"].values, retrained["step"].values)
    # Same seed, same data order: the same weights up to the float16 rounding of the shipped
    # copy (relative 2^-11) plus float differences between CPUs.
    for name in ("W_ih", "W_hh", "b_h", "W_out", "b_out"):
        np.testing.assert_allclose(first[name].values, retrained[name].values, rtol=2e-3, atol=1e-5)
    np.testing.assert_allclose(first["train_loss"].values, retrained["train_loss"].values, rtol=1e-4)


def test_uniform_batching_is_one_sgd_step_on_the_mean_loss_of_its_batch():
    """batching='uniform' with one batch of every string and one epoch is one SGD step on
    the MSE of each string's readout after its own last symbol, checked by hand."""
    from explorer.analyses.parity.network import ParityRNN, parity_strings

    kw = dict(hidden_size=6, max_length=4, epochs=1, lr=0.5, gain=0.5, checkpoint_every=1, seed=3)
    n = len(parity_strings(4)[1])                                  # 30 strings
    run = par.train_parity_rnn(batching="uniform", batch_size=n, **kw)
    assert run.attrs["params"]["batching"] == "uniform" and run.attrs["steps_per_epoch"] == 1
    symbols, lengths = parity_strings(4)
    net = ParityRNN(6, gain=0.5, seed=3)
    x = torch.as_tensor(symbols, dtype=torch.long)
    target = torch.nn.functional.one_hot(torch.as_tensor(symbols.sum(1) % 2), 2).float()
    with torch.enable_grad():
        out, _ = net(x)
        final = out[torch.arange(n), torch.as_tensor(lengths - 1)]
        ((final - target) ** 2).mean().backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= 0.5 * p.grad
    after = par.parity_model(run, int(run.step.values[-1])).weights()
    for name, value in net.weights().items():
        np.testing.assert_allclose(after[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # the default keeps one length per batch (and its params unchanged)
    per_length = par.train_parity_rnn(batch_size=n, **kw)
    assert "batching" not in per_length.attrs["params"] and per_length.attrs["steps_per_epoch"] == 4
    with pytest.raises(InputError, match="`batching` must be one of 'per-length', 'uniform'"):
        par.train_parity_rnn(batching="mixed", **kw)


def test_view_titles_are_short_and_captions_and_tooltips_say_the_rest():
    pytest.importorskip("panel")
    import panel as pn

    from apps.parity import ParityView

    run = par.train_parity_rnn(hidden_size=16, epochs=20, checkpoint_every=10, max_length=6, seed=0)
    analysis = par.parity_analysis(run, max_length=5, lengths=[10, 100], n_strings=4)
    phase = xr.Dataset({"long_accuracy": (("gain", "max_length"), [[1.0]]),
                        "transition_epoch": (("gain", "max_length"), [[np.nan]]),
                        "final_n_states_minimal": (("gain", "max_length"), [[5.0]])},
                       coords={"gain": [0.1], "max_length": [6]}, attrs={"params": {"epochs": 20}})
    view = ParityView(run=run, analysis=analysis, phase=phase, max_length=5, background=False)
    view.step = int(run["step"].values[1])
    auto = par.parity_automaton(run, view.step, max_length=5, threshold=view.threshold)
    titles = [f().opts.get().kwargs["title"] for f in (view._pca_plot, view._automaton_plot,
                                                       view._accuracy_plot, view._states_plot,
                                                       view._loss_plot, view._long_plot)]
    assert titles == [f"Hidden states, step {view.step}", f"Merged automaton, step {view.step}",
                      f"Accuracy by length, step {view.step}", "Automaton states", "Training loss",
                      "Long-string accuracy"]
    assert (f"{auto.attrs['n_states']} merged states" in view._automaton_caption()
            and f"{auto.attrs['n_states_minimal']} after Hopcroft" in view._automaton_caption())
    worst = float(analysis["accuracy"].sel(step=view.step).min())
    assert view._accuracy_caption().endswith(f"Worst length: {worst:.0%}.")
    controls = view.controls()
    tips = [w.value for w in controls.select(pn.widgets.TooltipIcon)]
    assert tips == [view.param[n].doc for n in ("step", "threshold", "max_length", "minimal", "color_by")]
    assert all(tips) and "<b>Colour states by</b>" in [str(p.object) for p in controls.select(pn.pane.HTML)]


def test_view_hides_the_phase_box_until_one_is_stored_and_captions_name_the_plots():
    pytest.importorskip("panel")
    import panel as pn

    from apps.parity import ParityView

    run = par.train_parity_rnn(hidden_size=16, epochs=20, checkpoint_every=10, max_length=6, seed=0)
    analysis = par.parity_analysis(run, max_length=5, lengths=[10, 100], n_strings=4)
    view = ParityView(run=run, analysis=analysis, max_length=5, background=False)
    view.phase = None                                        # nothing stored
    layout = view.__panel__()
    phase_pane = [p for p in layout.select(pn.pane.HoloViews) if "parity-phase" in p.css_classes]
    assert len(phase_pane) == 1 and not phase_pane[0].visible
    # Its caption says how to make one, with the command.
    assert "`explorer parity phase`" in view._phase_caption()
    view.phase = xr.Dataset({"long_accuracy": (("gain", "max_length"), [[1.0]]),
                             "transition_epoch": (("gain", "max_length"), [[np.nan]]),
                             "final_n_states_minimal": (("gain", "max_length"), [[5.0]])},
                            coords={"gain": [0.1], "max_length": [6]}, attrs={"params": {"epochs": 20}})
    assert phase_pane[0].visible
    text = view._automaton_caption()
    assert "Left" not in text and "Right" not in text and "Hidden states (first plot)" in text
    widths = {p.css_classes[0]: p.min_width for p in layout.select(pn.pane.HoloViews)}
    assert widths["parity-pca"] == widths["parity-automaton"] == 420
