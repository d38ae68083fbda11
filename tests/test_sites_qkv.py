"""The query, key, value and MLP-neuron sites on every family, against plain torch.

The reference never goes through nnsight: torch hooks on the Hugging Face modules take the
projections' outputs (q_proj / k_proj / v_proj, GPT-2's fused c_attn, GPT-NeoX's per-head
query_key_value) and reshape them per head, then rotate queries and keys with the family's
own ``apply_rotary_pos_emb`` and the (cos, sin) the model hands its attention; the MLP's
neurons are the input of its down projection. Edits are checked the same way: the reference
writes into those tensors (the rotary call wrapped for queries and keys) and the logits of
the edited run must agree.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.interventions import Patch, Set
from explorer.models import TINY_MODELS, load_model, submodule_at
from explorer.trace import run_with, trace
from tests._hooks import removed_after

PROMPTS = ["The quick brown fox jumps over the lazy dog", "One two", "Water boils at one hundred"]
QKV = ("attn_q", "attn_k", "attn_v")
SITES = (*QKV, "mlp_hidden")
RTOL, ATOL = 1e-4, 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=TINY_MODELS)
def model(request):
    return load_model(request.param)


def attn_module(model, layer):
    return submodule_at(model.hf_layer(layer), model.arch.attn_path)


def heads_of(model, site) -> int:
    return model.spec.n_heads if site == "attn_q" else model.spec.n_kv_heads


@contextlib.contextmanager
def site_hook(model, layer: int, site: str, fn: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``fn`` on the site's live tensor in every forward of ``model.hf``: [batch, pos,
    head, d_head] for q/k/v (writing it edits the run), [batch, pos, d_mlp] for the MLP's
    neurons. Plain torch hooks on the projections; queries and keys rotated by the family's
    ``apply_rotary_pos_emb`` (from the attention module's own source module)."""
    arch, spec = model.arch, model.spec
    layer_mod = model.hf_layer(layer)
    if site == "mlp_hidden":
        down = submodule_at(layer_mod, arch.mlp_down_path)
        h = down.register_forward_pre_hook(lambda mod, args: fn(args[0]))
        with removed_after([h]):
            yield
        return
    index = QKV.index(site)
    n, dh = heads_of(model, site), spec.d_head
    if arch.qkv_layout == "separate":
        proj = submodule_at(layer_mod, arch.qkv_paths[index])
        heads = lambda out: out.view(*out.shape[:2], n, dh)  # noqa: E731
    elif arch.qkv_layout == "blocks":    # GPT-2: [q | k | v] columns of c_attn
        proj = submodule_at(layer_mod, arch.qkv_paths[0])
        heads = lambda out: out.view(*out.shape[:2], 3, n, dh)[:, :, index]  # noqa: E731
    else:                                # GPT-NeoX: [q k v] per head
        proj = submodule_at(layer_mod, arch.qkv_paths[0])
        heads = lambda out: out.view(*out.shape[:2], n, 3, dh)[:, :, :, index]  # noqa: E731
    handles = []
    if site == "attn_v" or arch.rotary_call is None:
        handles.append(proj.register_forward_hook(lambda mod, args, out: fn(heads(out))))
    else:
        # queries and keys after rotary: turn the projection's heads with the family's own
        # apply_rotary_pos_emb and the (cos, sin) the layer hands its attention; an edit is
        # turned back (the inverse rotation: -sin) into the projection's output
        attn = attn_module(model, layer)
        rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        given = {}

        def take(mod, args, kwargs):
            given["cos_sin"] = kwargs["position_embeddings"]

        def turned(mod, args, out):
            x = heads(out)                                  # [batch, pos, head, d_head] view
            cos, sin = given["cos_sin"]
            t = x.transpose(1, 2)
            y = rope(t, t, cos, sin)[0].transpose(1, 2).clone()
            before = y.clone()
            fn(y)
            if not torch.equal(y, before):
                t = y.transpose(1, 2)
                x.copy_(rope(t, t, cos, -sin)[0].transpose(1, 2))

        handles.append(attn.register_forward_pre_hook(take, with_kwargs=True))
        handles.append(proj.register_forward_hook(turned))
    with removed_after(handles):
        yield


def reference_values(model, prompt: str, layer: int, site: str) -> torch.Tensor:
    """The site of one prompt run alone (plain forward): [pos, head, d_head] or [pos, d_mlp]."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    seen = []
    with site_hook(model, layer, site, lambda x: seen.append(x[0].detach().clone())), \
            torch.no_grad():
        model.hf(input_ids=ids)
    assert len(seen) == 1
    return seen[0]


def test_rotary_reference_rotates(model):
    """The reference is not vacuous: where the family has rotary, the rotated queries differ
    from the projection's (so reading before the rotation would fail the tests below)."""
    if model.arch.rotary_call is None:
        pytest.skip("GPT-2 has no rotary embedding")
    ids = torch.tensor([model.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]])
    raw = []
    proj = submodule_at(model.hf_layer(1), model.arch.qkv_paths[0])
    with removed_after([proj.register_forward_hook(lambda m, a, o: raw.append(o[0].clone()))]), \
            torch.no_grad():
        model.hf(input_ids=ids)
    q = reference_values(model, PROMPTS[0], 1, "attn_q")           # [pos, head, d_head]
    if model.arch.qkv_layout == "per_head":
        raw_q = raw[0].view(q.shape[0], q.shape[1], 3, -1)[:, :, 0]
    else:
        raw_q = raw[0].view(q.shape)
    torch.testing.assert_close(q[0], raw_q[0], rtol=RTOL, atol=ATOL)   # position 0: no turn
    assert (q[1:] - raw_q[1:]).abs().max() > 1e-3


