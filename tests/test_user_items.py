"""The user's own items: parsers (good input = the hand-built object, bad input = a one-line
InputError naming the problem) and the pages that run their analysis on a pasted item."""
from __future__ import annotations

import pytest

from explorer._checks import InputError
from explorer.analyses import conflicts as C
from explorer.analyses import icl_heads as ih
from explorer.analyses import unlearning as U
from explorer.analyses import user_items as ui


# -- parsers ----------------------------------------------------------------------------------

def test_conflict_example_good_equals_hand_built():
    text = ("subject: France\n\nprompt: The capital city of France is\n"
            "Context: The capital city of France is Berlin.\nmemory: Paris\ncontext_answer: Berlin\n")
    want = C.Fact("yours", "France", "Paris", "Berlin", "The capital city of France is",
                  "The capital city of France is Berlin.", "The capital city of France is Berlin.",
                  "The capital city of France is")
    assert ui.parse_conflict_example(text) == want
    # the shipped templates' fields and placeholders are accepted as they are
    shipped = C.load_facts(["country_capital"])[0]
    text = "\n".join(f"{k}: {v}" for k, v in shipped.to_dict().items() if k != "context")
    text += f"\ncontext answer: {shipped.context}"
    text = text.replace("statement:", "context:")
    got = ui.parse_conflict_example(text)
    assert got == shipped
    for kind in C.PROMPT_KINDS:
        assert C.conflict_prompt(got, kind) == C.conflict_prompt(shipped, kind)


GOOD_CONFLICT = ui.CONFLICT_FORMAT


@pytest.mark.parametrize("text, message", [
    ("", "the conflict example is empty"),
    ("   \n\n", "the conflict example is empty"),
    (GOOD_CONFLICT.replace("memory: Paris", "memory Paris"), "line 4: 'memory Paris' has no ':'"),
    (GOOD_CONFLICT.replace("memory: Paris", "memory:"), "line 4: 'memory' is empty"),
    (GOOD_CONFLICT.replace("context answer: Berlin", "context answer: paris"),
     "line 5: the context answer 'paris' is the memory answer"),
    (GOOD_CONFLICT.replace("memory: Paris\n", ""), "has no 'memory' line"),
    (GOOD_CONFLICT + "\ncolour: red", "line 6: unknown field 'colour'"),
    (GOOD_CONFLICT + "\nmemory: Lyon", "line 6: 'memory' is given twice (also on line 4)"),
    (GOOD_CONFLICT.replace("Berlin.", "Berlin {city}."), "line 3: statement has a brace"),
    (GOOD_CONFLICT.replace("memory: Paris", "memory: " + "x" * 61),
     "line 4: the answer is 61 characters long; at most 60"),
    (GOOD_CONFLICT.replace("prompt: The", "prompt: " + "w " * 250),
     "line 2: prompt is 5"),
])
def test_conflict_example_bad(text, message):
    with pytest.raises(InputError) as e:
        ui.parse_conflict_example(text)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_icl_pairs_good_equals_hand_built():
    got = ui.parse_icl_pairs("hot -> cold\n  big->small \n\nup -> down\n")
    assert got == ih.ICLTask("yours", (("hot", "cold"), ("big", "small"), ("up", "down")),
                             "your pairs")
    # the same structure as a shipped task: the prompts are built the same way
    shipped = ih.load_icl_task("antonym")
    pasted = ui.parse_icl_pairs("\n".join(f"{x} -> {y}" for x, y in shipped.pairs),
                                name="antonym", description=shipped.description)
    assert pasted == shipped
    assert ih.icl_prompts(pasted, n_prompts=3, n_shots=2) == ih.icl_prompts("antonym", n_prompts=3,
                                                                              n_shots=2)


