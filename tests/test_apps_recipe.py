"""`apps._recipe.render`: the one writer of the pages' "Copy as code" from their records.

A hand-worked recipe renders to the text written out below; rendered code compiles and runs;
names read before the snippet defines them are refused at render time; user strings, odd floats
and edits come back equal when the code runs.
"""
from __future__ import annotations

import math

import pytest

from apps._recipe import (EDITS, MODEL, Call, Expr, Let, Note, Recipe, Ref, recipe_from_json,
                          recipe_to_json, render)


def _run(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "<recipe>", "exec"), namespace)  # noqa: S102 - code written by the test
    return namespace


def test_a_hand_worked_recipe_renders_to_the_expected_text():
    recipe = _hand_worked()
    assert render(recipe) == HAND_WORKED


def _hand_worked() -> Recipe:
    sat = "explorer.analyses.saturation"
    return Recipe(
        model="tiny-llama",
        transform=Call("model", f"{sat}.random_init_twin", (MODEL,), {"seed": 0},
                       "the random-init weights"),
        inputs={"prompt": "The cat sat", "k": 3},
        aliases={sat: "sat", "numpy": "np"},
        steps=[
            Call("texts", f"{sat}.corpus_chunks", (MODEL, Call(None, f"{sat}.load_corpus")),
                 {"max_tokens": 200}),
            Call("result", f"{sat}.saturation_analysis", (MODEL, Ref("texts")),
                 {"tau": 0.5, "probe": False}, "strip, tau"),
            Expr("n", "int(result.mask.isel(prompt=0).sum())"),
            Note("the strip"),
            Call("strip", "result.sat_layer.isel", (), {"prompt": 0, "rank": Ref("slice(0, k)")}),
            Expr("_, counts", "np.unique([1, 1, 2], return_counts=True)"),
            Note(),
            Call("ds", "explorer.trace", (MODEL, [Ref("prompt")]),
                 {"sites": ("attn_pattern",), "layers": [1]}),
            Call("table", "explorer.head_atlas.atlas_table",
                 (Call(None, "explorer.head_atlas", ([Ref("ds")],), {"model": MODEL}),)),
            Call("edges", "sorted", (Call(None, "explorer.analyses.circuits.circuit_edges",
                                          (Ref("ds"), None)),)),
            Let("runs", {1: Call(None, "explorer.analyses.parity.parity_run")}, "by head count"),
        ])


HAND_WORKED = '''\
import numpy as np

import explorer
from explorer.analyses import saturation as sat
from explorer.analyses.circuits import circuit_edges
from explorer.analyses.parity import parity_run
from explorer.head_atlas import atlas_table

model = explorer.load_model('tiny-llama')
model = sat.random_init_twin(model, seed=0)  # the random-init weights
prompt = 'The cat sat'
k = 3
texts = sat.corpus_chunks(model, sat.load_corpus(), max_tokens=200)
result = sat.saturation_analysis(model, texts, tau=0.5, probe=False)  # strip, tau
n = int(result.mask.isel(prompt=0).sum())
# the strip
strip = result.sat_layer.isel(prompt=0, rank=slice(0, k))
_, counts = np.unique([1, 1, 2], return_counts=True)

ds = explorer.trace(model, [prompt], sites=('attn_pattern',), layers=[1])
table = atlas_table(explorer.head_atlas([ds], model=model))
edges = sorted(circuit_edges(ds, None))
runs = {1: parity_run()}  # by head count
'''


