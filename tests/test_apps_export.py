"""Reproducibility of the pages: every gallery page exports its data (NetCDF, CSV, a manifest)
and a snippet of code; for the pages with their own snippet, running it recomputes what the
page shows.

The exports are re-opened with xarray's own reader and compared with the page's Datasets; the
snippets run with `exec` in a fresh namespace (they load tiny-llama again by name).
"""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pandas as pd
import panel as pn
import pytest
import xarray as xr
from _views import KM_PARAMS, cheap_gallery_views, tiny_facts_file

from explorer.interventions import Ablate

NETCDF_VALUES = (np.floating, np.integer, np.bool_)


@pytest.fixture(scope="module")
def cheap_views(tmp_path_factory, one_torch_thread):
    """The gallery's pages in its order; the slow ones with small settings (as the gallery's
    browser test builds them)."""
    from apps.shattering import ShatteringView

    return cheap_gallery_views(
        tmp_path_factory.mktemp("export-views"),
        shattering=lambda km, sweep: (lambda m: ShatteringView(
            km=km, sweep=sweep, method="finetune", entity="e3", relation="A+1", distance=2)))


def _unzip(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _same_values(page: xr.Dataset, back: xr.Dataset) -> None:
    """Every numeric variable and coordinate of ``page`` is in ``back`` with the same values
    (strings compared as strings)."""
    for name, var in page.variables.items():
        assert name in back.variables, f"{name} lost"
        got = back.variables[name]
        assert got.dims == var.dims, name
        a = np.asarray(var.values)
        b = np.asarray(got.values)
        if a.dtype.kind in "fiub":
            np.testing.assert_allclose(b.astype(np.float64), a.astype(np.float64), rtol=1e-6,
                                       atol=1e-7 if a.dtype != np.float16 else 1e-3, err_msg=name,
                                       equal_nan=True)
        elif a.dtype.kind in "UO" and all(isinstance(v, str) for v in a.ravel()):
            assert b.astype(str).tolist() == a.astype(str).tolist(), name


@pytest.mark.slow
def test_every_gallery_page_exports_its_datasets_tables_and_code(cheap_views, tiny_model,
                                                                  monkeypatch, tmp_path):
    from apps._recipe import recipe_from_json, recipe_to_json, render
    from apps._view import View

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    exported, defaults = {}, []
    for title, slug, factory in cheap_views:
        view = factory(tiny_model)
        try:
            view.wait(600)
            datasets = view.export_datasets()
            tables = view.export_tables()
            files = _unzip(view.export_bytes())
            manifest = json.loads(files["manifest.json"])
            assert manifest["page"] == type(view).__name__, slug
            assert sorted(manifest["datasets"]) == sorted(n for n in files if n.endswith(".nc"))
            for name, ds in datasets.items():
                with xr.open_dataset(io.BytesIO(files[f"{name}.nc"]), engine="scipy") as back:
                    back = back.load()
                _same_values(ds, back)
                numeric = [v for v in ds.data_vars if ds[v].dtype.kind in "fiu"]
                if numeric:
                    xr.testing.assert_allclose(ds[numeric].astype(np.float64),
                                               back[numeric].astype(np.float64))
            for name, table in tables.items():
                back = pd.read_csv(io.BytesIO(files[f"{name}.csv"]))
                assert list(back.columns) == [str(c) for c in table.columns], (slug, name)
                assert len(back) == len(table), (slug, name)
            code = files["code.py"].decode()
            compile(code, f"<{slug} snippet>", "exec")
            assert code == view.code_snippet()
            recipe = view.code_recipe()            # its records, through JSON, write the same
            assert render(recipe_from_json(recipe_to_json(recipe))) == code
            if type(view).code_recipe is View.code_recipe:     # the default: its imports run
                defaults.append(slug)
                ns = _run(code)
                assert "model" not in ns or ns["model"].spec.name == "tiny-llama"
            exported[slug] = (sorted(datasets), sorted(tables))
        finally:
            view.close()
    print("pages with the default snippet:", defaults)
    assert set(exported) == {slug for _, slug, _ in cheap_views}
    assert not {"attention", "atlas", "itda", "neuron-eval", "shattering"} & set(defaults)
    # the pages that compute a Dataset on opening export it
    for slug in ("lens", "attention", "atlas", "itda", "neuron-eval", "shattering"):
        assert exported[slug][0], slug


# -- the pages' own snippets recompute what they show ----------------------------------------

def _run(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "<snippet>", "exec"), namespace)  # noqa: S102 - the page's own snippet
    return namespace