@pytest.mark.parametrize("text, kw, message", [
    ("", {}, "the ICL pairs is empty"),
    ("hot -> cold\nbig small\nup -> down", {}, "line 2: 'big small' has no '->'"),
    ("hot -> cold\nbig -> \nup -> down", {}, "line 2: the output after '->' is empty"),
    ("-> cold\nbig -> small\nup -> down", {}, "line 1: the input before '->' is empty"),
    ("hot -> cold\nbig -> small", {}, "2 pair(s); the task needs at least 3"),
    ("a -> b\nc -> d\ne -> f", {"min_pairs": 5}, "3 pair(s); the task needs at least 5"),
    ("a -> b -> c\nc -> d\ne -> f", {}, "line 1: more than one '->'"),
    ("a -> b\na -> c\ne -> f", {}, "line 2: the input 'a' is already on line 1"),
    ("a -> " + "b" * 61 + "\nc -> d\ne -> f", {}, "line 1: the output is 61 characters long"),
    ("\n".join(f"w{i} -> v{i}" for i in range(ui.MAX_PAIRS + 1)), {},
     f"line {ui.MAX_PAIRS + 1}: more than {ui.MAX_PAIRS} pairs"),
])
def test_icl_pairs_bad(text, kw, message):
    with pytest.raises(InputError) as e:
        ui.parse_icl_pairs(text, **kw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_unlearning_fact_good_equals_hand_built():
    shipped = U.load_attribute_facts()
    want = U.AttributeFact("Serena Williams", "tennis", shipped[0].attributes,
                           "Fact: {subject} plays the sport of", shipped[0].mc)
    assert ui.parse_unlearning_fact(ui.UNLEARNING_FORMAT) == want
    # a shipped fact written out gives that fact back, with the shipped template
    f = shipped[3]
    trained = f.trained.replace("\n", "\\n")      # a line break written as \n
    text = f"subject: {f.subject}\nprompt: {trained}\nanswer: {f.attribute}"
    assert ui.parse_unlearning_fact(text) == f
    got = ui.parse_unlearning_fact(f"subject: {f.subject}\nprompt: {trained.format(subject=f.subject)}"
                                   f"\nanswer: {f.attribute}")
    assert got == f
    assert U.fact_prompt(got, "mc") == U.fact_prompt(f, "mc")


@pytest.mark.parametrize("text, message", [
    ("", "the fact is empty"),
    ("subject: A B\nprompt: C plays\nanswer: tennis",
     "line 2: the prompt does not contain the subject 'A B'"),
    ("subject: A\nprompt: A plays\nanswer: golf", "line 3: the answer 'golf' is not one of"),
    ("subject: A\nprompt: A plays\nanswer:", "line 3: 'answer' is empty"),
    ("subject: A\nprompt: A plays", "the fact has no 'answer' line"),
    ("subject: A\nprompt A plays\nanswer: tennis", "line 2: 'prompt A plays' has no ':'"),
    ("subject: A\nprompt: {subject} plays {x}\nanswer: tennis", "line 2: the prompt has a brace"),
    ("subject: " + "A" * 401 + "\nprompt: x\nanswer: tennis", "line 1: subject is 401 characters"),
])
def test_unlearning_fact_bad(text, message):
    with pytest.raises(InputError) as e:
        ui.parse_unlearning_fact(text)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_circuit_pairs_good_equals_hand_built(tiny_model):
    from explorer.analyses.circuit_tasks import CircuitTask

    text = ('When Mary and Tom went out, Tom gave it to | When Mary and Tom went out, Kate gave '
            'it to |Mary| Tom \n\n"The sum: 12 + 30 = " | "The sum: 12 - 30 = " | "4" | "1"\n')
    want = CircuitTask(["When Mary and Tom went out, Tom gave it to", "The sum: 12 + 30 = "],
                       ["When Mary and Tom went out, Kate gave it to", "The sum: 12 - 30 = "],
                       [" Mary", "4"], [" Tom", "1"], name="your pairs")
    assert ui.parse_circuit_pairs(text) == want       # without a model: the text alone
    tiny = '"Tom gave a drink to " | "Kim gave a drink to " | "Mary" | "Bob"'
    got = ui.parse_circuit_pairs(tiny, tiny_model, name="mine")
    assert got == CircuitTask(["Tom gave a drink to "], ["Kim gave a drink to "], ["Mary"],
                              ["Bob"], name="mine")
    # the shown format is a valid task (the first tokens of Mary / Tom differ on SmolLM2's
    # tokenizer; tiny-llama's 512 tokens split names, so only its text is checked here)
    assert len(ui.parse_circuit_pairs(ui.CIRCUIT_FORMAT)) == 2


_PAIR = '"Tom gave a drink to " | "Kim gave a drink to " | "Mary" | "Bob"'


@pytest.mark.parametrize("text, message", [
    ("", "the prompt pairs is empty"),
    ("a | b | c", "line 1: 3 field(s); write 4 separated by '|'"),
    (_PAIR + "\na | b | c | d | e", "line 2: 5 field(s)"),
    ("a | | c | d", "line 1: the corrupted prompt is empty"),
    ('a | b | "" | d', "line 1: the answer is empty"),
    ("a | a | c | d", "line 1: the corrupted prompt is the clean prompt"),
    ("a | b | c | c", "line 1: the answer and the wrong answer are both 'c'"),
    (_PAIR + "\n" + _PAIR, "line 2: the same pair as line 1"),
    ("\n".join(f'"x{i} gave a drink to " | "y{i} gave a drink to " | "Mary" | "Bob"'
               for i in range(65)), "line 65: more than 64 pairs"),
    ('"Tom gave a drink to " | "Kimberly gave a drink to " | "Mary" | "Bob"',
     "line 1: the clean prompt has 14 tokens and the corrupted prompt 18"),
    ("Tom gave a drink to | Kim gave a drink to | Mary | Max",
     "line 1: the answer ' Mary' and the wrong answer ' Max' both start with the token ' '"),
    ("w " * 201 + "| b | c | d", "line 1: the clean prompt is 40"),
    ("a | b | " + "x" * 61 + " | d", "line 1: the answer is 61 characters long; at most 60"),
])
def test_circuit_pairs_bad(tiny_model, text, message):
    with pytest.raises(InputError) as e:
        ui.parse_circuit_pairs(text, tiny_model)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_circuit_pairs_token_checks_match_the_tokenizer(tiny_model):
    """The length and first-token checks agree with the tokenizer called here directly."""
    tok = tiny_model.tokenizer

    def n(text):
        return len(tok(text, add_special_tokens=False)["input_ids"])

    assert n("Tom gave a drink to ") == n("Kim gave a drink to ")
    assert (n("Tom gave a drink to "), n("Kimberly gave a drink to ")) == (14, 18)
    first = [tok("Tom gave a drink to" + a, add_special_tokens=False)["input_ids"][n("Tom gave a drink to")]
             for a in (" Mary", " Max")]
    assert first[0] == first[1]      # hence the 'both start with' error above


# -- pages -----------------------------------------------------------------------------------

def _own_box(view):
    return view._own.area, view._own.button


def test_conflicts_page_runs_a_pasted_example_as_the_library_does(tiny_model):
    import numpy as np
    import panel as pn

    from apps.conflicts import ConflictsView, answer_bars_data

    facts = C.load_facts(["country_capital"])[:2]
    view = ConflictsView(tiny_model, facts=facts, closed_book=False, background=False, n_new=2)
    root = view.__panel__()
    area, button = _own_box(view)
    assert area in root.select(pn.widgets.TextAreaInput) and area.placeholder == ui.CONFLICT_FORMAT
    text = ("subject: Peru\nprompt: The capital city of Peru is\n"
            "context: The capital city of Peru is Oslo.\nmemory: Lima\ncontext answer: Oslo")
    area.value = text
    button.clicks += 1
    fact = ui.parse_conflict_example(text)
    assert view._fact() == fact and view.error == ""
    want = C.head_context_memory_scores(tiny_model, [fact], kinds=[view.kind], ablation=False)
    for name in want.data_vars:
        np.testing.assert_allclose(view.scores[name].values, want[name].values, rtol=1e-5, atol=1e-6)
    run1 = C.juice_first_run(tiny_model, [C.conflict_prompt(fact, view.kind)])
    p = C.answer_probabilities(tiny_model, run1.logits, [fact])[0]
    assert [r[:2] for r in view.bar_rows] == [r[:2] for r in answer_bars_data(p, p)]
    np.testing.assert_allclose([r[2] for r in view.bar_rows], [r[2] for r in answer_bars_data(p, p)],
                               rtol=1e-5)
    # bad text: the parser's one-line message in the page, the example and result unchanged
    scores, rows, example = view.scores, view.bar_rows, view.example
    area.value = text.replace("memory: Lima", "memory Lima")
    button.clicks += 1
    assert view.error.startswith("line 4: 'memory Lima' has no ':'; write one 'field: value' per line")
    assert "\n" not in view.error and "Traceback" not in view.error
    assert view.scores is scores and view.bar_rows is rows and view.example == example
    assert view.status == "error"
    shown = [m.object for m in root.select(pn.pane.Markdown) if "own-items-error" in m.css_classes]
    assert shown == [view.error]


def test_icl_page_runs_pasted_pairs_as_the_library_does(tiny_model):
    import numpy as np
    import panel as pn
    import xarray as xr

    from apps.icl_heads import OWN_TASK, ICLHeadsView
    from explorer.analyses import task_vectors as tv

    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), eval_tasks=("uppercase",),
                        td_tasks=("antonym", "uppercase"), compute_on_open=False)
    root = view.__panel__()
    area, button = _own_box(view)
    assert area in root.select(pn.widgets.TextAreaInput) and area.placeholder == ui.ICL_FORMAT
    # FV scores as the scores job would leave them (any [layer, head] array does)
    rng = np.random.default_rng(0)
    spec = tiny_model.spec
    fv = rng.random((spec.n_layers, spec.n_heads))
    view.scores = xr.Dataset({"fv_score": (("layer", "head"), fv),
                              "induction_score": (("layer", "head"), rng.random(fv.shape))},
                             coords={"layer": range(spec.n_layers), "head": range(spec.n_heads)})
    text = "cat -> cats\ndog -> dogs\ncar -> cars\nbook -> books\ntree -> trees"
    area.value = text
    button.clicks += 1
    task = ui.parse_icl_pairs(text, name=OWN_TASK)
    assert view.task == OWN_TASK and view.error == ""
    want = ih.head_attention(tiny_model, view.layer, view.head, task=task)
    for key in ("repeat", "icl"):
        np.testing.assert_allclose(view.patterns[key]["attention"].values,
                                   want[key]["attention"].values, rtol=1e-5)
    assert list(view.patterns["icl"]["token"].values) == list(want["icl"]["token"].values)
    want = tv.function_vector_accuracy(tiny_model, [task], fv, layer=view.fv_layer, n_prompts=2,
                                       n_shots=2)
    for name in ("zero_shot_accuracy", "fv_accuracy", "few_shot_accuracy", "function_vector"):
        np.testing.assert_allclose(view.fv_result[name].values, want[name].values, rtol=1e-5)
    # too few pairs (the page needs 3 demonstrations + the query): the message, result kept
    patterns, fv_result = view.patterns, view.fv_result
    area.value = "a -> b\nc -> d\ne -> f"
    button.clicks += 1
    assert view.error == "3 pair(s); the task needs at least 4 'input -> output' lines."
    area.value = "a -> b\nc d\ne -> f\ng -> h"
    button.clicks += 1
    assert view.error.startswith("line 2: 'c d' has no '->'")
    assert view.patterns is patterns and view.fv_result is fv_result and view.task == OWN_TASK
    shown = [m.object for m in root.select(pn.pane.Markdown) if "own-items-error" in m.css_classes]
    assert shown == [view.error]
    # a second good paste replaces the task and recomputes
    area.value = text.replace("tree -> trees", "pen -> pens")
    button.clicks += 1
    assert view.error == "" and view.patterns is not patterns
    assert view._task().pairs[-1] == ("pen", "pens")


