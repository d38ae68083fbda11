"""The latent probe after unlearning (Guo et al.): residuals against plain torch hooks on
the (trained) module, the transfer probe against hand-made cases, the wiring of each row."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _views import tiny_facts_file

from explorer._checks import InputError
from explorer.analyses import unlearning as U
from explorer.analyses.unlearning import latent

ATTRS = ["blue", "dog", "moon"]  # distinct first tokens for the tiny byte-level tokenizer


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    path = tiny_facts_file(tmp_path_factory.mktemp("latent"))  # 12 people, ATTRS
    return U.load_attribute_facts(path)


def _hooked(model, hf, fact):
    """Each decoder layer's output at the last token and the last subject token (found by
    decoding) of one unpadded prompt, by forward hooks on ``hf``: [2, layer, d_model]."""
    ids = model.tokenizer(U.fact_prompt(fact, "trained"), add_special_tokens=False)["input_ids"]
    subj = next(i for i in range(len(ids))
                if model.tokenizer.decode(ids[:i + 1]).rstrip().endswith(fact.subject))
    outs = []
    blocks = hf.model.layers
    hooks = [b.register_forward_hook(lambda _m, _i, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for b in blocks]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return np.stack([np.stack([o[0, -1].float().numpy() for o in outs]),
                     np.stack([o[0, subj].float().numpy() for o in outs])])


def _perturbed(model, seed=0):
    hf = copy.deepcopy(model.hf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = hf.model.layers[0].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=g) * 0.5)
    return hf


def test_fact_residuals_are_hooked_layer_outputs(tiny_model, facts):
    got = latent.fact_residuals(tiny_model, facts, batch_size=5)     # padded batches
    assert got.shape == (len(facts), 2, tiny_model.n_layers, tiny_model.spec.d_model)
    for i, f in enumerate(facts):
        np.testing.assert_allclose(got[i], _hooked(tiny_model, tiny_model.hf, f),
                                   rtol=1e-4, atol=1e-5, err_msg=f.subject)
    hf = _perturbed(tiny_model)
    moved = latent.fact_residuals(tiny_model, facts, hf=hf)
    assert not np.allclose(moved, got, atol=1e-3)                    # the copy is read
    for i, f in enumerate(facts[:3]):
        np.testing.assert_allclose(moved[i], _hooked(tiny_model, hf, f), rtol=1e-4, atol=1e-5)


def test_transfer_probe_reads_a_planted_direction_and_nothing_else():
    rng = np.random.default_rng(0)
    labels = np.array(["a", "b", "c"] * 10)
    code = {"a": 0, "b": 1, "c": 2}
    x = rng.normal(size=(30, 2, 8))
    x[:, 0, :3] += 4.0 * np.eye(3)[[code[y] for y in labels]]        # layer 0 encodes it
    acc, correct = latent.transfer_probe_accuracy(x[:20], labels[:20], x[20:], labels[20:])
    assert acc[0] == 1.0 and correct.shape == (2, 10)
    assert acc[1] < 0.8                                              # layer 1 is noise
    const = np.ones((12, 1, 4))
    acc, _ = latent.transfer_probe_accuracy(const[:8], ["a"] * 5 + ["b"] * 3, const[8:],
                                            ["a", "b", "b", "b"])
    assert acc[0] == 0.25                                            # the majority class
    with pytest.raises(InputError, match="at least 2 attributes"):
        latent.transfer_probe_accuracy(x[:5], ["a"] * 5, x[5:], labels[5:])
    with pytest.raises(InputError, match=r"must be \[example, layer, d\] alike"):
        latent.transfer_probe_accuracy(x[:5], labels[:5], x[5:, 0], labels[5:])


def test_rows_probe_the_original_and_each_trained_copy(tiny_model, facts, monkeypatch):
    forget, rest = facts[:4], facts[4:]
    trained = _perturbed(tiny_model, seed=1)
    calls = []

    def fake_finetune(model, fg, rt, names, **kw):
        calls.append((list(fg), list(rt), list(names), kw))
        return trained, [0.0]

    monkeypatch.setattr(latent, "localized_finetune", fake_finetune)
    seen = []                               # the features every probe is fitted and read on
    real_probe = latent.transfer_probe_accuracy
    monkeypatch.setattr(latent, "transfer_probe_accuracy",
                        lambda tx, ty, fx, fy: seen.append((tx, fx)) or real_probe(tx, ty, fx, fy))
    ds = latent.latent_probe_after_unlearning(tiny_model, forget, rest[:2], rest,
                                              methods=["random"], n_layers=1, steps=3, lr=1e-3)
    assert list(ds.localization.values) == ["original", "random"]
    assert calls[0][0] == forget and calls[0][3]["steps"] == 3 and calls[0][3]["lr"] == 1e-3
    ty, fy = [f.attribute for f in rest], [f.attribute for f in forget]
    for row, hf in (("original", tiny_model.hf), ("random", trained)):
        tx = np.stack([_hooked(tiny_model, hf, f) for f in rest])    # [fact, pos, layer, d]
        fx = np.stack([_hooked(tiny_model, hf, f) for f in forget])
        for p, pos in enumerate(latent.PROBE_POSITIONS):
            got_tx, got_fx = seen[(row == "random") * 2 + p]         # rows in order, then positions
            np.testing.assert_allclose(got_tx, tx[:, p], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(got_fx, fx[:, p], rtol=1e-4, atol=1e-5)
            want, _ = real_probe(tx[:, p], ty, fx[:, p], fy)
            np.testing.assert_allclose(ds.probe_forget_accuracy.sel(localization=row, position=pos),
                                       want, err_msg=f"{row} {pos}")
        want_behaviour = U.format_accuracy(tiny_model, forget, "trained",
                                           hf=None if row == "original" else hf)[0].mean()
        assert float(ds.forget_accuracy.sel(localization=row)) == pytest.approx(want_behaviour)
    low, high = ds.probe_forget_accuracy_low.values, ds.probe_forget_accuracy_high.values
    assert np.all(low <= ds.probe_forget_accuracy.values + 1e-12)
    assert np.all(ds.probe_forget_accuracy.values <= high + 1e-12)
    # the majority training attribute (dog and moon 3 each, blue 2; the tie goes to the
    # first in sorted order, as a constant scikit-learn probe would answer) among the forget
    # facts (blue, dog, moon, blue)
    assert ty.count("dog") == ty.count("moon") == 3 and ty.count("blue") == 2
    assert float(ds.chance) == pytest.approx(0.25)


def test_forget_facts_may_not_train_the_probe(tiny_model, facts):
    with pytest.raises(InputError, match="must not hold forget facts"):
        latent.latent_probe_after_unlearning(tiny_model, facts[:4], facts[4:6], facts[2:],
                                             methods=["random"])
