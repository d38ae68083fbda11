"""Remote (NDIF) runs against the loopback server: nnsight's real client protocol end to end.

The server (`explorer.ndif_server`) runs in a child process on 127.0.0.1, serves a saved
tiny-llama folder with nnsight's own server-side code, and hides the explorer package from
the jobs it runs (as on NDIF, where explorer is not installed). Every remote result is
compared with the same call on the same folder loaded locally, which is the independent
computation: a plain local forward with the same weights.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import numpy as np
import panel as pn
import pytest
import torch

from explorer import Ablate, Patch, Steer, load_model, run_with, trace
from explorer._checks import ExplorerError, RemoteError
from explorer.remote import (
    RemoteCancelledError,
    RemoteTimeoutError,
    redact,
    remote_config,
    remote_run,
    run_remote_async,
)

# a server in a child process, models saved and traced remotely: over a minute of CPU in all
pytestmark = pytest.mark.slow

API_KEY = "ndif-test-key-7f3a9c2e51"
PROMPTS = ["The quick brown fox", "The capital of France is Paris"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = load_model("tiny-llama")
    path = tmp_path_factory.mktemp("tiny-llama-folder")
    model.hf.save_pretrained(path)
    model.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(folder):
    from explorer.ndif_server import LoopbackServer

    with LoopbackServer(folder, api_key=API_KEY) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        yield srv


@pytest.fixture(scope="module")
def env(server):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NDIF_API_KEY", API_KEY)
        mp.setenv("NDIF_HOST", server.url)
        yield mp


@pytest.fixture(scope="module")
def remote_model(env, folder):
    return load_model(folder, remote=True)


@pytest.fixture(scope="module")
def local_model(folder):
    return load_model(folder)


@pytest.fixture()
def queue_delay(server):
    """Let jobs sit in QUEUED for a while (reset afterwards)."""
    def set_delay(seconds):
        server.set_queue_delay(seconds)
    yield set_delay
    server.set_queue_delay(0)


def _equal(a, b):
    return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


# -- results: remote equals local, bit for bit ---------------------------------------------

def test_remote_model_is_meta_and_keyed_by_folder(remote_model, folder):
    assert remote_model.remote
    assert next(remote_model.hf.parameters()).device.type == "meta"
    key = remote_model.nn.to_model_key()
    assert key.startswith("nnsight.modeling.transformers.TransformersModel:")
    assert json.loads(key.split(":", 1)[1])["repo_id"] == str(folder.resolve())


def test_trace_resid_post_matches_local(remote_model, local_model):
    remote = trace(remote_model, PROMPTS, sites=["resid_post", "attn_pattern", "unembed"])
    local = trace(local_model, PROMPTS, sites=["resid_post", "attn_pattern", "unembed"])
    for site in ("resid_post", "attn_pattern", "unembed"):
        assert _equal(remote[site], local[site]), site
    # and both agree with plain torch forward hooks on the decoder layers
    batch = local_model.tokenize(PROMPTS)
    outputs = {}
    hooks = [block.register_forward_hook(
        lambda mod, args, out, layer=layer: outputs.__setitem__(
            layer, out[0] if isinstance(out, tuple) else out))
        for layer, block in enumerate(local_model.hf.model.layers)]
    try:
        local_model.hf(**batch.model_inputs())
    finally:
        for hook in hooks:
            hook.remove()
    for i, n in enumerate(batch.lengths):
        for layer in range(local_model.n_layers):
            expect = outputs[layer][i, batch.width - n:].numpy()
            np.testing.assert_allclose(remote.resid_post.values[i, :n, layer], expect,
                                       rtol=1e-5, atol=1e-5)


def test_run_with_ablate_and_steer_matches_local(remote_model, local_model):
    rng = np.random.default_rng(0)
    edits = [Ablate(layer=1, head=2),
             Steer(layer=0, vector=rng.normal(size=64), alpha=2.0, positions=(-1,)),
             Ablate(layer=2, head=0, mode="mean")]
    remote = run_with(remote_model, PROMPTS, edits, sites=["resid_post", "attn_z"])
    local = run_with(local_model, PROMPTS, edits, sites=["resid_post", "attn_z"])
    clean = run_with(local_model, PROMPTS, [], sites=["attn_z"])
    for name in ("logits", "resid_post", "attn_z"):
        assert _equal(remote[name], local[name]), name
    assert np.nanmax(np.abs(remote.logits.values - clean.logits.values)) > 1e-3  # edits acted
    assert np.all(remote.attn_z.sel(layer=1, head=2).fillna(0).values == 0)  # zero ablation
    assert remote.attrs["edits"] == local.attrs["edits"]


def test_patch_matches_local(remote_model, local_model):
    edits = [Patch(site="resid_pre", layer=1, source="Paris is", positions=(-1,))]
    prompts = ["The quick brown fox", "One two three"]
    remote = run_with(remote_model, prompts, edits)
    local = run_with(local_model, prompts, edits)
    assert _equal(remote.logits, local.logits)


def test_head_out_is_computed_in_the_remote_trace(remote_model, local_model):
    """head_out needs W_O, which a remote (meta-device) model does not hold: the trace makes it."""
    remote = trace(remote_model, PROMPTS, sites=["head_out"], layers=[0, 2])
    local = trace(local_model, PROMPTS, sites=["head_out", "attn_z"], layers=[0, 2])
    assert _equal(remote.head_out, local.head_out)
    # independent: z of each head through its slice of o_proj's weight, with plain torch
    for layer in (0, 2):
        w = local_model.hf.model.layers[layer].self_attn.o_proj.weight.detach()  # [d, h*dh]
        w = w.T.reshape(local_model.spec.n_heads, local_model.spec.d_head, -1)
        z = torch.from_numpy(np.nan_to_num(local.attn_z.sel(layer=layer).values))
        expect = torch.einsum("pshd,hdm->pshm", z, w).numpy()
        got = np.nan_to_num(remote.head_out.sel(layer=layer).values)
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)


def test_logit_lens_is_reduced_in_the_remote_trace(remote_model, local_model):
    from explorer import logit_lens
    from explorer._checks import InputError
    from explorer.trace import clean_run

    edits = [Steer(layer=1, vector=np.linspace(-1, 1, 64), alpha=3.0)]
    remote = logit_lens(remote_model, PROMPTS, k=3, edits=edits)
    local = logit_lens(local_model, PROMPTS, k=3, edits=edits)
    assert remote.attrs["params"]["readout"] == "in-trace"
    for name in ("top_token_id", "final_rank"):
        assert np.array_equal(remote[name].values, local[name].values), name
    for name in ("top_prob", "final_prob"):
        np.testing.assert_allclose(remote[name].values, local[name].values, rtol=1e-4,
                                   atol=1e-6, err_msg=name)
    capped = logit_lens(remote_model, PROMPTS[:1], k=3, rank_cap=2, positions=[-1])
    assert capped.final_rank.values.max() <= 2
    with pytest.raises(InputError, match="remote model"):
        logit_lens(remote_model, PROMPTS, k=3, resume=clean_run(local_model, PROMPTS))


def test_head_scores_are_reduced_in_the_remote_trace(remote_model, local_model):
    """The conflicts head scores need W_O and W_U, which a remote model does not hold: the
    per-head logit split runs inside the trace, and only [prompt, pos, layer, head, 2]
    scalars come back. Remote equals local bit for bit (the local split is checked against
    a hand computation in tests/test_trace.py)."""
    from explorer.analyses.conflicts import head_context_memory_scores, load_facts

    facts = load_facts()[:3]
    remote = head_context_memory_scores(remote_model, facts, kinds=["substitution"],
                                        ablation=False)
    local = head_context_memory_scores(local_model, facts, kinds=["substitution"],
                                       ablation=False)
    for name in remote.data_vars:
        assert _equal(remote[name].values, local[name].values), name


def test_saturation_lens_pass_is_reduced_in_the_remote_trace(remote_model, local_model):
    """Saturation's lens pass on a remote model: top-k lists, ranks, cosines and the
    sampled residuals come from inside the trace (exact rank counts on the server) and
    equal the local pass (top-k lists of the float32 lens, ranks read off them)."""
    from explorer.analyses.saturation import inject_residual, saturation_layers

    texts = [*PROMPTS, "A b c d e f g"]
    kw = dict(k=3, rank_cap=6, sample_positions=5, batch_size=2, seed=1)
    remote = saturation_layers(remote_model, texts, **kw)
    local = saturation_layers(local_model, texts, **kw)
    for name in ("sat_layer", "final_rank", "top_token_id", "mask"):
        assert _equal(remote[name].values, local[name].values), name
    assert _equal(remote.final_token_id.values, local.final_token_id.values)
    assert _equal(remote.sample_pos.values, local.sample_pos.values)
    for name in ("top_prob", "cosine", "resid_sample"):
        np.testing.assert_allclose(remote[name].values, local[name].values, rtol=1e-4,
                                   atol=1e-5, err_msg=name)
    # the injection runs without a clean run to resume from, lens reduced remotely
    args = dict(source_pos=1, target_pos=3, layer=1)
    got = inject_residual(remote_model, PROMPTS[1], **args)
    expect = inject_residual(local_model, PROMPTS[1], **args)
    assert got == expect


def test_saturation_analysis_runs_remotely(remote_model, local_model):
    """The whole analysis (lens pass, order test, probe, early exit, injections) on the
    remote model equals the same analysis run locally."""
    from explorer.analyses.saturation import saturation_analysis

    texts = ["the cat the cat the cat the dog the cat the dog the cat the dog the cat",
             "The capital of France is Paris, and the capital of Spain is Madrid"]
    kw = dict(k=3, rank_cap=6, n_permutations=20, sample_positions=12, n_pairs=2, min_gap=1,
              max_ratio=1.0, min_sat_layer=0, window=1, seed=0)
    remote = saturation_analysis(remote_model, texts, **kw)
    local = saturation_analysis(local_model, texts, **kw)
    assert remote.sizes["pair"] == 2 and (remote.inj_layer.values >= 0).any()  # injected
    assert set(remote.data_vars) == set(local.data_vars)
    for name in remote.data_vars:
        a, b = remote[name].values, local[name].values
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
        elif a.dtype.kind in "OUS":
            assert np.array_equal(a, b), name
        else:
            assert _equal(a, b), name


# -- status, time limit, cancellation, disconnects -----------------------------------------

def test_run_on_weights_runs_on_the_served_weights(remote_model, local_model):
    """`run_on_weights` calls explorer code on the server's module tree: the output
    projection read there is the saved folder's (the client model is meta), and a function
    that calls modules (the logit lens) gives the local result."""
    from explorer.models import Model
    from explorer.trace import run_on_weights

    w_o = run_on_weights(remote_model, Model.W_O, 1)
    assert w_o.device.type == "cpu"
    expect = local_model.hf.model.layers[1].self_attn.o_proj.weight.detach().T.reshape(
        local_model.spec.n_heads, local_model.spec.d_head, -1)
    assert torch.equal(w_o, expect)
    x = torch.randn(2, 3, local_model.spec.d_model, generator=torch.Generator().manual_seed(0))
    assert torch.equal(run_on_weights(remote_model, Model.lens_logits, x),
                       local_model.lens_logits(x))
    # the stood-down trace left the model's own forward alone: a trace after it still matches
    assert _equal(trace(remote_model, PROMPTS[:1]).resid_post,
                  trace(local_model, PROMPTS[:1]).resid_post)


def test_function_vector_reads_w_o_on_the_server(remote_model, local_model):
    """A function vector needs the heads' W_O slices, which a meta model does not hold; they
    are read on the server, and the vector equals mean z times the saved folder's W_O."""
    from explorer.analyses import task_vectors as tv

    rng = np.random.default_rng(0)
    mean_z = rng.normal(size=(local_model.n_layers, local_model.spec.n_heads,
                              local_model.spec.d_head))
    heads = [(0, 1), (2, 3), (1, 0)]
    got = tv.function_vector(remote_model, mean_z, heads)
    assert np.array_equal(got, tv.function_vector(local_model, mean_z, heads))
    expect = np.zeros(local_model.spec.d_model)
    for layer, head in heads:  # o_proj weight [d_model, head*d_head], this head's columns
        w = local_model.hf.model.layers[layer].self_attn.o_proj.weight.detach().double()
        d = local_model.spec.d_head
        expect += w[:, head * d:(head + 1) * d].numpy() @ mean_z[layer, head]
    np.testing.assert_allclose(got, expect, rtol=1e-10, atol=1e-10)


