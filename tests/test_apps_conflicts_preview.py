"""The Knowledge conflicts page's live α sliders (apps/_conflicts_preview.py, apps/conflicts.py).

The preview's probabilities are checked against a dual run written here in plain torch with
hooks on the Hugging Face model's ``o_proj`` (run 1 records each head's input to ``o_proj``;
run 2 adds α times it for the chosen heads, or the single run scales them), and against the
exact path (`explorer.analyses.conflicts.juice_logits` / `single_run_logits`). The page's
preview, the words its record gives, the newest-move-wins slot and the exact bars on release
are checked on a view run inline or in worker threads (no server).
"""
from __future__ import annotations

import threading

import numpy as np
import param
import pytest
import torch

from apps import _conflicts_preview as P
from apps._conflicts_record import conflicts_request
from apps.conflicts import ConflictsView
from explorer._checks import InputError
from explorer.analyses import conflicts as C
from explorer.analyses.conflicts.facts import _first_token
from tests._hooks import removed_after


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def fact():
    return C.load_facts(["country_capital"])[0]


def _hooked(model, ids, fact, plus, minus, alpha_l, alpha_s, mode):
    """P(memory), P(context) of the dual run (``juice``) or the single run by hooks."""
    layers, d = model.hf.model.layers, model.spec.d_head
    z1: dict[int, torch.Tensor] = {}

    def record(i):
        def hook(_module, args):
            z1[i] = args[0].detach().clone()
        return hook

    with removed_after([layer.self_attn.o_proj.register_forward_pre_hook(record(i))
                        for i, layer in enumerate(layers)]), torch.no_grad():
        model.hf(input_ids=ids)
    chosen: dict[int, list[tuple[int, float]]] = {}
    for heads, a in ((plus, alpha_l), (minus, -alpha_s)):
        for layer, head in heads:
            chosen.setdefault(layer, []).append((head, a))

    def edit(i):
        def hook(_module, args):
            z = args[0].clone()
            for head, a in chosen[i]:
                cols = slice(head * d, (head + 1) * d)
                if mode == "juice":
                    z[..., cols] += a * z1[i][..., cols]
                else:
                    z[..., cols] *= 1 + a
            return (z,)
        return hook

    with removed_after([layers[i].self_attn.o_proj.register_forward_pre_hook(edit(i))
                        for i in chosen]), torch.no_grad():
        logits = model.hf(input_ids=ids).logits[0, -1].float()
    p = torch.softmax(logits, -1)
    return np.array([float(p[_first_token(model, fact.memory)]),
                     float(p[_first_token(model, fact.context)])])


HEADS = [([(0, 1)], []), ([(2, 3), (1, 0)], [(1, 2)]), ([], [(2, 1)])]


@pytest.mark.parametrize("mode", ["juice", "single"])
@pytest.mark.parametrize("plus,minus", HEADS)
def test_the_float32_preview_is_the_hooked_run_and_the_exact_path(tiny_model, fact, mode,
                                                                   plus, minus):
    run1 = C.juice_first_run(tiny_model, [C.conflict_prompt(fact, "coherent")])
    run = C.juice_logits if mode == "juice" else C.single_run_logits
    for alpha_l, alpha_s in ((0.5, 1.0), (4.0, 2.5)):
        got = P.preview_after(tiny_model, run1, fact, plus, minus, alpha_l=alpha_l,
                              alpha_s=alpha_s, mode=mode)
        want = _hooked(tiny_model, run1.batch.input_ids, fact, plus, minus, alpha_l, alpha_s,
                       mode)
        exact = C.answer_probabilities(tiny_model, run(tiny_model, None, plus, minus,
                                                       alpha_l=alpha_l, alpha_s=alpha_s,
                                                       run1=run1), [fact])[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-7)
        assert not np.allclose(got, C.answer_probabilities(tiny_model, run1.logits, [fact])[0],
                               rtol=1e-3, atol=0)       # the heads moved the answer


