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
    n = len(tiny_model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])

    def readable(t):   # a target string names it again after the prompt (no byte fragment)
        text = tiny_model.tokenizer.decode([t])
        return bool(text) and tiny_model.tokenizer(
            PROMPT + text, add_special_tokens=False)["input_ids"][n:n + 1] == [t]

    top = next(int(i) for i in np.argsort(-last[1], kind="stable") if readable(int(i)))
    if top == the:   # then the clean prompt's best other token
        top = next(int(i) for i in np.argsort(-last[0], kind="stable")
                   if int(i) != the and readable(int(i)))
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


def test_no_counterfactual_is_mean_ablation_and_the_page_says_so(tiny_model):
    """An empty counterfactual: the task's baseline is the mean (the scores those of
    `prompt_task` without a replacement, recomputed here), and the scope line says so."""
    view = CircuitsView(tiny_model, background=False, autostart=False, task=PROMPT_TASK,
                        prompt=PROMPT, counterfactual="", explain=" the")
    assert "mean ablation" in view.scope().on and PROMPT in view.scope().on
    with torch.enable_grad():
        view._request_scores()
    assert view.error == "" and view._task.baseline == "mean"
    with torch.enable_grad():
        want = ca.edge_scores(tiny_model, ca.prompt_task(tiny_model, PROMPT, "", "",
                                                         answer=" the"), batch_size=1)
    np.testing.assert_allclose(view.scores["score"].values, want["score"].values, atol=1e-6)
    assert "mean ablation" in view.scope().on and "' the'" in view.scope().on
    assert "ca.prompt_task(model, " in view.code_snippet() and "# mean ablation" in \
        view.code_snippet()


def test_clicking_a_token_and_typing_its_replacement_sets_the_counterfactual(tiny_model):
    view = CircuitsView(tiny_model, background=False, autostart=False, task=PROMPT_TASK,
                        prompt=PROMPT)
    ids = tiny_model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    pieces = [tiny_model.tokenizer.decode([i]) for i in ids]
    assert view._strip.tokens == [p.replace(" ", "·") for p in pieces]
    the = pieces.index(" the")                # a one-token word of tiny-llama's tokenizer
    view._strip.selected = [the]             # a click on the strip
    assert view.counterfactual == f"the@{the}=" and view._strip.selected == [the]
    view.replacement = "a"
    assert view.counterfactual == f"the@{the}=a"
    with torch.enable_grad():
        view._request_scores()
    assert view.error == ""
    assert view._task.corrupt == [PROMPT.replace(" the ", " a ", 1)]
    assert view._task.baseline == "counterfactual"
    blank = pieces.index(" ")
    with pytest.raises(ValueError, match=rf"token {blank} of the prompt is whitespace"):
        view.click_token(blank)
    with pytest.raises(ValueError, match=r"`pos` must be a token position of the prompt in "
                                         r"\[0, \d+\]; got 99"):
        view.click_token(99)
    view.prompt = "Hello there"                # a new prompt: new tokens, nothing picked
    assert view._strip.selected == [] and len(view._strip.tokens) == len(
        tiny_model.tokenizer("Hello there", add_special_tokens=False)["input_ids"])


def _second_john(tokenizer) -> tuple[int, int]:
    """Token positions (first token of each) of the two ' John's of PROMPT, found from the
    characters here: 14 and 38 are where 'John' starts."""
    enc = tokenizer(PROMPT, add_special_tokens=False, return_offsets_mapping=True)
    spans = enc["offset_mapping"]
    assert PROMPT.index("John") == 14 and PROMPT.rindex("John") == 38
    first = next(i for i, (a, b) in enumerate(spans) if a <= 14 < b)
    second = next(i for i, (a, b) in enumerate(spans) if a <= 38 < b)
    return first, second


@pytest.mark.parametrize("model_name", ["tiny_model", pytest.param("smollm2",
                                                                  marks=pytest.mark.integration)])
def test_a_clicked_token_is_replaced_at_its_position(model_name, request):
    """Clicking the second John and typing its replacement replaces the second John, and the
    page says which position; the typed 'John=Mary', ambiguous, is refused naming both
    positions."""
    model = request.getfixturevalue(model_name)
    tok = model.tokenizer
    first, second = _second_john(tok)
    view = CircuitsView(model, background=False, autostart=False, task=PROMPT_TASK,
                        prompt=PROMPT)
    view._strip.selected = [second]
    token = tok.decode([tok(PROMPT, add_special_tokens=False)["input_ids"][second]])
    view.replacement = " M" if token.strip() == "J" else " Mary"   # tiny-llama: one letter
    r = view.replacement_of(PROMPT, view.counterfactual)
    if token.strip() == "J":    # tiny-llama spells John in letters: its J becomes M
        want = ("When Mary and John went to the store, Mohn gave a drink to", "'J' -> 'M'")
    else:                       # SmolLM2: the token ' John' becomes ' Mary'
        want = ("When Mary and John went to the store, Mary gave a drink to",
                "' John' -> ' Mary'")
    assert view.counterfactual == f"{token.strip()}@{second}={view.replacement.strip()}"
    assert r.position == second and r.corrupt == want[0]
    assert r.describe() == f"position {second}: {want[1]}"
    with pytest.raises(ValueError, match=rf"the word 'John' occurs 2 times in the prompt, at "
                                         rf"token positions {first} and {second}; click"):
        view.replacement_of(PROMPT, "John=Mary")
    view.counterfactual = "John=Mary"
    view._request_scores()
    assert f"positions {first} and {second}" in view.error and view.scores is None