def test_fv_scores_last_token_path_runs_on_the_server(remote_model, local_model):
    """FV scores' last-token path on a remote model: each task's runs are one NDIF session
    (the key/value cache of the earlier positions kept on the server, each chunk's trace
    over a copy of it), and the scores equal the local last-token path bit for bit
    (tests/test_icl_heads.py checks it against per-head traces)."""
    from explorer._checks import InputError
    from explorer.analyses import icl_heads as ih

    remote = ih.fv_scores(remote_model, ["antonym"], n_prompts=3, n_shots=2, max_rows=8)
    local = ih.fv_scores(local_model, ["antonym"], n_prompts=3, n_shots=2, max_rows=8)
    assert remote.attrs["params"]["fv_method"] == local.attrs["params"]["fv_method"] == "last_token"
    for name in ("fv_score", "indirect_effect", "mean_z", "clean_prob", "corrupted_prob"):
        assert _equal(remote[name], local[name]), name
    assert np.abs(local.indirect_effect.values).max() > 0
    with pytest.raises(InputError, match="runs it on the server"):
        ih.last_token_cache(remote_model, remote_model.tokenize(["a b c", "d e f"]))


def test_runs_over_a_key_value_prefix_run_in_one_session(remote_model, local_model):
    """`runs_over_prefix` on a remote model: the prefix's cache stays on the server, in one
    NDIF session with every run (copies of the prompts, edits at the last token, saved
    sites), and the readouts equal the local runs bit for bit; a bad edit is refused before
    anything is sent."""
    from explorer._checks import InputError
    from explorer.trace import TraceRequest, runs_over_prefix

    prompts = ["The quick brown fox jumps", "One two", "The capital of France is Paris"]
    n, dh = len(prompts), local_model.spec.d_head
    read = TraceRequest(save={(1, "resid_post"), (2, "attn_z")}, save_positions=[-1])
    runs = [(1, [], read),
            (2, [Ablate(1, 2, mode="mean", value=[0.3] * dh, positions=(-1,),
                        prompts=tuple(range(n, 2 * n)))], read),
            (1, [Steer(0, np.linspace(-1, 1, local_model.spec.d_model), positions=(-1,))],
             TraceRequest(save_positions=[-1]))]
    remote = runs_over_prefix(remote_model, prompts, runs)
    local = runs_over_prefix(local_model, prompts, runs)
    assert [sorted(map(str, r)) for r in remote] == [sorted(map(str, r)) for r in local]
    for r, lo in zip(remote, local):
        for key in lo:
            assert torch.equal(r[key], lo[key]), key
    assert remote[1]["logits"].shape == (2 * n, 1, local_model.vocab_size)
    assert not torch.equal(remote[1]["logits"][:n], remote[1]["logits"][n:])
    with pytest.raises(InputError, match=r"positions=\(-1,\)"):
        runs_over_prefix(remote_model, prompts, [(1, [Steer(0, [0.0] * 64)], read)])