def test_the_bfloat16_preview_stays_within_its_bound(tiny_model, fact):
    run1 = C.juice_first_run(tiny_model, [C.conflict_prompt(fact, "substitution")])
    plus, minus = HEADS[1]
    for mode in ("juice", "single"):
        got = P.preview_after(tiny_model, run1, fact, plus, minus, alpha_l=5.0, alpha_s=3.0,
                              mode=mode, precision="bfloat16")
        want = _hooked(tiny_model, run1.batch.input_ids, fact, plus, minus, 5.0, 3.0, mode)
        assert np.abs(got - want).max() <= P.BF16_BOUND


def test_without_heads_the_preview_is_run_1(tiny_model, fact):
    run1 = C.juice_first_run(tiny_model, [C.conflict_prompt(fact, "clean")])
    got = P.preview_after(tiny_model, run1, fact, [], [], alpha_l=3.0, alpha_s=1.0)
    want = _hooked(tiny_model, run1.batch.input_ids, fact, [], [], 3.0, 1.0, "juice")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


def test_a_model_the_forward_does_not_cover_previews_through_the_exact_path(tiny_gpt2, fact):
    run1 = C.juice_first_run(tiny_gpt2, [C.conflict_prompt(fact, "substitution")])
    assert P.preview_dtype(tiny_gpt2, run1) == "exact"
    got = P.preview_after(tiny_gpt2, run1, fact, [(1, 0)], [], alpha_l=2.0, alpha_s=1.0)
    exact = C.answer_probabilities(tiny_gpt2, C.juice_logits(tiny_gpt2, None, [(1, 0)], [],
                                                             alpha_l=2.0, run1=run1), [fact])[0]
    np.testing.assert_array_equal(got, exact)


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "both"}, r"`mode` must be 'juice' or 'single'; got 'both'"),
    ({"precision": "half"}, r"`precision` must be one of 'float32', 'bfloat16', 'exact'; "
                            r"got 'half'"),
    ({"plus": [(9, 0)]}, "layer"),
])
def test_bad_inputs_are_named(tiny_model, fact, kwargs, match):
    run1 = C.juice_first_run(tiny_model, [C.conflict_prompt(fact, "clean")])
    args = {"plus": [(0, 1)], "minus": [], "alpha_l": 1.0, "alpha_s": 1.0, **kwargs}
    plus, minus = args.pop("plus"), args.pop("minus")
    with pytest.raises(InputError, match=match):
        P.preview_after(tiny_model, run1, fact, plus, minus, **args)


def _view(model, **params):
    facts = C.load_facts(["country_capital"])[:3]
    return ConflictsView(model, facts=facts, closed_book=False, n_new=2, **params)


def _after(view):
    return np.array([v for _a, r, v in view.bar_rows if r == "after"])


def test_a_drag_previews_the_bars_and_the_release_gives_the_exact_ones(tiny_model, fact):
    view = _view(tiny_model, background=False, heads_plus=["L2.H3", "L1.H0"],
                 heads_minus=["L1.H2"])
    view.wait()
    exact_before = _after(view)
    view.alpha_slider("alpha_l").value = 4.0            # a drag's move (no release yet)
    assert view.alpha_l == 1.0 and view.previewing and view.preview_runs == 1
    ids = view._run1[1].batch.input_ids
    want = _hooked(tiny_model, ids, fact, [(2, 3), (1, 0)], [(1, 2)], 4.0, 1.0, "juice")
    np.testing.assert_allclose(_after(view), want, rtol=1e-4, atol=1e-7)
    assert not np.allclose(_after(view), exact_before)
    # the words come from the preview's record: its α, and that it is a preview
    assert dict(view.shown.request)["alphas"] == (4.0, 1.0)
    words = view.bars_words()
    assert "Preview while the slider moves" in words and "α_l = 4, α_s = 1" in words
    assert view._bars_title() == "P(answer) · preview"
    assert view.stale_note() == ""                    # the hand's α is no old input
    assert "data-cf-preview='1'" in view._state_html() and "data-cf-alphas='4,1'" in \
        view._state_html()
    slider = view.alpha_slider("alpha_l")
    with param.parameterized.edit_constant(slider):     # the release
        slider.value_throttled = 4.0
    view.wait()
    assert view.alpha_l == 4.0 and not view.previewing
    np.testing.assert_allclose(_after(view), want, rtol=1e-4, atol=1e-7)
    words = view.bars_words()
    assert "Preview" not in words and "α_l = 4, α_s = 1" in words
    assert view._bars_title() == "P(answer)"
    assert "data-cf-preview='0'" in view._state_html()


