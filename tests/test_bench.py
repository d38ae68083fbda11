"""Tests for explorer.bench (JSON shape of every bench) and the lens speed-ups it measures:
the bfloat16 screen-then-refine mode and the reuse of clean layers' readouts."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from explorer import bench as bench_module
from explorer import lens as lens_module
from explorer._checks import InputError
from explorer.bench import BENCHES, bench, run_bench, text_prompts
from explorer.interventions import Ablate, Steer
from explorer.lens import _count_above, lens_readout, logit_lens
from explorer.models import TINY_MODELS, load_model
from explorer.trace import clean_run

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins",
    "One two three four",
    "Water boils at one hundred degrees at sea level",
]
UNITS = ("_ratio", "_ms", "_mb", "_mb_per_s")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_bench_result(result: dict, name: str) -> None:
    """The shape every bench returns: keys, units in figure names, finite positive numbers."""
    json.dumps(result)  # JSON-able as it is
    assert result["bench"] == name
    assert {"bench", "machine", "date", "params", "figures"} <= set(result)
    assert set(result) <= {"bench", "machine", "date", "params", "figures", "notes", "accuracy"}
    machine = result["machine"]
    assert machine["cores"] >= 1 and machine["torch_threads"] >= 1 and machine["cpu"]
    assert {"python", "torch", "transformers", "nnsight", "explorer"} <= set(machine["versions"])
    assert result["date"][:2] == "20" and "T" in result["date"]
    assert result["figures"]
    for key, value in result["figures"].items():
        assert key.endswith(UNITS), key
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)


# -- registry and options ---------------------------------------------------------------------

def test_unknown_bench_lists_the_names():
    with pytest.raises(InputError, match=r"`bench` must be one of 'trace-overhead', 'slider'"
                                         r".*; got 'slidr'\. Did you mean 'slider'\?"):
        run_bench("slidr")


def test_unknown_option_lists_the_options():
    with pytest.raises(InputError, match=r"bench 'slider' has no option 'repeat'; its options "
                                         r"are .*repeats.* Did you mean 'repeats'\?"):
        run_bench("slider", model="tiny-llama", repeat=2)


def test_adding_a_bench_is_one_decorated_function():
    @bench("test-dummy")
    def dummy(*, model: str = "tiny-llama", size: int = 3) -> dict:
        return {"params": {"model": model, "size": size},
                "figures": {"dummy_ratio": 1.5, "dummy_ms": 2}}

    try:
        result = run_bench("test-dummy", size=4)
        assert_bench_result(result, "test-dummy")
        assert result["params"] == {"model": "tiny-llama", "size": 4}
        assert result["figures"] == {"dummy_ratio": 1.5, "dummy_ms": 2.0}
    finally:
        del BENCHES["test-dummy"]


def test_a_figure_without_a_unit_is_refused():
    @bench("test-bad-unit")
    def bad(*, model: str = "tiny-llama") -> dict:
        return {"params": {}, "figures": {"speed": 3.0}}

    try:
        with pytest.raises(ValueError, match="bench figure 'speed' must end in one of _ratio"):
            run_bench("test-bad-unit")
    finally:
        del BENCHES["test-bad-unit"]


def test_interleaved_times_alternate_and_rotate():
    order: list[str] = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    wall, cpu = bench_module.interleaved_times(fns, repeats=3, warmup=0)
    assert order == list("abc" "bca" "cab")
    assert all(len(t) == 3 for t in (*wall.values(), *cpu.values()))


def test_threads_option_applies_to_the_run_only():
    seen = []

    @bench("test-threads")
    def threads_seen(*, model: str = "tiny-llama") -> dict:
        seen.append(torch.get_num_threads())
        return {"params": {}, "figures": {"one_ms": 1.0}}

    try:
        before = torch.get_num_threads()
        result = run_bench("test-threads", threads=2)
        assert seen == [2] and result["machine"]["torch_threads"] == 2
        assert torch.get_num_threads() == before
        with pytest.raises(InputError, match=r"`threads` must be an int in \[1, inf\]; got 0"):
            run_bench("test-threads", threads=0)
    finally:
        del BENCHES["test-threads"]


def test_text_prompts_have_exactly_the_asked_tokens(tiny_model):
    for n, tokens in ((3, 10), (2, 40)):
        texts = text_prompts(tiny_model, n, tokens)
        assert len(texts) == n and len(set(texts)) == n
        assert tiny_model.tokenize(texts).lengths == [tokens] * n


# -- the benches on the tiny model ---------------------------------------------------------

def test_trace_overhead_result_shape():
    result = run_bench("trace-overhead", model="tiny-llama", prompts=2, tokens=12, repeats=1,
                       peer=False)
    assert_bench_result(result, "trace-overhead")
    assert result["params"]["model"] == "tiny-llama" and result["params"]["tokens"] == 12
    assert {"trace_overhead_ratio", "run_batch_overhead_ratio", "plain_forward_ms",
            "store_write_mb_per_s", "npsave_write_mb_per_s", "store_vs_npsave_time_ratio",
            "dataset_mb"} <= set(result["figures"])
    assert "peer" in result["notes"]
    # 2 prompts x 12 tokens x 3 layers x (resid_post 64 + attn_z 64) float32 + mask/ids
    assert result["figures"]["dataset_mb"] >= 2 * 12 * 3 * 128 * 4 / 2**20


def test_trace_overhead_with_the_transformer_lens_peer():
    pytest.importorskip("transformer_lens")
    result = run_bench("trace-overhead", model="tiny-llama", prompts=2, tokens=12, repeats=1,
                       store=False)
    assert_bench_result(result, "trace-overhead")
    assert {"peer_overhead_ratio", "trace_vs_peer_ratio",
            "peer_run_with_cache_ms"} <= set(result["figures"]), result.get("notes")
    assert result["machine"]["versions"]["transformer_lens"]


def test_slider_result_shape():
    result = run_bench("slider", model="tiny-llama", tokens=8, repeats=1, accuracy_prompts=2,
                       accuracy_tokens=10)
    assert_bench_result(result, "slider")
    assert result["params"]["layer"] == 1  # the middle of 3 layers
    assert {"slider_exact_ms", "slider_fast_ms", "exact_resumed_vs_full_ratio",
            "fast_resumed_vs_full_ratio", "exact_reuse_vs_no_reuse_ratio"} <= set(result["figures"])
    acc = result["accuracy"]
    assert acc["reuse_identical"] is True
    assert acc["bf16_vs_exact"]["rows"] == 2 * 10 * 3
    assert 0 <= acc["bf16_vs_exact"]["max_top_prob_abs_error"] < 2e-3
    # the fast mode's dtype was decided on this model at the lens's 256-row products, and
    # the decision with both timings is reported
    decisions = result["params"]["kernel_decisions"]
    (screen,) = [d for d in decisions["screen"] if d["rows"] == 256]
    assert result["params"]["fast_resolves_to"] == screen["chosen"]
    assert screen["chosen"] == ("bfloat16" if screen["float32_ms"] >= 1.1 * screen["bfloat16_ms"]
                                else "float32")
    # the slider's preview while it moves: timed on the page, checked against the exact lens
    fig = result["figures"]
    assert {"slider_preview_ms", "slider_preview_cpu_ms", "preview_vs_fast_ratio",
            "slider_preview_p90_ms"} <= set(fig)
    assert fig["slider_preview_ms"] > 0 and fig["preview_lens_ms"] > 0
    preview = acc["preview_vs_exact"]
    assert preview["moves"] == result["params"]["preview_moves"] == 16
    assert preview["rows_per_move"] == 8 * 3 and 0 <= preview["top1_agreement"] <= 1
    from explorer._kernels import bfloat16_matmul_is_fast
    assert preview["preview_dtype"] == ("bfloat16" if bfloat16_matmul_is_fast() else "float32")
    assert acc["release_equals_full_run"] is True


@pytest.mark.slow
def test_remote_bench_result_shape():
    """`explorer bench remote`: the loopback server on a saved tiny model, remote against
    local, and the remote scores equal the local ones (to float32 summation order)."""
    import os

    before = {k: os.environ.get(k) for k in ("NDIF_API_KEY", "NDIF_HOST")}
    result = run_bench("remote", model="tiny-llama", n_prompts=2, steps=1, ft_steps=2,
                       fv_prompts=2, repeats=1)
    assert {k: os.environ.get(k) for k in before} == before  # the bench's env is undone
    assert_bench_result(result, "remote")
    figures = result["figures"]
    assert {"remote_vs_local_eap_ratio", "remote_vs_local_eap_ig_ratio",
            "remote_vs_local_trace_ratio", "eap_request_mb", "remote_vs_local_fv_ratio"
            } <= set(figures)
    assert result["accuracy"]["remote_fv_scores_equal_local"] is True
    assert result["accuracy"]["remote_attribution_equals_local"] is True
    assert figures["remote_vs_local_attribution_ratio"] > 0
    # the server computes at its own thread count, this test at one thread: equal up to
    # float32 summation order
    assert result["accuracy"]["remote_vs_local_max_rel_diff"] < 1e-5
    # one float32 per edge of the tiny graph (3 layers, 4 heads: 118 edges)
    assert result["params"]["n_edges"] == 118
    assert figures["eap_result_mb"] == pytest.approx(4 * 118 / 2**20)
    assert 0 < figures["eap_request_mb"] < 1
    # LoRA rank 2 on the 7 maps of 3 layers: 2 * (128 + 96 + 96 + 128 + 3 * 192) * 3 floats
    assert result["params"]["ft_trainable"] == 2 * 1024 * 3
    assert figures["finetune_result_mb"] == pytest.approx(4 * 3 * 6144 / 2**20)
    assert 0 < figures["finetune_job_mb"] < 1
    assert {"remote_vs_local_finetune_ratio", "hooks_vs_peft_finetune_ratio"} <= set(figures)


# -- exact rank counting ------------------------------------------------------------------------

@pytest.mark.parametrize("n", [5, 128, 300, 512])
def test_count_above_counts_exactly(n):
    g = torch.Generator().manual_seed(n)
    values = torch.randint(-20, 20, (7, n), generator=g).float()   # many ties
    thresholds = torch.randint(-25, 25, (7, 3), generator=g).float()
    expected = (values.unsqueeze(1) > thresholds.unsqueeze(-1)).sum(-1)
    assert torch.equal(_count_above(values, thresholds), expected)


# -- lens: bfloat16 screen then refine vs float32 ----------------------------------------------

FAST_PROB_ATOL = 2e-3  # SmolLM2 text: < 1.3e-3 (benchmarks/README.md)
FAST_PROB_RTOL = 1e-2


def by_hand_lens(model, prompt):
    """float32 lens logits [layer, pos, vocab] of one prompt from Hugging Face hidden states."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = model.hf(input_ids=ids, output_hidden_states=True)
    # hidden_states[l + 1] is resid_post of layer l, except the last, which HF returns normed
    rows = [model.lens_logits(h[0]) for h in out.hidden_states[1:-1]]
    return torch.stack([*rows, out.logits[0]])