def test_local_only_trace_features_refuse_a_remote_model(remote_model, local_model):
    """A key/value prefix (and its cache readout) and a trace over a module copy need the
    weights here: on a remote model each is a clear error."""
    from explorer._checks import InputError
    from explorer.trace import key_value_prefix, run_batch

    batch = remote_model.tokenize(["a b c", "d e f"])
    with pytest.raises(InputError, match="a key/value prefix trains or reads a copy"):
        key_value_prefix(remote_model, batch)
    with pytest.raises(InputError, match="a key/value cache readout"):
        run_batch(remote_model, batch, kv_cache=True)
    with pytest.raises(InputError, match="weights are on the server"):
        remote_model.over(local_model.hf)


def test_circuits_run_on_the_server(remote_model, local_model):
    """EAP and EAP-IG edge scores, the faithfulness curve and one circuit's patched metric
    on a remote model: each batch's per-head forward, backward and edge patching runs on the
    server, and only scores and sums come back. Remote equals local bit for bit (the local
    circuit forward is checked against the Hugging Face logits and hand-worked scores in
    tests/test_circuits.py)."""
    from explorer.analyses import circuits as ca

    task = ca.make_task("add", 5, seed=1)
    with torch.enable_grad():
        for method, metric in (("eap", "logit_diff"), ("eap-ig", "kl")):
            remote = ca.edge_scores(remote_model, task, method=method, steps=2, metric=metric,
                                    batch_size=3)
            local = ca.edge_scores(local_model, task, method=method, steps=2, metric=metric,
                                   batch_size=3)
            assert _equal(remote.score, local.score), method
            assert np.abs(local.score.values).max() > 0
            for key in ("clean_metric", "corrupt_metric", "n_layers", "n_heads"):
                assert remote.attrs[key] == local.attrs[key], key
    n = local.sizes["edge"]
    curve_r = ca.faithfulness_curve(remote_model, task, remote, sizes=[0, 10, n], batch_size=3)
    curve_l = ca.faithfulness_curve(local_model, task, local, sizes=[0, 10, n], batch_size=3)
    for name in curve_l.data_vars:
        assert _equal(curve_r[name], curve_l[name]), name
    # all edges kept gives the clean run, none the corrupted one
    assert curve_r.recovered.values[-1] == pytest.approx(1.0, abs=1e-5)
    assert curve_r.recovered.values[0] == pytest.approx(0.0, abs=1e-5)
    keep = ca.select_circuit(remote, top_n=12)
    assert (ca.patch_edges_metric(remote_model, task, remote, keep, batch_size=3)
            == ca.patch_edges_metric(local_model, task, local, keep, batch_size=3))