def test_the_scope_line_names_the_shown_bars_fact_and_prompt_type(tiny_model):
    view = _view(tiny_model, background=False)
    view.wait()
    assert "the substitution prompt of France (country_capital)" in view.scope().on
    other = C.load_facts(["country_capital"])[2]
    view.shown = conflicts_request(tiny_model.spec.name, other, "coherent", "juice", [], [],
                                   1.0, 1.0, [])
    assert view.example.startswith("country_capital: France")
    assert f"the coherent prompt of {other.subject} (country_capital)" in view.scope().on


def test_moves_made_while_a_preview_computes_wait_in_one_slot_newest_wins(tiny_model,
                                                                          monkeypatch):
    view = _view(tiny_model, background=False, heads_plus=["L2.H3"])
    view.wait()
    view._background = True                  # previews now run in a worker thread
    view._runners["preview"].background = True
    started, release = threading.Event(), threading.Event()
    computed: list[float] = []
    real = P.preview_after

    def slow(*args, **kwargs):
        computed.append(kwargs["alpha_l"])
        if len(computed) == 1:
            started.set()
            assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(P, "preview_after", slow)
    # the previews handed to the page to draw (served, on the session's loop, in order; here
    # each in its job's worker thread, so the draws themselves may interleave)
    delivered: list[tuple[float, object]] = []
    runner = view._runners["preview"]
    draw = runner._on_result
    runner._on_result = lambda out: (delivered.append((out[1]["alpha_l"], out[3])), draw(out))
    for alpha in (1.5, 2.0, 2.5, 3.0):
        view.request_preview("alpha_l", alpha)
        assert started.wait(30)
    release.set()
    for _ in range(200):
        view.wait()
        if not view._slot.busy and len(delivered) == 2:
            break
        threading.Event().wait(0.05)
    assert computed == [1.5, 3.0]            # 2.0 and 2.5 were dropped for the newer 3.0
    assert delivered == [(1.5, None), (3.0, None)]          # both drawn, no failure


def test_an_exact_request_makes_the_previews_asked_before_it_stale(tiny_model):
    view = _view(tiny_model, background=False, heads_plus=["L2.H3"])
    view.wait()
    p = view._preview_params() | {"alpha_l": 2.5}
    seq = view._seq + 1
    view._seq = seq
    out = view._preview_job((seq, p), token=type("T", (), {"check": lambda self: None})())
    view.alpha_l = 0.5                        # the exact run of another value, asked later
    view.wait()
    shown = view.bar_rows
    view._show_preview(out)                   # the older preview lands after it
    assert view.bar_rows == shown and not view.previewing


def test_the_warm_up_runs_a_preview_that_is_not_drawn(tiny_model):
    """Served, exact bars are followed by one preview (run 1 made if the bars came from the
    result cache, the forward's blocks built; the last layer's first head when none is
    chosen) whose bars are not drawn."""
    view = _view(tiny_model, background=False)
    view.wait()
    view._run1 = (view._run1[0], None)            # as when the bars came from the cache
    view._background = True
    for lane in ("preview", "warm"):
        view._runners[lane].background = True
    tiny_model.__dict__.pop("_preview_blocks", None)
    rows, shown = view.bar_rows, view.shown
    view._warm_preview()
    view.wait()
    assert view.preview_runs == 1 and view._run1[1] is not None
    assert "_preview_blocks" in tiny_model.__dict__
    assert view.bar_rows == rows and view.shown is shown and not view._slot.busy


def test_the_suppress_slider_previews_too_in_the_single_run(tiny_model, fact):
    view = _view(tiny_model, background=False, heads_plus=["L2.H3"], heads_minus=["L1.H2"],
                 mode="single")
    view.wait()
    view.alpha_slider("alpha_s").value = 2.5
    assert view.alpha_s == 1.0 and view.previewing
    want = _hooked(tiny_model, view._run1[1].batch.input_ids, fact, [(2, 3)], [(1, 2)], 1.0, 2.5,
                   "single")
    np.testing.assert_allclose(_after(view), want, rtol=1e-4, atol=1e-7)
    assert "single run with 2 heads at α_l = 1, α_s = 2.5" in view.bars_words()