def test_the_records_round_trip_through_json():
    import json

    from explorer.interventions import Ablate, Steer

    edits = [Ablate(0, 1), Steer(layer=1, vector=[0.5, -1.0], alpha=2.0)]
    values = {"nan": float("nan"), "pair": ("a", 1), "keys": {(1, 2): [3], "k": {"x": None}},
              "ref": [Ref("prompt")]}
    recipe = _hand_worked()
    recipe = Recipe(model=recipe.model, transform=recipe.transform, edits=edits,
                    inputs={**recipe.inputs, **values}, steps=recipe.steps,
                    aliases=recipe.aliases, imports=["xarray"])
    text = recipe_to_json(recipe)
    back = recipe_from_json(json.dumps(json.loads(text)))
    assert render(back) == render(recipe) and recipe_to_json(back) == text
    assert back.steps == recipe.steps and back.transform == recipe.transform
    assert back.inputs["pair"] == ("a", 1) and back.inputs["keys"] == {(1, 2): [3],
                                                                         "k": {"x": None}}
    assert math.isnan(back.inputs["nan"]) and back.inputs["ref"] == [Ref("prompt")]
    assert [e.to_dict() for e in back.edits] == [e.to_dict() for e in edits]


def test_rendered_code_compiles_and_runs():
    recipe = Recipe(inputs={"xs": [3, 1, 2]}, aliases={"numpy": "np"}, steps=[
        Call("ordered", "sorted", (Ref("xs"),), {"reverse": True}),
        Call("total", "numpy.sum", (Ref("ordered"),)),
        Expr("first, *rest", "ordered"),
        Expr("squares", "{x: x * x for x in xs}"),
        Call(None, "ordered.append", (0,)),
        Expr("shifted", "list(map(lambda v: v + 1, ordered))")])
    code = render(recipe)
    compile(code, "<recipe>", "exec")
    ns = _run(code)
    assert ns["ordered"] == [3, 2, 1, 0] and ns["total"] == 6
    assert (ns["first"], ns["rest"]) == (3, [2, 1])      # unpacked before the append
    assert ns["squares"] == {3: 9, 1: 1, 2: 4} and ns["shifted"] == [4, 3, 2, 1]
    assert "import numpy as np\n" in code and "total = np.sum(ordered)" in code


@pytest.mark.parametrize("step, name", [
    (Call("y", "sorted", (Ref("x"),)), "x"),                    # an argument
    (Call("y", "x.sel", (), {"layer": 1}), "x"),                 # the method of a result
    (Expr("y", "[v for v in values if v > limit]"), "values"),   # inside a comprehension
    (Let("y", [Ref("later")]), "later"),                         # a reference inside a value
    (Call("y", "sorted", ([1],), {"key": Ref("undefined_fn")}), "undefined_fn"),
    (Expr("x['a']", "1"), "x"),                                  # a subscripted target
])
def test_a_name_read_before_it_is_defined_is_refused_at_render_time(step, name):
    with pytest.raises(ValueError, match=f"'{name}' before the snippet defines it"):
        render(Recipe(steps=[step, Let("x", 1), Let("values", [1]), Let("later", 2)]))


def test_what_render_refuses():
    with pytest.raises(ValueError, match="not an assignment target"):
        render(Recipe(steps=[Let("a; import os", 1)]))
    with pytest.raises(ValueError, match="not a Python expression"):
        render(Recipe(steps=[Expr("a", "1 +")]))
    with pytest.raises(ValueError, match="not a keyword argument's name"):
        render(Recipe(steps=[Call("a", "dict", (), {"x=1, y": 2})]))
    with pytest.raises(ValueError, match="would both be imported as 'trace'"):
        render(Recipe(steps=[Call("a", "explorer.trace.trace"),
                             Call("b", "explorer.other.trace")]))
    with pytest.raises(ValueError, match="would hide the import 'np'"):
        render(Recipe(aliases={"numpy": "np"}, steps=[Let("np", 1)]))
    with pytest.raises(ValueError, match="neither a builtin nor a dotted path"):
        render(Recipe(steps=[Call("a", "no_such_builtin")]))
    with pytest.raises(ValueError, match="a call named 'model'"):
        render(Recipe(model="tiny-llama", transform=Call("twin", "sorted", ([],))))
    with pytest.raises(TypeError, match="no Python literal"):
        render(Recipe(inputs={"a": object()}))
    with pytest.raises(ValueError, match="'edits' before the snippet defines it"):
        render(Recipe(steps=[Call("a", "sorted", (EDITS,))]))     # a recipe without edits