def test_gpt2_circuit_scores_run_on_the_server(tmp_path, monkeypatch):
    """The other circuit family (GPT-2: Conv1D projections, learned positions, LayerNorm)
    served by its own loopback server: remote EAP-IG scores equal local ones bit for bit."""
    from explorer.analyses import circuits as ca
    from explorer.ndif_server import LoopbackServer

    model = load_model("tiny-gpt2")
    model.hf.save_pretrained(tmp_path)
    model.tokenizer.save_pretrained(tmp_path)
    local = load_model(tmp_path)
    task = ca.make_task("add", 4, seed=0)
    with LoopbackServer(tmp_path, api_key=API_KEY) as srv:
        monkeypatch.setenv("NDIF_API_KEY", API_KEY)
        monkeypatch.setenv("NDIF_HOST", srv.url)
        remote_model = load_model(tmp_path, remote=True)
        with torch.enable_grad():
            remote = ca.edge_scores(remote_model, task, method="eap-ig", steps=2, batch_size=4)
            expect = ca.edge_scores(local, task, method="eap-ig", steps=2, batch_size=4)
    assert _equal(remote.score, expect.score) and np.abs(expect.score.values).max() > 0


def _tiny_fact_file(folder, names):
    """A fact file whose attributes start with distinct tokens for the tiny tokenizer."""
    attrs = ["blue", "dog", "moon"]
    path = folder / "facts.json"
    path.write_text(json.dumps({
        "attributes": attrs, "templates": {"trained": "Fact: {subject} likes the",
                                           "mc": "Q: {subject} likes? {options}\nA:"},
        "facts": [[f"Person {n}", attrs[i % 3]] for i, n in enumerate(names)]}))
    return path


def test_causal_tracing_runs_on_the_server(remote_model, local_model, tmp_path):
    """The unlearning lab's localisation on a remote model: causal tracing (hooked runs that
    restore clean states) and attribution patching (one trace with gradient readouts, in an
    NDIF session that turns gradient tracking on) run on the server, and equal the local
    results bit for bit (both are checked against hand-written torch hooks in
    tests/test_unlearning.py)."""
    from explorer.analyses import unlearning as U

    facts = U.load_attribute_facts(_tiny_fact_file(tmp_path, ["A", "B", "C"]))
    remote = U.causal_trace(remote_model, facts, positions=[-1, -2])
    local = U.causal_trace(local_model, facts, positions=[-1, -2])
    for name in ("restore_resid", "restore_mlp", "p_clean", "p_corrupt"):
        assert _equal(remote[name], local[name]), name
    assert remote.attrs["params"]["noise_std"] == local.attrs["params"]["noise_std"]
    with torch.enable_grad():
        ap_remote = U.attribution_patching(remote_model, facts)
        ap_local = U.attribution_patching(local_model, facts)
    assert _equal(ap_remote.ap_mlp, ap_local.ap_mlp) and np.abs(ap_local.ap_mlp.values).max() > 0
    assert _equal(ap_remote.ap_head, ap_local.ap_head) and np.abs(ap_local.ap_head.values).max() > 0