@pytest.mark.parametrize("name", TINY_MODELS)
def test_fast_lens_agrees_with_float32(name):
    model = load_model(name)
    with torch.no_grad():  # sharper, larger logits than the random init's near-uniform ones
        model.unembed_module.weight.mul_(10.0)
    k = 3
    exact = logit_lens(model, PROMPTS, k=k)
    # few candidates, so most of the normaliser comes from the bfloat16 screen
    fast = logit_lens(model, PROMPTS, k=k, unembed_dtype="bfloat16", screen_candidates=4)
    mask = exact["mask"].values
    p_exact, p_fast = exact.top_prob.values[mask], fast.top_prob.values[mask]  # [rows, layer, k]
    id_exact, id_fast = exact.top_token_id.values[mask], fast.top_token_id.values[mask]
    clear = np.log(p_exact[..., 0]) - np.log(p_exact[..., 1]) > 0.01   # not a near tie
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(id_fast[..., 0][clear], id_exact[..., 0][clear])
    np.testing.assert_allclose(p_fast, p_exact, atol=FAST_PROB_ATOL, rtol=0)
    np.testing.assert_allclose(p_fast, p_exact, rtol=FAST_PROB_RTOL)
    np.testing.assert_allclose(fast.final_prob.values[mask], exact.final_prob.values[mask],
                               atol=FAST_PROB_ATOL, rtol=0)
    np.testing.assert_array_equal(fast.final_token_id.values, exact.final_token_id.values)
    # and against an independent float32 softmax of the Hugging Face hidden states
    for i, prompt in enumerate(PROMPTS):
        probs = torch.softmax(by_hand_lens(model, prompt), -1)    # [layer, pos, vocab]
        n = probs.shape[1]
        ref = probs.topk(k, -1).values.permute(1, 0, 2).numpy()   # [pos, layer, k]
        np.testing.assert_allclose(fast.top_prob.values[i, :n], ref, atol=FAST_PROB_ATOL,
                                   rtol=0)
        np.testing.assert_allclose(exact.top_prob.values[i, :n], ref, atol=1e-5, rtol=0)


