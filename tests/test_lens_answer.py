"""The logit lens with a workspace edit says the answer's probability clean and edited: the
clean run's top-1 after the prompt's last token, its probability without and with the edit,
checked against torch hooks on tiny-llama and against the softmax of `run_with`'s logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_lens_edits import hooked_lens_logits

import explorer
from apps._lens_heatmap import answer_line
from apps.lens import LensView
from explorer import Ablate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "The capital of France is"


def _hooked_last_probs(model, ablate=()):
    """[vocab] next-token probabilities after PROMPT: the final layer of the hooked lens
    (final norm and unembedding of the last layer's output, heads zeroed by hooks)."""
    logits = hooked_lens_logits(model, PROMPT, ablate)[-1, -1]           # [vocab]
    return torch.softmax(logits.double(), -1).numpy()


def _run_with_last_probs(model, edits=()):
    logits = explorer.run_with(model, PROMPT, list(edits)).logits.values[0, -1]
    return torch.softmax(torch.as_tensor(logits, dtype=torch.float64), -1).numpy()


def test_the_answer_probability_clean_and_edited(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, alpha=0.0, background=False)
    view.wait()
    assert view.edited_result is None and answer_line(view.edited_result) == ""
    edits = [Ablate(0, 1), Ablate(1, 2)]
    view.edits = edits
    view.wait()
    answer = view.edited_result.attrs["answer"]

    clean = _hooked_last_probs(tiny_model)
    edited = _hooked_last_probs(tiny_model, ablate=[(0, 1), (1, 2)])
    assert answer["answer_id"] == int(clean.argmax())
    assert answer["answer"] == tiny_model.token_strings([int(clean.argmax())])[0]
    a = answer["answer_id"]
    np.testing.assert_allclose(answer["clean_prob"], clean[a], rtol=1e-4)
    np.testing.assert_allclose(answer["edited_prob"], edited[a], rtol=1e-4)
    assert abs(edited[a] - clean[a]) / clean[a] > 1e-3      # the edit moves it
    assert answer["edited_top_id"] == int(edited.argmax())
    np.testing.assert_allclose(answer["edited_top_prob"], edited.max(), rtol=1e-4)
    assert answer["position"] == len(tiny_model.str_tokens(PROMPT)) - 1

    # the same from the library's plain run, with and without the edits
    np.testing.assert_allclose(answer["clean_prob"], _run_with_last_probs(tiny_model)[a],
                               rtol=1e-4)
    np.testing.assert_allclose(answer["edited_prob"],
                               _run_with_last_probs(tiny_model, edits)[a], rtol=1e-4)

    line = answer_line(view.edited_result)
    assert repr(answer["answer"]).replace("'", "&#x27;") in line
    assert f"{100 * clean[a]:.1f} %</b> clean → <b>{100 * edited[a]:.1f} %</b> edited" in line
    view.edits = []
    view.wait()
    assert view.edited_result is None and answer_line(view.edited_result) == ""


def test_with_steering_both_runs_are_steered(tiny_model):
    """The page's steering is in the clean and the edited run alike: 'clean' is without the
    workspace's edits only."""
    view = LensView(tiny_model, prompt=PROMPT, alpha=4.0, background=False)
    view.edits = [Ablate(1, 0)]
    view.wait()
    answer = view.edited_result.attrs["answer"]
    steer = view.edits_for()
    clean = _run_with_last_probs(tiny_model, steer)
    edited = _run_with_last_probs(tiny_model, [*steer, Ablate(1, 0)])
    a = int(clean.argmax())
    assert answer["answer_id"] == a
    np.testing.assert_allclose([answer["clean_prob"], answer["edited_prob"]],
                               [clean[a], edited[a]], rtol=1e-4)


def test_the_answer_line_names_a_changed_top_token():
    import xarray as xr

    ds = xr.Dataset(attrs={"answer": {
        "position": 5, "answer_id": 7, "answer": " Paris", "clean_prob": 0.41,
        "edited_prob": 0.12, "edited_top_id": 9, "edited_top": " Lyon", "edited_top_prob": 0.3}})
    line = answer_line(ds)
    assert "&#x27; Paris&#x27;" in line and "position 5" in line
    assert "<b>41.0 %</b> clean → <b>12.0 %</b> edited" in line
    assert "top-1 is <code>&#x27; Lyon&#x27;</code> (30.0 %)" in line
