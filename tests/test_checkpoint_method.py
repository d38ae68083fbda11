"""Circuits through fine-tuning score checkpoints the paper's way (EAP-IG on KL, Wang et al.
2025) unless told otherwise, and the prompt-resampling noise floor of the per-layer edge
change is computed on one set of weights, checked against a hand computation of D_l."""
from __future__ import annotations

import re

import numpy as np
import pytest
import xarray as xr

from explorer._checks import InputError
from explorer.analyses import circuit_lora as cl
from explorer.analyses import circuits as ca

PROMPTS = [f"{a} + {b} =" for a in range(4) for b in range(4)]
ANSWERS = [f" {a + b}" for a in range(4) for b in range(4)]


@pytest.fixture(scope="module")
def run_folder(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    cl.finetune_lora(tiny_model, PROMPTS, ANSWERS, ranks={0: 2, 1: 2, 2: 2}, steps=3,
                     batch_size=4, lr=1e-2, checkpoints=[0, 3], folder=folder)
    return folder


def test_checkpoints_default_to_eap_ig_on_kl(tiny_model, run_folder):
    task = ca.make_task("add", 4, seed=0)
    ds = cl.checkpoint_circuits(tiny_model, run_folder, task, steps=[3], ig_steps=3, batch_size=4)
    assert ds.attrs["params"]["edge_method"] == "eap-ig" and ds.attrs["params"]["metric"] == "kl"
    want = ca.edge_scores(cl.load_checkpoint(tiny_model, run_folder, 3), task, method="eap-ig",
                          steps=3, metric="kl", batch_size=4)["score"].values
    np.testing.assert_allclose(ds["score"].isel(checkpoint=0).values, want, rtol=1e-5, atol=1e-7)
    # EAP's own metric default is the logit difference (KL has no EAP gradient)
    eap = cl.checkpoint_circuits(tiny_model, run_folder, task, steps=[3], method="eap", batch_size=4)
    assert eap.attrs["params"]["metric"] == "logit_diff"
    want = ca.edge_scores(cl.load_checkpoint(tiny_model, run_folder, 3), task, method="eap",
                          metric="logit_diff", batch_size=4)["score"].values
    np.testing.assert_allclose(eap["score"].isel(checkpoint=0).values, want, rtol=1e-5, atol=1e-7)


def _d_l_by_hand(a: xr.Dataset, b: xr.Dataset, n_layers: int) -> np.ndarray:
    """D_l of Wang et al.: per source layer, the sum over edges of |s_b - s_a| (in both
    circuits), |s| (in one), 0 (in neither); input is layer 0."""
    out = np.zeros(n_layers)
    for k, src in enumerate(a["src"].values.tolist()):
        ia, ib = bool(a["in_circuit"].values[k]), bool(b["in_circuit"].values[k])
        sa, sb = float(a["score"].values[k]), float(b["score"].values[k])
        d = abs(sb - sa) if ia and ib else abs(sa) if ia else abs(sb) if ib else 0.0
        m = re.match(r"^(?:a(\d+)\.h\d+|m(\d+))$", src)
        out[0 if m is None else int(m.group(1) or m.group(2))] += d
    return out


def test_noise_floor_against_hand_made_layer_change(tiny_model):
    tasks = [ca.make_task("add", 4, seed=s) for s in (0, 1, 2)]
    floor = cl.layer_change_noise_floor(tiny_model, tasks, method="eap", top_percent=20.0,
                                        batch_size=4)
    assert list(floor.pair.values) == ["0-1", "0-2", "1-2"]
    circuits = []
    for t in tasks:
        s = ca.edge_scores(tiny_model, t, method="eap", metric="logit_diff", batch_size=4)
        top_n = max(1, int(round(0.2 * s.sizes["edge"])))
        circuits.append(xr.Dataset({"score": s["score"],
                                    "in_circuit": ca.select_circuit(s, top_n=top_n)}))
    n = tiny_model.n_layers
    for k, (i, j) in enumerate([(0, 1), (0, 2), (1, 2)]):
        np.testing.assert_allclose(floor.edge_change.values[k],
                                   _d_l_by_hand(circuits[i], circuits[j], n), rtol=1e-6)
    np.testing.assert_allclose(floor.noise_mean.values, floor.edge_change.values.mean(0))
    np.testing.assert_allclose(floor.noise_max.values, floor.edge_change.values.max(0))
    assert floor.edge_change.values.max() > 0          # different prompts give different circuits


def test_noise_floor_of_one_sample_twice_is_zero(tiny_model):
    task = ca.make_task("add", 4, seed=0)
    floor = cl.layer_change_noise_floor(tiny_model, [task, task], method="eap", batch_size=4)
    assert np.all(floor.edge_change.values == 0)
    with pytest.raises(InputError, match="at least 2 prompt samples"):
        cl.layer_change_noise_floor(tiny_model, [task])
