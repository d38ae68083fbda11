"""The Circuits page's task built from the user's prompt and a counterfactual word, on the
tiny model: the pair, the targets (the corrupted prompt's top token found here by its own
run), the scores (edge_scores of the pair written out here), the scope line and the errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import explorer
from apps.circuits import PROMPT_TASK, CircuitsView
from explorer.analyses import circuits as ca
from explorer.analyses.circuit_tasks import CircuitTask

PROMPT = "When Mary and John went to the store, John gave a drink to"


def test_prompt_task_pair_targets_and_scores(tiny_model):
    view = CircuitsView(tiny_model, background=False, autostart=False, task=PROMPT_TASK,
                        prompt=PROMPT, counterfactual="Mary=Anna", explain=" the")
    with torch.enable_grad():
        view._request_scores()
    assert view.error == ""
    task = view._task
    corrupt = "When Anna and John went to the store, John gave a drink to"
    assert task.clean == [PROMPT] and task.corrupt == [corrupt] and task.answer == [" the"]
    # the wrong target: the corrupted prompt's top next token, by a run here
    last = explorer.run_with(tiny_model, [PROMPT, corrupt], positions=[-1])["logits"].values[:, 0]
    the = tiny_model.tokenizer(PROMPT + " the", add_special_tokens=False)["input_ids"][-1]
    top = int(np.argmax(last[1]))
    if top == the:   # then the clean prompt's best other token
        top = next(int(i) for i in np.argsort(-last[0], kind="stable") if int(i) != the)
    assert task.wrong == [tiny_model.tokenizer.decode([top])]
    mine = CircuitTask(clean=[PROMPT], corrupt=[corrupt], answer=[" the"],
                       wrong=[tiny_model.tokenizer.decode([top])], name=PROMPT_TASK)
    with torch.enable_grad():
        want = ca.edge_scores(tiny_model, mine, batch_size=1)
    np.testing.assert_allclose(view.scores["score"].values, want["score"].values, atol=1e-6)
    scope = view.scope()
    assert PROMPT in scope.on and corrupt in scope.on and "' the'" in scope.on
    assert "ca.prompt_task(model," in view.code_snippet()
    # one pair: no bootstrap interval, the caption says what it recovers without one
    assert view.default_interval() is None


def test_prompt_task_errors_name_the_bad_value(tiny_model):
    view = CircuitsView(tiny_model, background=False, autostart=False, task=PROMPT_TASK,
                        prompt=PROMPT, counterfactual="Mary")
    view._request_scores()
    assert "needs a counterfactual" in view.error and "'Mary'" in view.error
    with pytest.raises(ValueError, match="the word 'Bob' is not in the prompt; its words:"):
        ca.prompt_task(tiny_model, PROMPT, "Bob", "Al")
    with pytest.raises(ValueError, match="the prompt is empty"):
        ca.prompt_task(tiny_model, "  ", "Bob", "Al")


def test_scope_and_link_params_of_the_task_pairs(tiny_model):
    view = CircuitsView(tiny_model, background=False, autostart=False, task="add",
                        n_prompts=4)
    assert view.scope().on == "task pairs: add, 4 pairs (not the sidebar prompt)"
    assert view.scope().edits.startswith("not applicable")
    assert {"task", "method", "n_edges", "selected"} <= set(view.link_params)
    assert all(name in view.param for name in view.link_params)