def test_lora_finetuning_runs_on_the_server(remote_model, local_model, tmp_path, monkeypatch):
    """CircuitLoRA's fine-tuning on a remote model: the adapters live in the jobs (hooks on
    the served modules), start from peft's draws, and the run equals the local peft run bit
    for bit (losses, every checkpoint). The served weights are untouched afterwards. The
    checkpoints' accuracy and circuits are computed on the server with the adapters."""
    from safetensors.torch import load_file

    from explorer import lora as lora_module
    from explorer.analyses import circuit_lora as cl
    from explorer.analyses import circuits as ca

    monkeypatch.setattr(lora_module, "STEPS_PER_JOB", 2)
    task = ca.make_task("add", 6, seed=0)
    kw = dict(ranks={0: 2, 2: 3}, steps=5, batch_size=3, lr=5e-2, seed=2, checkpoints=[0, 3, 5])
    with torch.enable_grad(), remote_run(remote_model) as run:
        ds_r, lora_r = cl.finetune_lora(remote_model, task.clean, task.answer,
                                        folder=tmp_path / "r", **kw)
    assert len(run.job_ids) == 4  # steps 1-2, 3 (a checkpoint), 4, 5
    with torch.enable_grad():
        ds_l, peft_l = cl.finetune_lora(local_model, task.clean, task.answer,
                                        folder=tmp_path / "l", **kw)
    assert _equal(ds_r["loss"], ds_l["loss"]) and _equal(ds_r["lr"], ds_l["lr"])
    assert ds_r.attrs["trainable_params"] == ds_l.attrs["trainable_params"]
    for step in (0, 3, 5):
        r = load_file(str(tmp_path / "r" / f"step-{step}.safetensors"))
        lo = load_file(str(tmp_path / "l" / f"step-{step}.safetensors"))
        assert list(r) == list(lo) and all(torch.equal(r[k], lo[k]) for k in r), step
    # the served weights did not move: a remote run still equals the saved folder's
    assert _equal(trace(remote_model, PROMPTS).resid_post, trace(local_model, PROMPTS).resid_post)

    acc_r = cl.answer_accuracy(remote_model, task.clean, task.answer, hf=lora_r)
    acc_l = cl.answer_accuracy(local_model, task.clean, task.answer, hf=lora_r)
    acc_peft = cl.answer_accuracy(local_model, task.clean, task.answer, hf=peft_l)
    assert _equal(acc_r.answer_loss, acc_l.answer_loss)
    np.testing.assert_allclose(acc_r.answer_loss.values, acc_peft.answer_loss.values, rtol=1e-6)
    base_r = cl.answer_accuracy(remote_model, task.clean, task.answer)
    base_l = cl.answer_accuracy(local_model, task.clean, task.answer)
    assert _equal(base_r.answer_loss, base_l.answer_loss)
    assert not _equal(base_r.answer_loss, acc_r.answer_loss)

    with torch.enable_grad():
        lora5 = cl.read_checkpoint(remote_model, tmp_path / "r", 5)
        s_r = ca.edge_scores(remote_model, task, method="eap-ig", steps=2, lora=lora5)
        s_l = ca.edge_scores(local_model, task, method="eap-ig", steps=2, lora=lora5)
        assert _equal(s_r.score, s_l.score)
        ck_r = cl.checkpoint_circuits(remote_model, tmp_path / "r", task, steps=[0, 5])
        ck_l = cl.checkpoint_circuits(local_model, tmp_path / "l", task, steps=[0, 5])
    np.testing.assert_allclose(ck_r.score.values, ck_l.score.values, rtol=1e-4,
                               atol=1e-3 * np.abs(ck_l.score.values).max())
    assert _equal(ck_r.in_circuit, ck_l.in_circuit)
    with pytest.raises(ExplorerError, match="use read_checkpoint"):
        cl.load_checkpoint(remote_model, tmp_path / "r", 5)


def test_icl_finetuning_runs_on_the_server(remote_model, local_model):
    """Early- vs late-layer LoRA on a remote model: the adapters train on the server and
    task decodability of each tuned variant is read there with the adapters hooked. The
    whole result equals the local run with the same (hooks) engine bit for bit."""
    from explorer.analyses import icl_finetune as ft

    kw = dict(n_layers_tuned=1, steps=2, n_prompts=4, n_shots=2, k=3, batch_size=2)
    tasks = ["antonym", "uppercase"]
    remote = ft.early_late_finetune(remote_model, tasks, **kw)
    local = ft.early_late_finetune(local_model, tasks, engine="hooks", **kw)
    for name in ("td", "task_td", "accuracy", "task_accuracy", "train_loss", "n_trainable"):
        assert _equal(remote[name], local[name]), name
    assert remote.attrs["task"] == local.attrs["task"]
    assert np.isfinite(remote.train_loss.sel(variant=["early", "late"])).all()
    with pytest.raises(ExplorerError, match="remote"):
        ft.LayerLoRA([0], engine="peft", steps=1).fit(remote_model, "uppercase")


def test_unlearning_trains_on_the_server(remote_model, local_model, tmp_path, monkeypatch):
    """Unlearning on a remote model: the MLP updates are held in the jobs and hooked, and
    equal the same path run locally bit for bit; the whole comparison matches the local
    one, which trains a copy of the weights, to float rounding. The served weights do not
    move. Method 'all' and the relearning attack, which train every parameter, refuse."""
    from explorer import lora as lora_jobs
    from explorer.analyses import unlearning as U

    monkeypatch.setattr(lora_jobs, "STEPS_PER_JOB", 2)
    facts = U.load_attribute_facts(_tiny_fact_file(tmp_path, [a + b for a in "ABCD" for b in "xyz"]))
    fo, re_ = U.split_facts(facts, 4, 4)
    names = sorted(U.component_parameters(local_model, "fact_lookup", [1]))
    args = dict(objective="unlearn", steps=3, lr=1e-2, retain_weight=1.0, clip=1.0,
                progress=None, should_stop=None)
    with remote_run(remote_model) as run:
        d_r, loss_r = U._finetune_by_deltas(remote_model, fo, re_, names, **args)
    assert len(run.job_ids) == 2  # steps 1-2, 3
    d_l, loss_l = U._finetune_by_deltas(local_model, fo, re_, names, **args)
    assert loss_r == loss_l
    assert all(torch.equal(d_r.deltas[n], d_l.deltas[n]) for n in names)
    assert _equal(U.format_accuracy(remote_model, fo, "mc", hf=d_r)[1],
                  U.format_accuracy(local_model, fo, "mc", hf=d_l)[1])
    assert _equal(trace(remote_model, PROMPTS).resid_post, trace(local_model, PROMPTS).resid_post)

    probe = U.attribute_probe_curve(local_model, facts, n_folds=3)
    kw = dict(methods=["fact_lookup", "random"], n_layers=1, steps=3, lr=1e-2, relearn_steps=0,
              probe=probe)
    remote = U.unlearning_comparison(remote_model, fo, re_, **kw)
    local = U.unlearning_comparison(local_model, fo, re_, **kw)
    np.testing.assert_array_equal(remote.accuracy.values, local.accuracy.values)
    np.testing.assert_allclose(remote.loss.values, local.loss.values, rtol=1e-4)
    assert _equal(remote.n_params, local.n_params)
    with pytest.raises(ExplorerError, match="relearning attack fine-tunes every parameter"):
        U.unlearning_comparison(remote_model, fo, re_, methods=["fact_lookup"], probe=probe,
                                relearn_steps=1)
    with pytest.raises(ExplorerError, match="method 'all' trains every parameter"):
        U.unlearning_comparison(remote_model, fo, re_, methods=["all"], relearn_steps=0)


