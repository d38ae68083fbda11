"""The Circuits page's fine-tuning comparison (apps/_circuits_finetune.py) headless on
tiny-llama: after Fine-tune, the per-layer edge change plot draws each checkpoint's D_l
against the first and the prompt-resampling noise floor; both equal D_l recomputed here by
hand (circuits of three prompt samples of the base model scored the checkpoints' way,
EAP-IG on KL, top 5 % of edges), the floor has a legend entry, and the layers above the
floor are the ones marked and named in the text."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import xarray as xr

from apps import _circuits_finetune as cf
from apps.circuits import CircuitsView
from explorer.analyses import circuits as ca

N_PROMPTS = 4


@pytest.fixture(scope="module")
def view(tiny_model, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("EXPLORER_CACHE", str(tmp_path_factory.mktemp("cache")))
    with torch.enable_grad():
        v = CircuitsView(tiny_model, background=False, n_prompts=N_PROMPTS, autostart=False,
                         ft_steps=3)
        v._request_finetune()
    yield v
    mp.undo()


def d_l_by_hand(a_score, a_in, b_score, b_in, src, n_layers):
    """D_l of Wang et al.: per source layer, the sum over edges of |s_b - s_a| (in both
    circuits), |s| (in one), 0 (in neither); the input is layer 0."""
    out = np.zeros(n_layers)
    for k, name in enumerate(src):
        ia, ib = bool(a_in[k]), bool(b_in[k])
        sa, sb = float(a_score[k]), float(b_score[k])
        d = abs(sb - sa) if ia and ib else abs(sa) if ia else abs(sb) if ib else 0.0
        m = re.match(r"^(?:a(\d+)\.h\d+|m(\d+))$", name)
        out[0 if m is None else int(m.group(1) or m.group(2))] += d
    return out


def renderer(fig, name):
    found = [r for r in fig.renderers if r.name == name]
    assert len(found) == 1, [r.name for r in fig.renderers]
    return found[0]


def test_the_drawn_noise_floor_is_d_l_between_prompt_samples_of_the_base_model(view, tiny_model):
    ck = view.checkpoints
    assert ck is not None and view.noise_floor is not None
    L = tiny_model.n_layers
    circuits = []
    with torch.enable_grad():
        for seed in range(cf.NOISE_SAMPLES):
            task = ca.make_task(view.task, N_PROMPTS, seed=seed)
            s = ca.edge_scores(tiny_model, task, method="eap-ig", metric="kl", steps=5,
                               batch_size=N_PROMPTS)
            top_n = max(1, int(round(0.05 * s.sizes["edge"])))
            circuits.append((s["score"].values, ca.select_circuit(s, top_n=top_n).values))
    src = [str(x) for x in ck["src"].values]
    pairs = [(i, j) for i in range(len(circuits)) for j in range(i + 1, len(circuits))]
    floor = np.max([d_l_by_hand(*circuits[i], *circuits[j], src, L) for i, j in pairs], axis=0)
    assert floor.max() > 0
    fig = view.layer_change_plot()
    drawn = renderer(fig, "noise-floor").data_source.data
    np.testing.assert_allclose(drawn["floor"], floor, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(drawn["layer"], np.arange(L))
    # the floor's legend entry names it and draws its line and band
    items = [it for lg in fig.legend for it in lg.items]
    entry = [it for it in items if it.label.value == cf.FLOOR_LABEL]
    assert len(entry) == 1
    assert {r.name for r in entry[0].renderers} == {"noise-floor", "noise-floor-band"}


def test_the_drawn_change_is_d_l_of_the_checkpoint_against_the_first(view, tiny_model):
    ck = view.checkpoints
    L = tiny_model.n_layers
    src = [str(x) for x in ck["src"].values]
    first = (ck["score"].values[0], ck["in_circuit"].values[0])
    for shown in range(1, ck.sizes["checkpoint"]):
        view.checkpoint = shown
        want = d_l_by_hand(*first, ck["score"].values[shown], ck["in_circuit"].values[shown],
                           src, L)
        fig = view.layer_change_plot()
        np.testing.assert_allclose(renderer(fig, "layer-change").data_source.data["change"],
                                   want, rtol=1e-5, atol=1e-8)
        above = want > renderer(fig, "noise-floor").data_source.data["floor"]
        marked = renderer(fig, "above-floor").data_source.data["x"]
        assert sorted(np.asarray(marked).tolist()) == np.flatnonzero(above).tolist()
        text = view.layer_change_text()
        step = int(ck["checkpoint"].values[shown])
        assert f"step {step} against step 0" in text
        if above.any():
            assert f"Layers {', '.join(map(str, np.flatnonzero(above)))} " in text
        else:
            assert "No layer changes more than the noise floor" in text
    view.checkpoint = 0


def test_the_page_shows_the_plot_under_the_faithfulness_curve(view):
    pane = view._layer_change_pane()
    figs = [o.object for o in pane.select(cf.theme.BokehPane)]
    assert len(figs) == 1 and figs[0].title.text.startswith("Per-layer edge change vs step 0")
    assert "(EAP-IG on KL)" in figs[0].title.text
    assert "data-circuit-floor='ready'" in view._state_html()


def test_the_users_own_pairs_have_no_floor_and_say_why(view):
    ck = view.checkpoints.copy()
    ck.attrs = {**ck.attrs, "params": {**cf.checkpoint_params(ck), "task": "your pairs"}}
    tasks, opts, why = view.noise_floor_samples(ck)
    assert tasks == [] and "no noise floor" in why and "'your pairs'" in why
    assert opts["method"] == "eap-ig" and opts["metric"] == "kl"


def test_the_floor_is_read_from_a_netcdf_run(view, tmp_path):
    """A run folder's circuits.nc stores the params as JSON: they still name the scoring."""
    from explorer.analyses import circuit_lora as cl

    path = cl.save_netcdf(view.checkpoints, tmp_path / "circuits.nc")
    loaded = xr.load_dataset(path)
    assert isinstance(loaded.attrs["params"], str)
    tasks, opts, why = view.noise_floor_samples(loaded)
    assert why == "" and len(tasks) == cf.NOISE_SAMPLES and len(tasks[0]) == N_PROMPTS
    assert [t.clean for t in tasks][0] == ca.make_task(view.task, N_PROMPTS, seed=0).clean
    assert opts == {"method": "eap-ig", "metric": "kl", "ig_steps": 5, "top_percent": 5.0}