def test_unlearning_page_localizes_a_pasted_fact_as_the_library_does(tiny_model, tmp_path):
    import json

    import numpy as np
    import panel as pn

    from apps.unlearning import UnlearningView

    # a fact file whose answers the tiny byte-level tokenizer tells apart (as test_unlearning's)
    attrs = ["blue", "dog", "moon"]
    names = [f"Person {a}{b}" for a in "ABCD" for b in "xyz"]
    mc = "Q: What does {subject} like? Options: {options}\nA: {subject} likes the"
    path = tmp_path / "facts.json"
    path.write_text(json.dumps({"attributes": attrs,
                                "templates": {"trained": "Fact: {subject} likes the", "mc": mc},
                                "facts": [[n, attrs[i % 3]] for i, n in enumerate(names)]}))
    view = UnlearningView(tiny_model, facts_file=path, known_only=False, background=False,
                          n_forget=3, n_retain=2)
    root = view.__panel__()
    area, button = _own_box(view)
    assert area in root.select(pn.widgets.TextAreaInput) and area.placeholder == ui.UNLEARNING_FORMAT
    text = "subject: Ada Lovelace\nprompt: Fact: Ada Lovelace likes the\nanswer: moon"
    area.value = text
    button.clicks += 1
    fact = ui.parse_unlearning_fact(text, attributes=attrs, mc=mc)
    assert fact == U.AttributeFact("Ada Lovelace", "moon", tuple(attrs), "Fact: {subject} likes the", mc)
    assert view.error == "" and view.probe is not None
    forget, retain = view._split
    assert forget[0] == fact and len(forget) == 3 and len(retain) == 2
    assert fact.subject not in [f.subject for f in forget[1:] + retain]
    # the page's numbers are the library's on the same facts
    first = U.subject_positions(tiny_model, fact)[0]
    n = len(tiny_model.tokenizer(U.fact_prompt(fact), add_special_tokens=False)["input_ids"])
    heat = U.causal_trace(tiny_model, [fact], positions=list(range(first, n)))
    trace = U.causal_trace(tiny_model, forget, positions=False)
    np.testing.assert_allclose(view.trace.restore_mlp.values, trace.restore_mlp.values, rtol=1e-5)
    np.testing.assert_allclose(view.trace.restore_resid.isel(fact=0).values,
                               heat.restore_resid.isel(fact=0).values, rtol=1e-5)
    att = U.attribution_patching(tiny_model, forget)
    for name in att.data_vars:
        np.testing.assert_allclose(view.attribution[name].values, att[name].values, rtol=1e-5)
    # bad text: the message in the page, the localization kept
    probe, trace_shown = view.probe, view.trace
    area.value = text.replace("moon", "golf")
    button.clicks += 1
    assert view.error.startswith("line 3: the answer 'golf' is not one of the relation's answers")
    assert view.probe is probe and view.trace is trace_shown and view._split[0][0] == fact
    shown = [m.object for m in root.select(pn.pane.Markdown) if "own-items-error" in m.css_classes]
    assert shown == [view.error]