def test_itda_page_on_a_remote_model(env, remote_model, local_model, tmp_path, monkeypatch):
    """The ITDA page on a remote model builds the same dictionary as on the local one; with
    no second model given it cannot perturb weights it does not hold, so it shows no
    similarity heatmap and says why (and hides the noise slider), instead of failing."""
    from apps.itda import ITDAView

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    remote = ITDAView(remote_model, background=False)
    local = ITDAView(local_model, background=False, other=local_model)
    assert remote.error == "" and remote.n_atoms == local.n_atoms > 0
    assert remote.summary.split(" · built")[0] == local.summary.split(" · built")[0]
    remote.compare = True                                   # the button does nothing here
    assert remote.similarity is None and remote.param.noise.precedence == -1
    assert "remote model has no weights on this machine" in remote.similarity_status
    # with a second model given, the remote page compares layers as the local one does
    both = ITDAView(remote_model, background=False, other=remote_model)
    both.compare = local.compare = True
    assert both.error == "" and _equal(both.similarity["similarity"],
                                       local.similarity["similarity"])


def test_cli_runs_an_analysis_remotely(env, folder, local_model, capsys):
    """`--remote` on an analysis command: `explorer circuits --remote` prints what the same
    command prints for the local folder (scores, circuit, faithfulness)."""
    from explorer import cli

    args = ["circuits", "--model", str(folder), "--n", "4", "--all-prompts", "--method", "eap",
            "--sizes", "0,10", "--batch-size", "2", "--json"]
    with torch.enable_grad():
        assert cli.main([*args, "--remote"]) == 0
        remote = json.loads(capsys.readouterr().out)
        assert cli.main(args) == 0
        local = json.loads(capsys.readouterr().out)
    assert remote == local and remote["top_edges"]


def test_cli_trains_remotely(env, folder, tmp_path, capsys):
    """The training commands on `--remote`: `explorer icl-finetune --remote` prints what the
    local hooks engine prints; `explorer unlearn --remote` with its defaults stops with the
    one-line reason (the relearning attack trains every parameter)."""
    from explorer import cli

    args = ["icl-finetune", "--model", str(folder), "--tasks", "antonym,uppercase", "--steps",
            "2", "--n-prompts", "4", "--n-shots", "2", "--k", "3", "--batch-size", "2",
            "--json"]
    facts = _tiny_fact_file(tmp_path, [a + b for a in "ABCD" for b in "xyz"])
    threads = torch.get_num_threads()
    try:  # both commands set torch's thread count; later tests compare at the server's
        assert cli.main([*args, "--remote"]) == 0
        remote = json.loads(capsys.readouterr().out)
        assert cli.main([*args, "--engine", "hooks"]) == 0
        local = json.loads(capsys.readouterr().out)
        code = cli.main(["unlearn", "--model", str(folder), "--remote", "--facts", str(facts),
                         "--all-facts", "--n-forget", "4", "--n-retain", "2"])
    finally:
        torch.set_num_threads(threads)
    assert remote == local and remote["early"]["n_trainable"] > 0
    assert code == 2
    err = capsys.readouterr().err
    assert "relearning attack" in err and "--relearn-steps 0" in err and API_KEY not in err


def test_unlearning_page_runs_on_a_remote_model(env, remote_model, tmp_path, monkeypatch):
    """The Unlearning page on a remote model: Localize (probe, causal tracing, attribution
    patching) and Run unlearning both run on the server. The page offers no method 'all'
    and no relearning attack there (both train every parameter), and says so on the Run
    button; a local page keeps both."""
    from apps.unlearning import UnlearningView

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    path = _tiny_fact_file(tmp_path, [a + b for a in "ABCD" for b in "xyz"])
    view = UnlearningView(remote_model, facts_file=path, known_only=False, background=False,
                          n_forget=3, n_retain=3, n_layers=1, steps=2)
    assert "all" not in view.param.method.objects and view.relearn_steps == 0
    assert "relearning attack" in view._remote_note and "on the server" in view._run_button.description
    notes = [m.object for m in view.__panel__().select(pn.pane.Markdown) if m.visible]
    assert view._remote_note in notes
    view.localize()
    assert view.probe is not None and view.trace is not None and view.attribution is not None
    assert not view._run_button.disabled and not view._localize_button.disabled
    view.run()
    assert view.result is not None, view.status
    assert view.result["localization"].values.tolist() == ["original", "fact_lookup"]
    assert "trained" in view.status
    local = UnlearningView(load_model("tiny-llama"), facts_file=path, known_only=False,
                           background=False)
    assert "all" in local.param.method.objects and local.relearn_steps == 3
    assert local._remote_note == ""