def test_lens_readout_keeps_its_outputs_and_exact_ranks(tiny_model):
    resid = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)) * 3
    targets = torch.randint(0, 512, (40, 4), generator=torch.Generator().manual_seed(2))
    logits = tiny_model.lens_logits(resid)                         # [rows, vocab]
    expected_rank = (logits.unsqueeze(1) > logits.gather(-1, targets).unsqueeze(-1)).sum(-1)
    for chunk_rows in (7, 40):
        out = lens_readout(tiny_model, resid, k=6, targets=targets, chunk_rows=chunk_rows)
        assert set(out) == {"top_id", "top_prob", "target_rank", "target_prob"}
        top = torch.softmax(logits, -1).topk(6, -1)
        assert torch.equal(out["top_id"], top.indices)
        torch.testing.assert_close(out["top_prob"], top.values, atol=1e-6, rtol=0)
        assert torch.equal(out["target_rank"], expected_rank)
        capped = lens_readout(tiny_model, resid, k=6, targets=targets, rank_cap=50,
                              chunk_rows=chunk_rows)
        assert torch.equal(capped["target_rank"], expected_rank.clamp(max=50))
    assert set(lens_readout(tiny_model, resid, k=2)) == {"top_id", "top_prob"}


# -- lens: reuse of the clean layers' readouts ----------------------------------------------------