def test_attention_snippet_recomputes_the_patterns(tiny_model):
    from apps.attention import AttentionView, head_pattern

    view = AttentionView(tiny_model, background=False, prompt="The cat sat on the mat")
    view.select(2, 3)
    ns = _run(view.code_snippet())
    assert ns["model"].spec.name == "tiny-llama"
    xr.testing.assert_allclose(ns["ds"]["attn_pattern"], view.result["attn_pattern"])
    xr.testing.assert_allclose(ns["enlarged"], head_pattern(view.result, 2, 3))
    assert ns["enlarged"].sizes["dst_pos"] == int(view.result.mask.sum())
    view.close()


def test_atlas_snippet_recomputes_the_atlas_and_its_table(tiny_model):
    from apps.atlas import AtlasView

    view = AtlasView(tiny_model, background=False, prompt="one two three one two three")
    view.add_induction()
    view.wait(300)
    assert "induction" in " ".join(view.atlas.data_vars)
    ns = _run(view.code_snippet())
    xr.testing.assert_allclose(ns["atlas"], view.atlas)
    pd.testing.assert_frame_equal(ns["table"], view.export_tables()["atlas"])
    view.close()


@pytest.mark.slow
def test_itda_snippet_recomputes_the_dictionary_atom_sweep_and_comparison(tiny_model):
    from apps.itda import ITDAView

    view = ITDAView(tiny_model, background=False, layer=1, tau=0.3, l0=4)
    view.atom = 2
    view.param.trigger("compare")
    view.wait(300)
    assert view.similarity is not None and view.sweep is not None
    ns = _run(view.code_snippet())
    np.testing.assert_array_equal(ns["itda"].atoms_, view.dictionary.atoms_)
    xr.testing.assert_identical(ns["examples"], view.examples)
    timing = [v for v in view.sweep.data_vars if "seconds" in v]    # wall clock, not results
    xr.testing.assert_allclose(ns["sweep"].drop_vars(timing), view.sweep.drop_vars(timing))
    xr.testing.assert_allclose(ns["similarity"], view.similarity)
    assert f"{float(ns['reconstruction']['fve']):.3f}" in view.summary
    view.close()


def test_neuron_eval_snippet_recomputes_the_table_and_sanity_checks(tiny_model):
    from apps.neuron_eval import NeuronEvalView

    view = NeuronEvalView(tiny_model, background=False, layer=1, n_seeds=2, unit=3,
                          concept="own_token", seed=4, alpha=0.1)
    view.wait(300)
    ns = _run(view.code_snippet())
    pd.testing.assert_frame_equal(ns["table"], view.table)
    xr.testing.assert_allclose(ns["synthetic"], view.synthetic)
    if view.real is None:
        assert ns.get("real") is None
    else:
        xr.testing.assert_allclose(ns["real"], view.real)
    unit = view.export_datasets()["unit"]
    np.testing.assert_allclose(unit["activation"].values, ns["data"]["acts"][:, 3])
    view.close()


@pytest.fixture(scope="module")
def km(one_torch_thread):
    from explorer.analyses import shattering as sh

    return sh.train_knowledge_model(**KM_PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["finetune", "rome"])
def test_shattering_snippet_recomputes_the_edit_embedding_and_accuracy(km, method, monkeypatch,
                                                                       tmp_path):
    from apps._view import read_export
    from apps.shattering import ShatteringView
    from explorer.analyses import shattering as sh

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))  # the snippet retrains km there
    sweep = sh.edit_sweep(km, n_edits=3, distances=[1, 2], method="finetune")
    view = ShatteringView(km=km, sweep=sweep, method=method, entity="e3", relation="A+1",
                          distance=2, background=False)
    view.strength = 0.6
    shown_embedding, shown_accuracy = view.embedding(), view._at_strength()[1]
    ns = _run(view.code_snippet())
    xr.testing.assert_allclose(ns["embedding"], shown_embedding)
    xr.testing.assert_allclose(ns["accuracy"], shown_accuracy)
    # the exported embedding keeps its dict attribute (NetCDF holds it as JSON)
    back = read_export(view.export_bytes())["datasets"]
    assert back["embedding"].attrs["edit"] == json.loads(json.dumps(shown_embedding.attrs["edit"]))
    xr.testing.assert_allclose(back["accuracy"]["accuracy"], shown_accuracy["accuracy"])
    view.close()


