"""More pairs from one prompt: the same sentence with other names (`name_variants`), checked
by hand on tiny-llama (which spells names letter by letter, so only names of the same length
keep a prompt's token count), and the Circuits page's button that makes them the task and
gets the recovery its bootstrap interval."""
from __future__ import annotations

import json
import re

import pytest
import torch

from apps.circuits import OWN_TASK, PROMPT_TASK, CircuitsView
from explorer._checks import InputError
from explorer.analyses.circuit_tasks import CircuitTask, name_variants
from explorer.defaults import DATASETS_DIR

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
NAMES = json.loads((DATASETS_DIR / "circuits" / "ioi.json").read_text())["names"]


def n_tokens(model, text):
    return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_variants_put_other_names_in_the_same_places(tiny_model):
    task = CircuitTask([PROMPT], [CORRUPT], [" Mary"], [" John"])
    v = name_variants(tiny_model, task, 6)
    rows = list(zip(v.clean, v.corrupt, v.answer, v.wrong))
    assert rows[0] == (PROMPT, CORRUPT, " Mary", " John") and len(rows) == 6
    assert len(set(rows)) == 6
    for clean, corrupt, answer, wrong in rows[1:]:
        a, b = re.match(r"When (\w+) and (\w+) went", clean).groups()
        assert a != b and {a, b} <= set(NAMES) and not {a, b} & {"Mary", "John"}
        by_hand = [s.replace("Mary", "\0").replace("John", b).replace("\0", a)
                   for s in (PROMPT, CORRUPT, " Mary", " John")]
        assert [clean, corrupt, answer, wrong] == by_hand
        assert (n_tokens(tiny_model, clean), n_tokens(tiny_model, corrupt)) == (
            n_tokens(tiny_model, PROMPT), n_tokens(tiny_model, CORRUPT))
    assert v.baseline == task.baseline


def test_a_pair_without_a_listed_name_is_refused(tiny_model):
    task = CircuitTask(["The capital of France is"], ["The capital of Spain is"],
                       [" Paris"], [" Madrid"])
    with pytest.raises(InputError, match="names none of"):
        name_variants(tiny_model, task, 4)
    with pytest.raises(InputError, match="`n` must be an int in"):
        name_variants(tiny_model, CircuitTask([PROMPT], [CORRUPT], [" Mary"], [" John"]), 1)


def test_the_page_button_computes_the_circuit_of_eight_pairs_with_an_interval(tiny_model):
    view = CircuitsView(tiny_model, background=False, autostart=False, task=PROMPT_TASK,
                        prompt="Mary met John at the store and gave a drink to",
                        counterfactual="Mary=Lisa")
    view.__panel__()
    with torch.enable_grad():
        task = view.use_name_variants()
    assert task is not None and len(task) == 8 and view.task == OWN_TASK
    assert task.clean[0] == "Mary met John at the store and gave a drink to"
    assert task.corrupt[0] == "Lisa met John at the store and gave a drink to"
    assert view.shown.n_pairs == 8 and view.error == ""
    assert view.stale_note() == "" and "(outdated)" not in view.redraw()["title"]
    caption = view._caption()
    assert not caption.startswith("Outdated")
    assert "8 pairs" in caption and "95 % bootstrap interval over the 8 pairs" in caption
    # the pairs are in the box as the user would have typed them, and parse back the same
    assert view._own.area.value.count("\n") == 7


def test_the_page_button_without_a_counterfactual_says_why(tiny_model):
    view = CircuitsView(tiny_model, background=False, autostart=False, task=PROMPT_TASK,
                        prompt="Mary met John at the store and gave a drink to")
    view.__panel__()
    assert view.use_name_variants() is None
    assert "set a counterfactual first" in view.error and view.task == PROMPT_TASK


def test_a_generated_task_is_not_outdated_once_computed(tiny_model):
    """The request of a generated task names no prompts: the result's own are not compared."""
    view = CircuitsView(tiny_model, background=False, autostart=False, task="add", n_prompts=4)
    view.__panel__()
    with torch.enable_grad():
        view._request_scores()
    assert view.shown is not None and len(view.shown.prompts) == 4
    assert view.stale_note() == ""
    view.n_prompts = 6                       # a new request computes (inline here) its own
    assert len(view.shown.prompts) == 6 and view.stale_note() == ""