VARS = ("top_token_id", "top_prob", "final_rank", "final_prob", "final_token_id")


def assert_identical(a, b):
    for var in VARS:
        np.testing.assert_array_equal(a[var].values, b[var].values, err_msg=var)


@pytest.mark.parametrize("options", [
    {},
    {"rank_cap": 5},
    {"unembed_dtype": "bfloat16"},
    {"unembed_dtype": "bfloat16", "rank_cap": 5, "positions": [-1, 0]},
    {"chunk_rows": 10},  # several chunks per layer
])
def test_clean_layer_reuse_is_identical_to_recomputing(tiny_model, monkeypatch, options):
    vec = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
    clean = clean_run(tiny_model, PROMPTS)
    saved = []
    real_run_batch = lens_module.run_batch

    def recording_run_batch(model, batch, **kw):
        saved.append(sorted(kw["save"]))
        return real_run_batch(model, batch, **kw)

    monkeypatch.setattr(lens_module, "run_batch", recording_run_batch)
    logit_lens(tiny_model, PROMPTS, k=3, resume=clean, **options)  # a clean read fills it
    for alpha in (1.0, 2.5, 4.0):
        edits = [Steer(2, vec, alpha)]
        saved.clear()
        reused = logit_lens(tiny_model, PROMPTS, k=3, edits=edits, resume=clean, **options)
        if alpha > 1:  # layers 0 and 1 from the readouts the first edited read kept,
            assert saved == [[]]  # layer 2 (the last) from the run's own logits
        recomputed = logit_lens(tiny_model, PROMPTS, k=3, edits=edits, **options)
        assert_identical(reused, recomputed)
        not_kept = logit_lens(tiny_model, PROMPTS, k=3, edits=edits, resume=clean,
                              reuse_clean=False, **options)
        assert_identical(reused, not_kept)
    # an edit at layer 1 reuses layer 0 only; a head ablation is not a residual edit
    edits = [Ablate(1, 2)]
    assert_identical(logit_lens(tiny_model, PROMPTS, k=3, edits=edits, resume=clean, **options),
                     logit_lens(tiny_model, PROMPTS, k=3, edits=edits, **options))


