"""Mean ablation as a circuit baseline (`CircuitTask.baseline="mean"`, the user's prompt
without a counterfactual) against plain torch hooks on tiny-llama: each node's output
averaged over the prompt's positions replaces it (the input embedding, a head's slice of
o_proj's input, an MLP's output); the node circuits' metrics, the fully ablated run and the
EAP scores of the edges into the logits are recomputed here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as ca
from explorer.analyses.circuit_tasks import CircuitTask, _target_ids
from explorer.models import _get_path
from tests._hooks import removed_after

PROMPT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def task(tiny_model):
    return ca.prompt_task(tiny_model, PROMPT, "", "")


@pytest.fixture(scope="module")
def scores(tiny_model, task):
    with torch.enable_grad():
        return ca.edge_scores(tiny_model, task, batch_size=1)


def ids_of(model, text):
    return torch.tensor([model.tokenize([text]).token_ids[0]])


def node_outputs(model, ids):
    """Each node's output on ``ids`` by hooks: input embedding, per-head o_proj slices
    (z), MLP outputs; and the logits at the last position."""
    arch, L = model.arch, model.n_layers
    out, handles = {}, []
    handles.append(_get_path(model.hf, arch.embed_path).register_forward_hook(
        lambda m, a, o: out.__setitem__("emb", o)))
    for lay in range(L):
        handles.append(model.o_proj(lay).register_forward_pre_hook(
            lambda m, a, _l=lay: out.__setitem__(("z", _l), a[0])))
        handles.append(_get_path(model.hf_layer(lay), arch.mlp_path).register_forward_hook(
            lambda m, a, o, _l=lay: out.__setitem__(("m", _l), o)))
    with removed_after(handles), torch.no_grad():
        logits = model.hf(input_ids=ids).logits[0, -1].double()
    return out, logits


def mean_patched_logits(model, ids, kept: set[str]) -> torch.Tensor:
    """Last-position logits with every node not in ``kept`` replaced by its output averaged
    over the prompt's positions (all positions: one prompt, no padding)."""
    arch, L, H, dh = model.arch, model.n_layers, model.spec.n_heads, model.spec.d_head
    clean, _ = node_outputs(model, ids)
    mean = {k: v.mean(1, keepdim=True).expand_as(v) for k, v in clean.items()}
    handles = []
    if "input" not in kept:
        handles.append(_get_path(model.hf, arch.embed_path).register_forward_hook(
            lambda m, a, o: mean["emb"]))
    for lay in range(L):
        heads = [h for h in range(H) if f"a{lay}.h{h}" not in kept]

        def pre(m, args, _l=lay, _h=heads):
            z = args[0].clone()                                   # [1, pos, head * d_head]
            for h in _h:
                z[..., h * dh:(h + 1) * dh] = mean[("z", _l)][..., h * dh:(h + 1) * dh]
            return (z, *args[1:])
        handles.append(model.o_proj(lay).register_forward_pre_hook(pre))
        if f"m{lay}" not in kept:
            handles.append(_get_path(model.hf_layer(lay), arch.mlp_path).register_forward_hook(
                lambda m, a, o, _l=lay: mean[("m", _l)]))
    try:
        with torch.no_grad():
            return model.hf(input_ids=ids).logits[0, -1].double()
    finally:
        for h in handles:
            h.remove()


def test_prompt_without_counterfactual_is_a_mean_baseline(tiny_model, task):
    """No counterfactual: the baseline is the mean, the corrupted prompt the prompt itself,
    the wrong target the clean prompt's runner-up (by a plain forward here)."""
    assert task.baseline == "mean" and task.corrupt == task.clean == [PROMPT]
    _, logits = node_outputs(tiny_model, ids_of(tiny_model, PROMPT))
    decode = tiny_model.tokenizer.decode
    # the two most likely tokens that decode to a string naming them again after the prompt
    # (a random model's top tokens are often byte fragments)
    top = [t for t in torch.argsort(logits, descending=True)[:200].tolist()
           if decode([t]) and tiny_model.tokenizer(PROMPT + decode([t]), add_special_tokens=False)
           ["input_ids"][len(ids_of(tiny_model, PROMPT)[0]):][:1] == [t]][:2]
    assert task.answer == [decode([top[0]])] and task.wrong == [decode([top[1]])]
    assert task.subset([0]).baseline == "mean" and task.to_dict()["baseline"] == "mean"
    with pytest.raises(ValueError, match=r"`baseline` must be one of \['counterfactual', "
                                         r"'mean'\]; got 'zero'"):
        CircuitTask([PROMPT], [PROMPT], [" a"], [" b"], baseline="zero")