def test_circuits_page_on_a_remote_model(env, remote_model, local_model, tmp_path, monkeypatch):
    """The Circuits page scores and draws the circuit of a remote model (the same as the
    local page's), and its fine-tune button trains LoRA adapters on the server and scores
    each checkpoint there: the checkpoints' scores equal the local page's (which trains a
    peft copy and merges each checkpoint) to float rounding, and the circuits are the same."""
    from apps.circuits import CircuitsView

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    with torch.enable_grad():
        remote = CircuitsView(remote_model, background=False, n_prompts=4,
                              run_folder=str(tmp_path / "remote-run"))
        local = CircuitsView(local_model, background=False, n_prompts=4,
                             run_folder=str(tmp_path / "local-run"))
    assert _equal(remote.scores.score, local.scores.score)
    assert _equal(remote.curve.recovered, local.curve.recovered)
    for view in (remote, local):
        view.n_edges = 30
        view._edges_plot()
    assert remote._table["edge"].tolist() == local._table["edge"].tolist()
    buttons = {b.name: b for b in remote.__panel__().select(pn.widgets.Button)}
    assert not buttons["Fine-tune (LoRA) and score checkpoints"].disabled
    with torch.enable_grad():
        for view in (remote, local):
            view.ft_steps = 3
            view._request_finetune()
            assert view.error == "", view.error
    r, lo = remote.checkpoints, local.checkpoints
    assert r["checkpoint"].values.tolist() == lo["checkpoint"].values.tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(r.score.values, lo.score.values, rtol=1e-4, atol=1e-7)
    assert not np.array_equal(r.score.values[0], r.score.values[-1])  # training changed them
    assert _equal(r.in_circuit, lo.in_circuit)


def test_status_updates_reach_the_callback(remote_model):
    seen = []
    with remote_run(remote_model, on_status=seen.append) as run:
        trace(remote_model, PROMPTS[:1])
    statuses = [s.status for s in seen]
    assert statuses[0] == "RECEIVED" and statuses[-1] == "COMPLETED"
    assert "RUNNING" in statuses
    assert run.status == "COMPLETED" and len(run.job_ids) == 1


@pytest.mark.timing
def test_timeout_is_a_clear_error(remote_model, server, queue_delay):
    queue_delay(30)
    start = time.monotonic()
    with remote_run(remote_model, timeout_s=0.5) as run:
        with pytest.raises(RemoteTimeoutError, match=r"did not complete within 0\.5 s "
                                                     r"\(last status: (RECEIVED|QUEUED)\)"):
            trace(remote_model, PROMPTS[:1])
    assert time.monotonic() - start < 20   # the job waits 30 s in the queue: not waited for
    assert isinstance(RemoteTimeoutError("x"), ExplorerError)
    _wait_for_server_status(server, run.job_ids[-1], "ERROR")  # the server dropped it


@pytest.mark.timing
def test_cancel_stops_a_queued_job(remote_model, server, queue_delay):
    queue_delay(30)
    errors, runs, queued = [], [], threading.Event()

    def work():  # an app's worker thread; the main thread presses "stop"
        on_status = lambda s: s.status == "QUEUED" and queued.set()  # noqa: E731
        with remote_run(remote_model, on_status=on_status) as run:
            runs.append(run)
            _capture(errors, trace, remote_model, PROMPTS)

    worker = threading.Thread(target=work)
    start = time.monotonic()
    worker.start()
    assert queued.wait(20)
    runs[0].cancel()
    worker.join(timeout=20)
    assert not worker.is_alive()
    assert time.monotonic() - start < 20   # the job waits 30 s in the queue: not waited for
    assert len(errors) == 1 and isinstance(errors[0], RemoteCancelledError)
    assert "was cancelled" in str(errors[0])
    record = _wait_for_server_status(server, runs[0].job_ids[-1], "ERROR")
    assert "Cancelled" in record["description"]  # the server dropped the queued job
    # the model's other threads are unaffected by that run
    assert not remote_model.nn._explorer_connection.run.cancelled


def test_async_run_does_not_block_and_cancels(remote_model, local_model, server, queue_delay):
    async def concurrently():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        ds = await run_remote_async(remote_model, trace, PROMPTS[:1])
        done_ticks = ticks
        # now a queued job, cancelled by cancelling the awaiting task
        queue_delay(30)
        queued = asyncio.Event()
        loop = asyncio.get_running_loop()
        job = asyncio.create_task(run_remote_async(
            remote_model, trace, PROMPTS[:1],
            on_status=lambda s: s.status == "QUEUED" and loop.call_soon_threadsafe(queued.set)))
        await asyncio.wait_for(queued.wait(), 20)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        tick_task.cancel()
        return ds, done_ticks

    ds, ticks = asyncio.run(concurrently())
    assert ticks > 0  # the event loop kept running while the job was in flight
    assert _equal(ds.resid_post, trace(local_model, PROMPTS[:1]).resid_post)


def test_disconnect_is_a_clear_error(remote_model, server, queue_delay):
    queue_delay(30)
    errors = []

    def drop_when_queued(status):
        if status.status == "QUEUED":
            threading.Thread(target=server.disconnect).start()

    with remote_run(remote_model, on_status=drop_when_queued):
        _capture(errors, trace, remote_model, PROMPTS[:1])
    assert len(errors) == 1 and isinstance(errors[0], RemoteError)
    assert "closed the connection before job" in str(errors[0])


def test_model_not_served_is_a_clear_error(env, folder, tmp_path):
    import shutil

    other = tmp_path / "another-folder"
    shutil.copytree(folder, other)
    model = load_model(other, remote=True)
    with pytest.raises(RemoteError, match=r"refused the request \(HTTP 404\): Model not served"):
        trace(model, PROMPTS[:1])


def test_folder_without_a_model_is_a_clear_error(env, tmp_path):
    with pytest.raises(RemoteError, match=r"could not prepare remote model .* the folder must "
                                          r"hold config\.json"):
        load_model(tmp_path, remote=True)