def test_sites_read_as_plain_torch_computes_them(model):
    ds = trace(model, PROMPTS, sites=["resid_pre", *SITES, "attn_z"])
    spec = model.spec
    assert ds.attn_q.dims == ("prompt", "pos", "layer", "head", "d_head")
    assert ds.attn_k.dims == ("prompt", "pos", "layer", "kv_head", "d_head")
    assert ds.sizes["kv_head"] == spec.n_kv_heads and ds.sizes["neuron"] == model.d_mlp
    for i, prompt in enumerate(PROMPTS):
        n = int(ds.mask[i].sum())
        for layer in range(spec.n_layers):
            for site in SITES:
                got = torch.from_numpy(ds[site].sel(layer=layer).values[i, :n])
                torch.testing.assert_close(got, reference_values(model, prompt, layer, site),
                                           rtol=RTOL, atol=ATOL)


def hooked_logits(model, batch, layer, site, fn) -> torch.Tensor:
    with site_hook(model, layer, site, fn), torch.no_grad():
        return model.hf(**batch.model_inputs()).logits


def real_rows(batch, padded) -> list[np.ndarray]:
    return [padded[i, batch.width - n:].numpy() for i, n in enumerate(batch.lengths)]


def assert_logits_match(model, edits, batch, reference) -> None:
    ds = run_with(model, PROMPTS, edits)
    clean = real_rows(batch, hooked_logits(model, batch, 0, "attn_v", lambda x: None))
    expected = real_rows(batch, reference)
    for i, n in enumerate(batch.lengths):
        np.testing.assert_allclose(ds.logits.values[i, :n], expected[i], rtol=RTOL, atol=ATOL)
    assert max(np.abs(e - c).max() for e, c in zip(expected, clean)) > 1e-4, "no effect"


@pytest.mark.parametrize("site", SITES)
def test_set_writes_the_site_as_plain_torch_does(model, site):
    batch = model.tokenize(PROMPTS)
    layer, width = 1, model.site_width(site)
    g = torch.Generator().manual_seed(QKV.index(site) if site in QKV else 9)
    vec = torch.randn(2, width, generator=g) * 3.0        # one per position, every prompt
    cols = [[batch.width - n, batch.width - 1] for n in batch.lengths]   # positions 0 and -1

    def write(x):                                         # x: [batch, pos, ...] view
        for i, (c0, c1) in enumerate(cols):
            x[i, c0] = vec[0].view(x.shape[2:])
            x[i, c1] = vec[1].view(x.shape[2:])

    reference = hooked_logits(model, batch, layer, site, write)
    assert_logits_match(model, [Set(site, layer, vec, positions=(0, -1))], batch, reference)


@pytest.mark.parametrize("site", QKV)
def test_set_one_head_adds_to_that_head_only(model, site):
    batch = model.tokenize(PROMPTS)
    layer, dh = 2, model.spec.d_head
    head = heads_of(model, site) - 1
    vec = torch.randn(dh, generator=torch.Generator().manual_seed(4)) * 3.0
    col = [batch.width - 1] * len(batch.lengths)

    def add(x):                                           # x: [batch, pos, head, d_head]
        for i in (0, 2):
            x[i, col[i], head] += vec

    reference = hooked_logits(model, batch, layer, site, add)
    edit = Set(site, layer, vec, head=head, add=True, positions=(-1,), prompts=(0, 2))
    assert_logits_match(model, [edit], batch, reference)


@pytest.mark.parametrize("site", SITES)
def test_patch_writes_the_source_run_in(model, site):
    source = "Water boils at one"
    batch = model.tokenize(PROMPTS)
    layer = 0
    src = reference_values(model, source, layer, site)    # the source run alone, plain torch

    def write(x):
        for i, n in enumerate(batch.lengths):
            x[i, batch.width - 1] = src[-1]
            x[i, batch.width - n + 1] = src[1]

    reference = hooked_logits(model, batch, layer, site, write)
    assert_logits_match(model, [Patch(site, layer, source, positions=(-1, 1))], batch, reference)


def test_head_ranges_and_widths_are_checked(model):
    kv = model.spec.n_kv_heads
    with pytest.raises(InputError, match=rf"`head` must be an int in \[0, {kv - 1}\]; got {kv}"):
        run_with(model, PROMPTS, [Set("attn_k", 0, (0.0,) * model.spec.d_head, head=kv)])
    with pytest.raises(InputError, match=rf"whole number of {model.d_mlp}-wide vectors"):
        run_with(model, PROMPTS, [Set("mlp_hidden", 0, (0.0,) * model.spec.d_model)])
    with pytest.raises(InputError, match=r"`head` applies to the head sites"):
        Set("mlp_hidden", 0, (0.0,), head=0)