@pytest.mark.parametrize("k", [0, 2, 5, 12])
def test_node_circuits_under_mean_ablation_equal_hook_patching(tiny_model, task, scores, k):
    curve = cs.node_faithfulness_curve(tiny_model, task, scores, sizes=[k], batch_size=1)
    ids = ids_of(tiny_model, PROMPT)
    a = _target_ids(tiny_model, [PROMPT], task.answer)[0]
    w = _target_ids(tiny_model, [PROMPT], task.wrong)[0]
    _, clean = node_outputs(tiny_model, ids)
    ablated = mean_patched_logits(tiny_model, ids, set())
    patched = mean_patched_logits(tiny_model, ids, set(curve.attrs["order"][:k]))
    assert curve.attrs["clean_metric"] == pytest.approx(float(clean[a] - clean[w]), abs=1e-4)
    assert curve.attrs["corrupt_metric"] == pytest.approx(float(ablated[a] - ablated[w]),
                                                          abs=1e-4)
    assert float(curve["metric"].sel(n_nodes=k)) == pytest.approx(float(patched[a] - patched[w]),
                                                                  abs=1e-4)
    assert scores.attrs["corrupt_metric"] == pytest.approx(float(ablated[a] - ablated[w]),
                                                           abs=1e-4)


def test_eap_scores_into_the_logits_under_mean_ablation(tiny_model, task, scores):
    """The EAP score of src -> logits: (mean - clean output of src) at the last position,
    dotted with the gradient of the metric w.r.t. the final norm's input (a hook here)."""
    ids = ids_of(tiny_model, PROMPT)
    a = _target_ids(tiny_model, [PROMPT], task.answer)[0]
    w = _target_ids(tiny_model, [PROMPT], task.wrong)[0]
    out, _ = node_outputs(tiny_model, ids)
    leaf = torch.zeros(1, ids.shape[1], tiny_model.spec.d_model, requires_grad=True)
    h = tiny_model.final_norm_module.register_forward_pre_hook(
        lambda m, args: (args[0] + leaf, *args[1:]))
    try:
        with torch.enable_grad():
            logits = tiny_model.hf(input_ids=ids).logits[0, -1]
            (grad,) = torch.autograd.grad(logits[a] - logits[w], [leaf])
    finally:
        h.remove()
    H, dh = tiny_model.spec.n_heads, tiny_model.spec.d_head
    nodes = {"input": out["emb"]}
    for lay in range(tiny_model.n_layers):
        z = out[("z", lay)].reshape(1, ids.shape[1], H, dh)                # [1, pos, head, d_head]
        per_head = torch.einsum("bphe,hed->bphd", z, tiny_model.W_O(lay))
        for hd in range(H):
            nodes[f"a{lay}.h{hd}"] = per_head[:, :, hd]
        nodes[f"m{lay}"] = out[("m", lay)]
    got = {str(s): float(v) for s, d, v in zip(scores["src"].values, scores["dst"].values,
                                               scores["score"].values) if str(d) == "logits"}
    want = {n: float(((x.mean(1, keepdim=True) - x) * grad).sum()) for n, x in nodes.items()}
    assert set(got) == set(want)
    for n in want:
        assert got[n] == pytest.approx(want[n], abs=1e-4 + 1e-3 * abs(want[n])), n
    assert np.abs(list(want.values())).max() > 1e-3   # not all zero


def test_one_sided_counterfactual_is_still_an_error(tiny_model):
    with pytest.raises(InputError, match="give a counterfactual"):
        ca.prompt_task(tiny_model, PROMPT, "Mary", "")
