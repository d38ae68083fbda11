"""Activation patching against plain torch hooks on the Hugging Face module (every grid kind,
both directions, three families) and against TransformerLens' patching functions where it
is installed."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from explorer import Ablate, activation_patching, load_model
from explorer._checks import InputError
from explorer.models import submodule_at
from tests._hooks import removed_after

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLEAN = [5, 17, 42, 8, 99, 3, 61]
CORRUPT = [5, 17, 43, 8, 99, 3, 61]      # one token changed, at position 2
KINDS = ("resid_pre", "attn_out", "mlp_out", "heads", "heads_by_pos")


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2", "tiny-neox"])
def model(request):
    return load_model(request.param)


def _hidden(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _module(model, kind, layer):
    """The module whose output (or, for heads, input) holds the kind's activation."""
    if kind == "resid_pre":
        return model.hf_layer(layer)
    if kind == "mlp_out":
        return submodule_at(model.hf_layer(layer), model.arch.mlp_path)
    return model.o_proj(layer)


def _capture(model, ids, kind):
    """Every layer's activation of ``kind`` for one unpadded prompt: [pos, d] per layer (the
    attention output is the output projection's output; a head's output its input)."""
    acts = {}
    hooks = []
    for layer in range(model.n_layers):
        mod = _module(model, kind, layer)

        def grab(_m, args, kwargs, out=None, layer=layer):
            value = _hidden(args, kwargs) if out is None else out
            acts[layer] = (value[0] if isinstance(value, tuple) else value)[0].detach().clone()

        if kind in ("resid_pre", "heads", "heads_by_pos"):
            hooks.append(mod.register_forward_pre_hook(grab, with_kwargs=True))
        else:
            hooks.append(mod.register_forward_hook(
                lambda m, a, k, o, grab=grab: grab(m, a, k, o), with_kwargs=True))
    with removed_after(hooks):
        model.hf(torch.tensor([ids]))
    return acts


def _last_logits(model, ids, hook=None):
    """The last position's logits of one prompt, with one torch hook in place."""
    with removed_after([hook()] if hook else []):
        return model.hf(torch.tensor([ids])).logits[0, -1].float()