def test_reuse_past_the_memory_budget_recomputes(tiny_model, monkeypatch):
    monkeypatch.setattr(lens_module, "CLEAN_READOUT_BUDGET_MB", 0.0)
    clean = clean_run(tiny_model, PROMPTS)
    edits = [Steer(1, [0.5] * 64, 3.0)]
    first = logit_lens(tiny_model, PROMPTS, k=2, edits=edits, resume=clean)
    assert clean._lens_readouts.nbytes == 0 and not clean._lens_readouts.entries
    assert_identical(first, logit_lens(tiny_model, PROMPTS, k=2, edits=edits))


def test_clean_readouts_do_not_mix_options(tiny_model):
    clean = clean_run(tiny_model, PROMPTS)
    edits = [Steer(2, [0.3] * 64, 2.0)]
    for options in ({}, {"unembed_dtype": "bfloat16"}, {"positions": [-1]}, {"k": 4}):
        opts = {"k": 2, **options}
        assert_identical(logit_lens(tiny_model, PROMPTS, edits=edits, resume=clean, **opts),
                         logit_lens(tiny_model, PROMPTS, edits=edits, **opts))
    assert len(clean._lens_readouts.entries) == 4


@pytest.mark.slow
@pytest.mark.integration
def test_fast_lens_on_smollm2_text(smollm2):
    texts = text_prompts(smollm2, 1, 24)
    exact = logit_lens(smollm2, texts, k=5, rank_cap=20)
    fast = logit_lens(smollm2, texts, k=5, rank_cap=20, unembed_dtype="bfloat16")
    agreement = bench_module.lens_agreement(exact, fast)
    assert agreement["top1_agreement_clear_margin"] == 1.0
    assert agreement["max_top_prob_abs_error"] < FAST_PROB_ATOL


def test_slider_preview_compute_names_the_backend_the_preview_ran_on(monkeypatch):
    from explorer._kernels import bfloat16_matmul_is_fast
    from explorer.bench import slider_preview_compute

    monkeypatch.delenv("EXPLORER_CPU_GEMM", raising=False)
    got = slider_preview_compute(model="tiny-llama", tokens=8, moves=2)
    assert got["backend"] == ("bfloat16" if bfloat16_matmul_is_fast() else got["backend"])
    assert got["backend"] in ("bfloat16", "torch", "numpy") and got["preview_ms"] > 0
    monkeypatch.setenv("EXPLORER_CPU_GEMM", "numpy")       # a forced float32 backend
    assert slider_preview_compute(model="tiny-llama", tokens=8, moves=2)["backend"] == "numpy"