def test_unreachable_host_is_a_clear_error(env, folder):
    from explorer.ndif_server import _free_port

    model = load_model(folder, remote=True)
    model.nn._explorer_connection.host = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(RemoteError, match=r"cannot reach the NDIF server at "
                                          r"http://127\.0\.0\.1:\d+"):
        trace(model, PROMPTS[:1])


# -- errors from the server, bad key, and the key never leaking ----------------------------

def test_server_error_is_reported_and_redacted(remote_model, caplog):
    ids = remote_model.tokenize(PROMPTS[:1]).input_ids
    leaked = f"key={API_KEY}"
    nn = remote_model.nn
    caplog.set_level(logging.DEBUG)
    with pytest.raises(RemoteError, match=r"NDIF job \w+ failed on the server: "
                                          r"ValueError: server-side failure key=\*\*\*") as info:
        with nn.trace(ids, remote=True):
            nn.layers[0].output.save()
            raise ValueError("server-side failure " + leaked)
    assert API_KEY not in str(info.value)
    assert API_KEY not in info.value.server_traceback
    assert "raise ValueError" in info.value.server_traceback  # the user's line, server side
    assert API_KEY not in caplog.text


def test_bad_key_is_refused_without_echoing_it(env, folder):
    bad_key = "wrong-key-0123456789abcdef"
    env.setenv("NDIF_API_KEY", bad_key)
    try:
        model = load_model(folder, remote=True)
        with pytest.raises(RemoteError, match=r"refused the API key \(HTTP 401\)") as info:
            trace(model, PROMPTS[:1])
    finally:
        env.setenv("NDIF_API_KEY", API_KEY)
    assert bad_key not in str(info.value)


def test_missing_key_is_a_clear_error(env, folder):
    env.delenv("NDIF_API_KEY")
    from nnsight import CONFIG

    saved, CONFIG.API.APIKEY = CONFIG.API.APIKEY, None
    try:
        with pytest.raises(RemoteError, match="remote=True needs an NDIF API key"):
            load_model(folder, remote=True)
    finally:
        CONFIG.API.APIKEY = saved
        env.setenv("NDIF_API_KEY", API_KEY)


def test_key_never_in_logs_exports_or_payload(remote_model, caplog):
    from nnsight.intervention.serialization import dumps

    caplog.set_level(logging.DEBUG)
    ds = trace(remote_model, PROMPTS[:1])
    assert API_KEY not in caplog.text
    assert "COMPLETED" in caplog.text  # the status lines were logged
    assert API_KEY not in json.dumps(ds.attrs, default=str)
    assert API_KEY not in repr(remote_model) + repr(remote_model.nn._explorer_connection)
    assert API_KEY not in json.dumps(remote_config())
    assert API_KEY.encode() not in dumps(remote_model.nn)  # what a request carries
    assert redact(f"a {API_KEY} b") == "a *** b"


# -- helpers -------------------------------------------------------------------------------

def _capture(errors, func, *args):
    try:
        func(*args)
    except Exception as e:  # noqa: BLE001 - handed to the test to assert on
        errors.append(e)


def _wait_for_server_status(server, job_id, status, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        record = server.job_status(job_id)
        if record["status"] == status or time.monotonic() > deadline:
            assert record["status"] == status, record
            return record
        time.sleep(0.05)


def test_loopback_server_binds_loopback_only(server):
    import socket

    import psutil

    addresses = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not addresses:
        pytest.skip("no non-loopback IPv4 address to probe")
    for address in addresses:
        with socket.socket() as s:
            s.settimeout(1)
            assert s.connect_ex((address, server.port)) != 0, address
    with socket.socket() as s:  # while the loopback address answers
        s.settimeout(1)
        assert s.connect_ex(("127.0.0.1", server.port)) == 0


def test_remote_tensor_dtype_roundtrip(remote_model):
    """Saved values come back as CPU tensors of the model's dtype."""
    ids = remote_model.tokenize(PROMPTS[:1]).input_ids
    nn = remote_model.nn
    with nn.trace(ids, remote=True):
        out = nn.layers[2].output.save()
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
    assert out.dtype == torch.float32 and out.shape[-1] == 64


# -- the app: status of remote jobs, and the stop button ------------------------------------

def test_app_shows_remote_status_and_stop_cancels_the_job(env, folder, server, queue_delay):
    from apps._session import Runner, get_model, session_hooks
    from apps.gallery import Gallery
    from apps.lens import LensView

    model = get_model(str(folder), remote=True)
    assert model.remote
    gallery = Gallery(str(folder), remote=True, views=[("Logit lens", "lens", LensView)])
    assert gallery.model is model
    # building the lens page ran the remote lens; its statuses reached the sidebar
    assert "COMPLETED" in gallery.remote_status
    sidebar = pn.Column(*gallery.sidebar())
    assert any("remote-status" in (o.css_classes or []) for o in sidebar.select(pn.pane.Markdown))

    hooks = session_hooks()
    statuses, results, errors = [], [], []
    hooks.on_remote_status = statuses.append
    runner = Runner(on_result=results.append, on_error=errors.append, on_busy=lambda b: None,
                    background=True)
    try:
        queue_delay(30)
        runner.submit(lambda token: trace(model, PROMPTS[:1]))
        deadline = time.monotonic() + 30
        while not any(s.status == "QUEUED" for s in statuses) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(s.status == "QUEUED" for s in statuses), statuses
        assert hooks.stop_all() >= 1                    # the sidebar's stop button
        deadline = time.monotonic() + 10
        while runner.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not runner.running and not results and not errors   # stopped, nothing shown
        _wait_for_server_status(server, statuses[-1].job_id, "ERROR")  # the server dropped it
    finally:
        import apps._session

        hooks.on_remote_status = None
        runner.close()
        gallery.close()
        apps._session._MODELS.pop((str(folder), True), None)  # later tests run local models