def _patch_hook(model, kind, cell, source, d_head):
    """A hook that overwrites one cell of ``kind`` with ``source``'s value."""
    layer = cell[0]
    mod = _module(model, kind, layer)
    value = source[layer]

    def overwrite(x):
        x = x.clone()
        if kind in ("resid_pre", "attn_out", "mlp_out"):
            x[0, cell[1]] = value[cell[1]]
        else:
            sl = slice(cell[-1] * d_head, (cell[-1] + 1) * d_head)
            rows = slice(None) if kind == "heads" else cell[1]
            x[0, rows, sl] = value[rows, sl]
        return x

    if kind in ("resid_pre", "heads", "heads_by_pos"):
        def pre(_m, args, kwargs):
            if args:
                return (overwrite(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": overwrite(kwargs["hidden_states"])}
        return lambda: mod.register_forward_pre_hook(pre, with_kwargs=True)

    def post(_m, _a, out):
        if isinstance(out, tuple):
            return (overwrite(out[0]), *out[1:])
        return overwrite(out)
    return lambda: mod.register_forward_hook(post)


def _reference(model, kind, direction, answer, alt, clean=CLEAN, corrupt=CORRUPT):
    """The grid by hooks, one forward per cell: the normalised logit difference, the logit
    difference and the answer's probability over the cells in (layer, pos, head) order."""
    src, dst = (clean, corrupt) if direction == "denoising" else (corrupt, clean)
    source = _capture(model, src, kind)
    lds = {name: float(lg[answer] - lg[alt]) for name, lg in
           (("clean", _last_logits(model, clean)), ("corrupt", _last_logits(model, corrupt)))}
    n, heads = len(clean), range(model.spec.n_heads)
    layers = range(model.n_layers)
    cells = {"heads": [(la, h) for la in layers for h in heads],
             "heads_by_pos": [(la, p, h) for la in layers for p in range(n) for h in heads]
             }.get(kind, [(la, p) for la in layers for p in range(n)])
    ld, prob = [], []
    for cell in cells:
        lg = _last_logits(model, dst, _patch_hook(model, kind, cell, source, model.spec.d_head))
        ld.append(float(lg[answer] - lg[alt]))
        prob.append(float(torch.softmax(lg, -1)[answer]))
    ld = np.array(ld)
    return (ld - lds["corrupt"]) / (lds["clean"] - lds["corrupt"]), ld, np.array(prob)


@pytest.mark.parametrize("direction", ["denoising", "noising"])
@pytest.mark.parametrize("kind", KINDS)
def test_grid_equals_torch_hooks(model, kind, direction):
    clean_lg = _last_logits(model, CLEAN)
    answer = int(clean_lg.argmax())
    alt = int(_last_logits(model, CORRUPT).topk(2).indices[1 if
              int(_last_logits(model, CORRUPT).argmax()) == answer else 0])
    ds = activation_patching(model, CLEAN, CORRUPT, kind=kind, direction=direction,
                             batch_tokens=40)   # several batched runs per grid
    assert ds.attrs["params"]["answer_id"] == answer            # the defaults
    assert ds.attrs["params"]["alternative_id"] == alt
    effect, ld, prob = _reference(model, kind, direction, answer, alt)
    # random-init models' clean and corrupted logit differences are close, so float noise
    # of ~1e-6 in a logit is ~1e-5 in the normalised metric: atol 1e-4 there
    np.testing.assert_allclose(ds.effect.values.ravel(), effect, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ds.logit_diff.values.ravel(), ld, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ds.prob.values.ravel(), prob, rtol=1e-4, atol=1e-7)
    prob_ds = activation_patching(model, CLEAN, CORRUPT, kind=kind, direction=direction,
                                  metric="prob")
    np.testing.assert_allclose(prob_ds.effect.values.ravel(), prob, rtol=1e-4, atol=1e-7)


def test_grid_shape_coords_and_provenance(tiny_model):
    ds = activation_patching(tiny_model, CLEAN, CORRUPT, kind="resid_pre", layers=[0, 2],
                             positions=[-1, 2], answer=7, alternative=9)
    assert ds.effect.dims == ("layer", "pos")
    assert ds.layer.values.tolist() == [0, 2] and ds.pos.values.tolist() == [6, 2]
    assert ds.token_id.values.tolist() == [CLEAN[6], CLEAN[2]]
    assert ds.corrupt_token_id.values.tolist() == [CORRUPT[6], CORRUPT[2]]
    p = ds.attrs["params"]
    assert p["changed_positions"] == [2] and p["answer_id"] == 7 and p["alternative_id"] == 9
    assert (p["kind"], p["metric"], p["direction"], p["site"]) == (
        "resid_pre", "logit_diff", "denoising", "resid_pre")
    json.dumps(ds.attrs)                                        # JSON-able provenance
    # patching the whole residual at layer 0 of every changed position restores the clean
    # run exactly, and at the last layer's last position too
    np.testing.assert_allclose(ds.effect.sel(layer=0, pos=2), 1.0, rtol=1e-4)
    np.testing.assert_allclose(ds.logit_diff.sel(layer=0, pos=2), p["clean_logit_diff"],
                               rtol=1e-4)
    heads = activation_patching(tiny_model, CLEAN, CORRUPT, kind="heads", answer=7,
                                alternative=9)
    assert heads.effect.dims == ("layer", "head") and "token" not in heads.coords


def test_text_prompts_and_token_answers(tiny_model):
    tok = tiny_model.tokenizer
    clean, corrupt = "abcdef", "abxdef"
    ds = activation_patching(tiny_model, clean, corrupt, answer="q", alternative="z",
                             layers=0)
    assert ds.attrs["params"]["answer_id"] == tok("q", add_special_tokens=False)["input_ids"][0]
    assert ds.attrs["params"]["clean"] == clean and ds.attrs["params"]["corrupt"] == corrupt
    assert ds.token.values.tolist() == tiny_model.token_strings(
        tok(clean, add_special_tokens=False)["input_ids"])


def test_edits_apply_to_every_run(tiny_model):
    """Under an ablation, the grid equals the hooks' grid of the ablated model: the ablated
    runs' baselines, and patching layer 0's residual at the changed position restores
    the ablated clean run."""
    edit = Ablate(1, 2, mode="zero")
    ds = activation_patching(tiny_model, CLEAN, CORRUPT, layers=0, edits=[edit],
                             answer=7, alternative=9)
    d = tiny_model.spec.d_head

    def zero_head(_m, args):
        x = args[0].clone()
        x[..., 2 * d:3 * d] = 0.0
        return (x,)
    hook = lambda: tiny_model.o_proj(1).register_forward_pre_hook(zero_head)  # noqa: E731
    clean_lg = _last_logits(tiny_model, CLEAN, hook)
    np.testing.assert_allclose(ds.attrs["params"]["clean_logit_diff"],
                               float(clean_lg[7] - clean_lg[9]), rtol=1e-4)
    np.testing.assert_allclose(ds.logit_diff.sel(pos=2), float(clean_lg[7] - clean_lg[9]),
                               rtol=1e-4)
    assert ds.attrs["edits"] == [edit.to_dict()]


@pytest.mark.parametrize("kwargs, match", [
    (dict(corrupt=[5, 17, 43]), r"same number of tokens; clean has 7 .* corrupt has 3"),
    (dict(corrupt=CLEAN), "same tokens as `clean`"),
    (dict(corrupt=[5, 17, 10**7, 8, 99, 3, 61]), r"token id 10000000, outside \[0, "),
    (dict(layers=[7]), r"`layer` must be an int in \[0, 2\]; got 7"),
    (dict(positions=[7]), r"`positions\[0\]` must be an int in \[-7, 6\]; got 7"),
    (dict(positions=[1, -6]), "names position 1 twice"),
    (dict(kind="resid_post"), r"`kind` must be one of .*'resid_pre'"),
    (dict(metric="loss"), "`metric` must be one of"),
    (dict(direction="forward"), "`direction` must be one of"),
    (dict(answer=10**7), r"`answer` must be an int in \[0, "),
    (dict(answer=7, alternative=7), "must differ from `answer`"),
    (dict(answer="abc"), "`answer` must be one token; 'abc' is 3 tokens"),
    (dict(kind="heads", positions=[1]), "kind 'heads' patches every position"),
    (dict(edits=[Ablate(0, 0, prompts=(1,))]), "targets prompt row 1"),
])
def test_bad_input_is_refused_by_name(tiny_model, kwargs, match):
    args = {"clean": CLEAN, "corrupt": CORRUPT, **kwargs}
    with pytest.raises(InputError, match=match):
        activation_patching(tiny_model, args.pop("clean"), args.pop("corrupt"), **args)


def test_prompt_of_wrong_type_is_a_type_error(tiny_model):
    with pytest.raises(TypeError, match="`clean` must be a prompt"):
        activation_patching(tiny_model, 3.5, CORRUPT)


def test_progress_counts_every_patched_run(tiny_model):
    seen = []
    activation_patching(tiny_model, CLEAN, CORRUPT, batch_tokens=14,
                        progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (21, 21) and len(seen) > 1


# -- TransformerLens, on the same weights -----------------------------------------------

_TL_FUNCTIONS = {"resid_pre": "get_act_patch_resid_pre", "attn_out": "get_act_patch_attn_out",
                 "mlp_out": "get_act_patch_mlp_out",
                 "heads": "get_act_patch_attn_head_out_all_pos"}


@pytest.fixture(scope="module")
def bridge(model):
    pytest.importorskip("transformer_lens")
    from explorer.benches.peers import transformer_lens_bridge

    bridge, reason = transformer_lens_bridge(model)
    if reason:
        pytest.skip(reason)
    return bridge


@pytest.mark.parametrize("kind", list(_TL_FUNCTIONS))
def test_grid_equals_transformer_lens(model, bridge, kind):
    from transformer_lens import patching

    ds = activation_patching(model, CLEAN, CORRUPT, kind=kind)
    p = ds.attrs["params"]
    a, b = p["answer_id"], p["alternative_id"]
    lo, hi = p["corrupt_logit_diff"], p["clean_logit_diff"]

    def metric(logits):
        return ((logits[0, -1, a] - logits[0, -1, b]) - lo) / (hi - lo)

    _, cache = bridge.run_with_cache(torch.tensor([CLEAN]))
    theirs = getattr(patching, _TL_FUNCTIONS[kind])(bridge, torch.tensor([CORRUPT]), cache,
                                                      metric)
    np.testing.assert_allclose(ds.effect.values, theirs.numpy(), rtol=1e-4, atol=1e-5)


# -- the command line -------------------------------------------------------------------

def test_command_prints_the_grid(tiny_model, monkeypatch, capsys):
    from tests._cli import OneCommand

    run = OneCommand("patching", monkeypatch, capsys)
    out = run.json(["patching", "--model", "tiny-llama", "--clean", "abcdef", "--corrupt",
                    "abxdef", "--kind", "resid_pre", "--answer", "q", "--alt", "#9", "--json"])
    assert out["dims"] == ["layer", "pos"] and out["changed_positions"] == [2]
    assert out["coords"] == {"layer": [0, 1, 2], "pos": list(range(6))}
    assert out["answer"] == "q" and out["alternative_id"] == 9
    effect = np.array(out["effect"])
    assert effect.shape == (3, 6)
    # layer 0's residual at the changed position is all that differs there: patching it
    # restores the clean run; positions before it are the same in both runs
    np.testing.assert_allclose(effect[0, 2], 1.0, rtol=1e-4)
    assert (effect[:, :2] == 0).all()
    top = out["top"][0]
    assert abs(top["effect"]) == np.abs(effect).max()
    assert top["token"] == out["tokens"][top["pos"]] == tiny_model.token_strings(
        [tiny_model.tokenizer("abcdef", add_special_tokens=False)["input_ids"][top["pos"]]])[0]
    # the whole grid is the library's (tested against torch hooks above)
    lib = activation_patching(tiny_model, "abcdef", "abxdef", answer="q", alternative=9)
    np.testing.assert_allclose(effect, lib.effect.values, rtol=1e-6)


def test_command_refuses_prompts_of_different_lengths(monkeypatch, capsys):
    from tests._cli import OneCommand

    run = OneCommand("patching", monkeypatch, capsys)
    assert run(["patching", "--model", "tiny-llama", "--clean", "abcdef", "--corrupt",
                "abxdefg"]) == 2
    err = capsys.readouterr().err
    assert "same number of tokens; clean has 6" in err and len(err.strip().splitlines()) == 1


def test_bench_times_the_grid_against_one_forward():
    from explorer.bench import run_bench

    out = run_bench("patching", model="tiny-llama", peer=False, repeats=1, clean="abcdefg",
                    corrupt="abxdefg")
    assert out["params"]["cells"] == 3 * 7 and out["params"]["tokens"] == 7
    f = out["figures"]
    assert f["grid_vs_forward_ratio"] > 0 and f["plain_forward_ms"] > 0
    assert "peer_over_ours_ratio" not in f and out["notes"]["peer"].startswith("not measured")
