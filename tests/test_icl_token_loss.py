"""The long-context token-loss difference under head ablation, against plain torch hooks.

References: the per-token loss of ``model.hf`` on the same BOS-prefixed corpus windows,
with the ablated heads' slices of the ``o_proj`` input overwritten by a forward pre-hook
(the head's output at position 0 of a run on the BOS token alone, captured by a hook), and
the bootstrap recomputed by hand.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.analyses import icl_token_loss as tl
from tests._hooks import removed_after


def _o_proj_inputs(model, ids):
    """Every layer's o_proj input for ``ids`` [1, n]: [layer, n, n_heads * d_head]."""
    got = {}
    handles = [model.o_proj(l).register_forward_pre_hook(
        lambda mod, args, l=l: got.__setitem__(l, args[0][0].detach().clone()))
        for l in range(model.spec.n_layers)]
    with removed_after(handles), torch.no_grad():
        model.hf(torch.tensor([ids]))
    return torch.stack([got[l] for l in range(model.spec.n_layers)])


def _losses_with_heads_set(model, seqs, writes, positions):
    """Per-token loss at ``positions`` with (layer, head) -> d_head vector written at every
    position of the o_proj input."""
    d = model.spec.d_head
    handles = []
    for (layer, head), value in writes.items():
        def hook(mod, args, head=head, value=value):
            z = args[0].clone()
            z[..., head * d:(head + 1) * d] = value
            return (z,)
        handles.append(model.o_proj(layer).register_forward_pre_hook(hook))
    with removed_after(handles), torch.no_grad():
        logits = model.hf(torch.tensor(seqs)).logits.float()
    ids = torch.tensor(seqs)
    loss = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return loss[:, positions].numpy()


def test_bos_head_outputs_equal_a_hooked_bos_run(tiny_model):
    m = tiny_model
    bos = m.tokenizer.bos_token_id
    assert bos is not None
    ref = _o_proj_inputs(m, [bos])[:, 0].reshape(m.spec.n_layers, m.spec.n_heads, m.spec.d_head)
    np.testing.assert_allclose(tl.bos_head_outputs(m), ref.numpy(), atol=1e-5)


def test_token_losses_equal_plain_cross_entropy(tiny_model):
    m = tiny_model
    seqs = [list(range(5, 25)), list(range(40, 60)), list(range(90, 110))]
    got = tl.token_losses(m, seqs, [3, 17], batch_size=2)
    np.testing.assert_allclose(got, _losses_with_heads_set(m, seqs, {}, [3, 17]), atol=1e-4)
    with pytest.raises(InputError, match="one length"):
        tl.token_losses(m, [list(range(5, 25)), list(range(5, 20))], [3])
    with pytest.raises(InputError):
        tl.token_losses(m, seqs, [19])          # no next token to predict


@pytest.mark.parametrize("ablation", ["bos", "mean"])
def test_long_context_token_loss_against_hooks(tiny_model, ablation):
    m = tiny_model
    rng = np.random.default_rng(3)
    shape = (m.spec.n_layers, m.spec.n_heads)
    induction, fv = rng.random(shape), rng.random(shape)
    early, late = 4, 30
    ds = tl.long_context_token_loss(m, induction, fv, percents=(0, 25), early=early, late=late,
                                    n_sequences=5, ablation=ablation, n_boot=400, seed=1,
                                    rankings=("fv", "induction_excl_fv", "random"))
    bos = m.tokenizer.bos_token_id
    seqs = [[bos, *s] for s in ih.corpus_token_ids(m, 5, late + 4)]
    assert ds.sizes["sequence"] == 5 and all(len(s) == late + 5 for s in seqs)
    base = _losses_with_heads_set(m, seqs, {}, [early, late])
    bos_z = _o_proj_inputs(m, [bos])[:, 0].reshape(*shape, m.spec.d_head)
    heads_at = ih.ranked_head_sets(induction, fv, (0, 25),
                                   rankings=("fv", "induction_excl_fv", "random"), seed=1)
    for (r, j), heads in heads_at.items():
        row = ds.isel(ranking=r, percent=j)
        assert str(row.ablated.values) == " ".join(f"{l}.{h}" for l, h in heads)
        if not heads:
            ref = base
        elif ablation == "bos":
            ref = _losses_with_heads_set(m, seqs, {h: bos_z[h] for h in heads}, [early, late])
        else:   # the mean over every token of the 5 sequences
            z = torch.cat([_o_proj_inputs(m, s) for s in seqs], 1).double().mean(1).float()
            ref = _losses_with_heads_set(m, seqs, {
                h: z[h[0], h[1] * m.spec.d_head:(h[1] + 1) * m.spec.d_head] for h in heads},
                [early, late])
        np.testing.assert_allclose(row.loss_early.values, ref[:, 0], atol=1e-4)
        np.testing.assert_allclose(row.loss_late.values, ref[:, 1], atol=1e-4)
        diff = ref[:, 0] - ref[:, 1]
        assert float(row.token_loss_difference) == pytest.approx(diff.mean(), abs=1e-4)
        change = diff - (base[:, 0] - base[:, 1])
        assert float(row.change) == pytest.approx(change.mean(), abs=1e-4)
        # the paired bootstrap, by hand: the same resampled sequences for every row
        idx = np.random.default_rng(1).integers(0, 5, size=(400, 5))
        means = change[idx].mean(-1)
        assert float(row.change_low) == pytest.approx(np.quantile(means, 0.025), abs=1e-4)
        assert float(row.change_high) == pytest.approx(np.quantile(means, 0.975), abs=1e-4)
    assert np.all(ds.change.sel(percent=0.0).values == 0)


def test_long_context_token_loss_refuses_bad_input(tiny_model):
    m = tiny_model
    shape = (m.spec.n_layers, m.spec.n_heads)
    scores = np.zeros(shape)
    with pytest.raises(InputError, match="ablation"):
        tl.long_context_token_loss(m, scores, scores, ablation="zero")
    with pytest.raises(InputError, match="late"):
        tl.long_context_token_loss(m, scores, scores, early=50, late=50)
    with pytest.raises(InputError, match=r"\[layer, head\]"):
        tl.long_context_token_loss(m, scores[:1], scores)
    with pytest.raises(InputError, match="fewer than"):
        tl.long_context_token_loss(m, scores, scores, early=5, late=100_000, n_sequences=2)
    with pytest.raises(InputError, match="rankings"):
        tl.long_context_token_loss(m, scores, scores, rankings="fv")