def test_the_gallery_exports_the_page_shown_and_its_code_follows_the_page(tiny_model):
    from apps._view import read_export
    from apps.attention import AttentionView
    from apps.gallery import Gallery
    from apps.lens import LensView

    views = [("Attention", "attention", lambda m: AttentionView(m, background=False)),
             ("Logit lens", "lens", LensView)]
    g = Gallery("tiny-llama", views=views)
    g.prompt = "The cat sat"
    g.workspace.select("L1.H2")
    view = g.page("attention")
    view.wait(300)
    back = read_export(g.export_page_data())
    m = back["manifest"]
    assert m["gallery_page"] == "attention" and m["model"] == "tiny-llama"
    assert m["prompt"] == "The cat sat" and m["workspace"]["selected"] == ["L1.H2"]
    xr.testing.assert_allclose(back["datasets"]["result"]["attn_pattern"],
                               view.result["attn_pattern"])
    assert "'The cat sat'" in g.page_code() and "head=2)  # L1.H2" in g.page_code()
    before = g.page_revision
    view.select(0, 1)                                  # a setting of the page shown changes
    assert g.page_revision > before and "head=1)  # L0.H1" in g.page_code()
    g.workspace.push_edit(Ablate(1, 2))
    view.wait(300)
    code = g.page_code()                                # attention's trace applies the edits
    assert "edits_from_json" in code and "edits=edits" in code and "not in this snippet" not in code
    g.view = "lens"                                     # opened, the lens runs with them
    g.page("lens").wait(300)
    lens_code = g.page_code("lens")                             # the lens's rebuilds them
    assert "edits_from_json" in lens_code and "not in this snippet" not in lens_code
    g.view = "attention"
    g.workspace.remove_edit(0)
    sidebar = g.page_widgets()
    download = sidebar[1][0]                            # beside "Copy link"
    assert sidebar[1][1].label == "Copy link"
    assert download.filename == "explorer-attention.zip" and download.label == "Export page data"
    assert any("export-page-data" in w.css_classes for item in g.sidebar()
               if isinstance(item, pn.viewable.Viewable)
               for w in item.select(pn.widgets.FileDownload))
    with zipfile.ZipFile(io.BytesIO(download.callback().read())) as zf:   # what a click sends
        assert json.loads(zf.read("manifest.json"))["gallery_page"] == "attention"
    copy_code = sidebar[3]                              # Copy page as code
    assert "enlarged = patterns.sel(layer=0, head=1)" in copy_code.code
    assert copy_code.code == g.page_code()
    g.view = "lens"
    assert download.filename == "explorer-lens.zip"
    g.page("lens").wait(300)
    assert read_export(g.export_page_data())["manifest"]["page"] == "LensView"
    g.close()


# -- the model pages' and training labs' snippets ----------------------------------------------