def test_user_strings_and_odd_floats_round_trip_through_the_code():
    import numpy as np

    text = 'He said "hi"\nand \'bye\'\\n; import os  # not code\t\u00e9\u2028"""'
    values = {"text": text, "texts": [text, ""], "pair": (text,), "nan": float("nan"),
              "inf": float("inf"), "ninf": -np.inf, "big": 1e300, "n": np.int64(7),
              "flag": np.bool_(True), "none": None, "nested": {"a": [1.5, (2, "x")]}}
    code = render(Recipe(inputs=values, steps=[
        Call("joined", "str.join", ("|", Ref("texts"))),
        Let("copy", [text]),
        Call("c", "dict", (), {"label": text}, comment='a "comment"\nimport os')]))
    assert not [line for line in code.splitlines() if line.startswith("import")]
    assert code.count("\n") == len(values) + 3
    ns = _run(code)
    for name in ("text", "texts", "pair", "inf", "ninf", "big", "none", "nested"):
        assert ns[name] == values[name] and type(ns[name]) is type(values[name]), name
    assert math.isnan(ns["nan"]) and ns["n"] == 7 and ns["flag"] is True
    assert ns["joined"] == f"{text}|" and ns["copy"] == [text] and ns["c"] == {"label": text}
    assert "float('nan')" in code and "-float('inf')" in code


def test_imports_are_derived_from_what_the_code_uses_and_deduplicated():
    it = "explorer.analyses.itda"
    code = render(Recipe(
        aliases={"explorer.analyses.icl_heads": "ih", "xarray": "xr", "numpy": "np",
                 "explorer.analyses.user_items": "user_items"},
        imports=[f"{it}.ITDA"],
        steps=[Call("a", f"{it}.itda_tau_sweep"), Call("b", f"{it}.itda_reconstruction"),
               Call("c", f"{it}.itda_tau_sweep"),
               Call("d", "explorer.analyses.icl_heads.fv_scores"),
               Call("e", "explorer.analyses.icl_heads.induction_scores"),
               Expr("f", "user_items.parse_icl_pairs('a -> b')"), Call("g", "explorer.trace"),
               Call("h", "explorer.load_model", ("x",))]))
    head = code.split("\n\n")[0].splitlines()
    assert head == ["import explorer",
                    "from explorer.analyses import icl_heads as ih",
                    "from explorer.analyses import user_items",
                    "from explorer.analyses.itda import ITDA, itda_reconstruction, itda_tau_sweep"]
    assert "d = ih.fv_scores()" in code and "c = itda_tau_sweep()" in code   # xr, np: unused
    assert render(Recipe()) == "\n"


@pytest.mark.slow
def test_edits_round_trip_through_the_rendered_code(tiny_model):
    import numpy as np

    import explorer
    from explorer.interventions import Ablate, Scale, Steer

    vector = np.linspace(-1, 1, tiny_model.spec.d_model).astype("float32")
    edits = [Ablate(0, 1), Scale(1, 3, 0.5), Steer(layer=2, vector=vector, alpha=1.5)]
    code = render(Recipe(model=tiny_model.spec.name, edits=edits, inputs={"prompt": "The cat"},
                         steps=[Call("ds", "explorer.trace", (MODEL, [Ref("prompt")]),
                                     {"sites": ("resid_post",), "edits": EDITS})]))
    ns = _run(code)
    assert explorer.edits_to_json(ns["edits"]) == explorer.edits_to_json(edits)
    assert [type(e) for e in ns["edits"]] == [Ablate, Scale, Steer]
    np.testing.assert_array_equal(ns["edits"][2].vector, vector)
    want = explorer.trace(tiny_model, ["The cat"], sites=("resid_post",), edits=edits)
    np.testing.assert_allclose(ns["ds"].resid_post.values, want.resid_post.values, atol=1e-6)