def _no_timing(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` without its wall-clock variables and coordinates (they differ run to run)."""
    return ds.drop_vars([n for n in ds.variables if "seconds" in str(n)])


def test_pages_with_their_own_calls_write_their_own_recipes():
    from apps._view import View
    from apps.atlas import AtlasView
    from apps.attention import AttentionView
    from apps.circuits import CircuitsView
    from apps.conflicts import ConflictsView
    from apps.icl_heads import ICLHeadsView
    from apps.itda import ITDAView
    from apps.lens import LensView
    from apps.linear_icl import LinearICLView
    from apps.neuron_eval import NeuronEvalView
    from apps.parity import ParityView
    from apps.saturation import SaturationView
    from apps.shattering import ShatteringView
    from apps.task_emergence import TaskEmergenceView
    from apps.unlearning import UnlearningView

    for page in (LensView, ICLHeadsView, ParityView, LinearICLView, TaskEmergenceView,
                 UnlearningView, AtlasView, AttentionView, CircuitsView, ConflictsView, ITDAView,
                 NeuronEvalView, SaturationView, ShatteringView):
        assert page.code_recipe is not View.code_recipe, page.__name__
        assert page.code_snippet is View.code_snippet, page.__name__   # written by render


@pytest.mark.parametrize("alpha", [0.0, 2.0])
def test_lens_snippet_recomputes_the_steered_and_the_edited_lens(tiny_model, alpha):
    import torch

    import explorer
    from apps.lens import LensView

    view = LensView(tiny_model, background=False, prompt="The cat sat on", alpha=alpha,
                    steer_layer=1, k=3, contrast_a="I love it\nso good", contrast_b="I hate it")
    view.edits = [explorer.Ablate(layer=1, head=2)]
    view.wait(120)
    ns = _run(view.code_snippet())
    for got, shown in ((ns["lens"], view.result), (ns["edited"], view.edited_result)):
        np.testing.assert_array_equal(got.top_token_id.values, shown.top_token_id.values)
        # the page resumes the edited run from the clean one: float32 noise apart
        np.testing.assert_allclose(got.top_prob.values, shown.top_prob.values, rtol=1e-4,
                                   atol=1e-6)
        assert json.dumps(got.attrs["edits"]) == json.dumps(shown.attrs["edits"])
    assert [type(e).__name__ for e in ns["edits"]] == ["Ablate"]
    if alpha == 0:
        assert ns["steer"] == [] and view.result.attrs["edits"] == []
        return
    # the snippet's steering vector against plain HF hidden states: the mean resid_post of
    # layer 1 over the tokens of A (first token of each prompt left out) minus that of B
    def mean(prompts):
        rows = []
        for p in prompts:
            ids = tiny_model.tokenizer(p, return_tensors="pt")
            with torch.no_grad():
                h = tiny_model.hf(**ids, output_hidden_states=True).hidden_states[2][0]
            rows.append(h[1:] if h.shape[0] > 1 else h)
        return torch.cat(rows).mean(0).numpy()

    want = mean(["I love it", "so good"]) - mean(["I hate it"])
    np.testing.assert_allclose(ns["vector"], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ns["steer"][0].vector, view.edits_for()[0].vector)


@pytest.mark.slow
def test_icl_heads_snippet_recomputes_every_result_the_page_shows(tiny_model):
    from apps.icl_heads import OWN_TASK, ICLHeadsView

    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), eval_tasks=("uppercase",),
                        td_tasks=("antonym", "uppercase"))
    first = _run(view.code_snippet())              # before the curves and the conflict test
    assert "curves" not in first and "conflict" not in first
    view.max_percent = 10
    view._request("curves")
    view.param.update(conflict_tasks=["capitalize", "uppercase", "choose-first-of-3"],
                      conflict_layers="1-2", conflict_layer=None)
    view.run_conflict()
    view.conflict_layer = 1
    view.use_own("dog -> DOG\ncat -> CAT\nsun -> SUN\nsky -> SKY\nred -> RED")
    view.param.update(layer=1, head=2)
    assert view.task == OWN_TASK
    ns = _run(view.code_snippet())
    assert ns["model"].spec.name == "tiny-llama" and ns["task"].name == OWN_TASK
    xr.testing.assert_allclose(ns["scores"], view.scores)
    for kind in ("repeat", "icl"):
        xr.testing.assert_allclose(ns["patterns"][kind], view.patterns[kind])
    xr.testing.assert_allclose(ns["fv_result"], view.fv_result)
    assert str(ns["fv_result"].task.values[0]) == OWN_TASK
    xr.testing.assert_allclose(ns["td"], view.td)
    xr.testing.assert_allclose(ns["curves"], view.curves)
    xr.testing.assert_identical(ns["conflict"].drop_attrs(), view.conflict.drop_attrs())
    tasks = ["capitalize", "uppercase", "choose-first-of-3"]
    xr.testing.assert_identical(ns["matrix"], view.conflict.follows_source.sel(source=tasks,
                                                                               layer=1))


@pytest.fixture()
def cache(monkeypatch, tmp_path):
    """An empty cache folder: the labs read their shipped runs (or train) there."""
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    return tmp_path


def test_parity_snippet_recomputes_the_shipped_run_at_the_step_shown(cache):
    from apps.parity import ParityView

    view = ParityView(background=False)
    view.wait(600)
    view.param.update(threshold=0.02, max_length=5)  # the state counts are recomputed
    view.wait(600)
    view.step = view.param.step.objects[20]
    ns = _run(view.code_snippet())
    assert "run = parity_run()" in view.code_snippet()
    xr.testing.assert_identical(ns["run"], view.run)
    xr.testing.assert_identical(ns["analysis"], view.analysis)
    xr.testing.assert_identical(ns["pca"], view.pca())
    xr.testing.assert_identical(ns["automaton"], view.automaton())
    xr.testing.assert_identical(ns["sizes"], view.sizes)
    assert ns["automaton"].attrs["n_states"] == view.automaton().attrs["n_states"]
    view.close()


def test_parity_snippet_retrains_a_reduced_run(cache):
    from apps.parity import ParityView
    from explorer.analyses.parity import train_parity_rnn

    run = train_parity_rnn(hidden_size=12, epochs=4, checkpoint_every=2, max_length=6, seed=3)
    view = ParityView(run=run, background=False)
    view.wait(600)
    view.param.update(step=int(run.step.values[1]), max_length=4)
    code = view.code_snippet()
    assert "seed=3" in code and "hidden_size=12" in code
    ns = _run(code)
    xr.testing.assert_allclose(_no_timing(ns["run"]), _no_timing(run))
    xr.testing.assert_allclose(ns["pca"], view.pca())
    xr.testing.assert_identical(ns["automaton"], view.automaton())
    view.close()


@pytest.mark.slow
def test_linear_icl_snippet_recomputes_reduced_and_shipped_runs(cache):
    from apps.linear_icl import LinearICLView
    from explorer.analyses import linear_icl

    runs = {H: linear_icl.train_linear_icl(n_heads=H, steps=60, checkpoint_every=20,
                                           batch_size=64, n_test=64, test_lengths=[10, 40],
                                           seed=0) for H in (1, 2)}
    view = LinearICLView(runs=runs, background=False)
    view.wait(600)
    view.step = 40
    ns = _run(view.code_snippet())
    assert sorted(ns["runs"]) == [1, 2]
    xr.testing.assert_allclose(ns["patterns"], view.patterns())
    for H in (1, 2):
        xr.testing.assert_allclose(_no_timing(ns["analyses"][H]), _no_timing(view.analyses[H]))
    view.close()
    shipped = LinearICLView(background=False)      # the runs shipped with the project
    shipped.wait(600)
    shipped.n_heads = 1
    code = shipped.code_snippet()
    assert "linear_icl_run(n_heads=H)" in code
    ns = _run(code)
    xr.testing.assert_identical(ns["patterns"], shipped.patterns())
    for H, analysis in shipped.analyses.items():
        xr.testing.assert_identical(ns["analyses"][H], analysis)
    shipped.close()


def test_task_emergence_snippet_recomputes_shipped_and_reduced_analyses(cache):
    from apps.task_emergence import TaskEmergenceView
    from explorer.analyses.task_emergence import train_task_emergence

    view = TaskEmergenceView(background=False)     # the analysis shipped with the project
    view.wait(600)
    view.param.update(step=view.param.step.objects[5], layer=0)
    ns = _run(view.code_snippet())
    xr.testing.assert_identical(ns["analysis"], view.analysis)
    xr.testing.assert_identical(ns["projection"],
                                view.analysis["projection"].sel(step=view.step, layer=0))
    view.close()
    small = dict(n_layers=1, d_model=16, n_heads=2, batch_size=32, steps=40,
                 checkpoint_every=20, warmup=5)
    run = train_task_emergence(**small, seed=2)
    view = TaskEmergenceView(run=run, background=False)
    view.wait(600)
    code = view.code_snippet()
    assert "task_emergence_run(" in code and "seed=2" in code
    ns = _run(code)
    xr.testing.assert_allclose(_no_timing(ns["analysis"]), _no_timing(view.analysis))
    np.testing.assert_allclose(ns["td_by_layer"].values,
                               view.analysis["td"].sel(step=view.step).values)
    view.close()


@pytest.mark.slow
def test_unlearning_snippet_recomputes_localization_and_the_run(tiny_model, tmp_path):
    from apps.unlearning import UnlearningView

    facts = tiny_facts_file(tmp_path)
    view = UnlearningView(tiny_model, facts_file=facts, known_only=False, n_forget=4, n_retain=2,
                          n_layers=1, steps=2, relearn_steps=1, background=False)
    assert "U.split_facts(facts, 4, 2)" in view.code_snippet()   # before Localize
    view.use_own("subject: Person Q\nprompt: Fact: Person Q likes the\nanswer: moon")
    view.n_forget = 3                                # after Localize: the split it used stays
    view.method = "causal_tracing"
    view.run()
    view.n_layers = 2                                # after the run: the bars keep its budget
    ns = _run(view.code_snippet())
    assert ns["forget"][0].subject == "Person Q" and len(ns["forget"]) == 4
    assert [f.subject for f in ns["forget"]] == [f.subject for f in view._split[0]]
    assert [f.subject for f in ns["retain"]] == [f.subject for f in view._split[1]]
    for name in ("probe", "trace", "attribution"):
        xr.testing.assert_allclose(ns[name], getattr(view, name))
    xr.testing.assert_allclose(_no_timing(ns["result"]), _no_timing(view.result))
    assert ns["components"] == view.chosen_components()
    view.close()
