"""The papers' settings and results: the differs line, ``--paper`` on the commands, the
*Paper's setting* button on a page and the card's numbers against the committed JSON."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from explorer import paper_settings as P
from explorer._checks import InputError
from tests._cli import OneCommand, parse_and_run

FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"


# -- the differs line -------------------------------------------------------------------------

def test_differs_line_names_each_value_not_the_papers_in_words():
    current = {"induction_sequences": 4, "induction_half_len": 50, "induction_measure": "mul",
               "exclude_other": False, "exclude_percent": 2.0, "mean_source": "cross-task",
               "max_percent": 20.0}
    assert P.differs_line("icl-heads", current) == (
        "Differs from the paper: induction sequences 4 (paper: 1,000); induction measure mul "
        "(paper: abs); exclusion of the other score's top heads off (paper: on). Not set on "
        "this page: 12 models (Pythia 70M-6.9B, GPT-2 S-XL, Llama-2-7B), 37 FV tasks.")


def test_differs_line_names_the_shown_runs_training_settings():
    run = {"d": 8, "n_tasks": 4, "rank": 4, "n_examples": 20, "coef_mean": 0.0, "coef_std": 1.0,
           "n_layers": 3, "d_model": 128, "n_heads": 8, "lr": 1e-3}
    assert P.differs_line("task-emergence", {}, run).startswith(
        "Differs from the paper: the shown run was trained with input dimension 8 (paper: 16), "
        "layers 3 (paper: 12). Not set on this page:")


def test_differs_line_with_every_value_the_papers_and_unknown_parameters_ignored():
    current = {**P.page_values("icl-heads"), "layer": 3}
    assert P.differs_line("icl-heads", current).startswith(
        "The paper's setting: every value set on this page is the paper's. Not set on this page")
    assert P.differences_from_paper("unlearning", {"lr": 2e-4, "steps": 50}) == [
        "learning rate 0.0002 (paper: 1e-05)"]


def test_unknown_method_is_refused_with_the_methods():
    with pytest.raises(InputError, match=r"`method` must be one of \[.*'icl-heads'.*\]; got 'icl'"):
        P.paper_setting("icl")


# -- paper vs here: the card's numbers are the JSON's -----------------------------------------

def _walk(data, path):
    for part in path.split("/"):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return float(data)


@pytest.mark.parametrize("method", sorted(P.PAPER_RESULTS))
def test_card_numbers_equal_the_committed_json(method):
    from apps._paper import paper_card_markdown

    result = P.PAPER_RESULTS[method]
    data = json.loads((FIGURES / result.figure).read_text())
    numbers = P.measured_numbers(method)
    card = paper_card_markdown(method)
    for m in result.measured:
        assert numbers[m.label]["value"] == _walk(data, m.path)
        for bound, path in (("low", m.low), ("high", m.high)):
            assert numbers[m.label][bound] == (None if path is None else _walk(data, path))
        assert m.label in card
    assert result.figure in card and ("Reproduces here" in card) == P.reproduces(method, numbers)


def test_icl_card_shows_the_ablation_numbers_with_their_intervals():
    from apps._paper import paper_card_markdown

    cell = json.loads((FIGURES / "icl_heads_summary.json").read_text())[
        "ablation_cross_fit"]["by_mean_source"]["cross-task"]
    fv = [cell[k]["fv_excl_induction"][2] for k in ("mean_accuracy", "mean_accuracy_low",
                                                     "mean_accuracy_high")]
    card = paper_card_markdown("icl-heads")
    assert f"FV excl. induction **{fv[0]:.3f}** [{fv[1]:.3f}, {fv[2]:.3f}]" in card


def test_reproduction_line_follows_the_numbers():
    good = {"FV excl. induction": {"value": 0.2}, "induction excl. FV": {"value": 0.7}}
    bad = {"FV excl. induction": {"value": 0.8}, "induction excl. FV": {"value": 0.7}}
    assert P.reproduction_line("icl-heads", good).startswith("Reproduces here")
    assert P.reproduction_line("icl-heads", bad).startswith("Does not reproduce here")


# -- a page: the button sets the paper's values and the line follows --------------------------

def test_icl_page_paper_button_sets_the_papers_values(tiny_model):
    import panel as pn

    from apps._paper import page_differs_line, paper_panel
    from apps.icl_heads import ICLHeadsView

    view = ICLHeadsView(tiny_model, background=False, compute_on_open=False, n_prompts=2,
                        n_shots=2)
    view.param.update(exclude_other=False, exclude_percent=5.0)
    assert page_differs_line("icl-heads", view).startswith(
        "Differs from the paper: induction sequences 4 (paper: 1,000); exclusion of the other "
        "score's top heads off (paper: on); excluded top % of the other score 5 (paper: 2); "
        "ICL score first_token (paper: f1).")
    panel = paper_panel("icl-heads", view)
    button = next(w for w in panel.select(pn.widgets.Button) if w.label == "Paper's setting")
    button.clicks += 1
    assert (view.induction_sequences, view.induction_half_len, view.induction_measure,
            view.exclude_other, view.exclude_percent, view.icl_score) == (
        1000, 50, "abs", True, 2.0, "f1")
    assert page_differs_line("icl-heads", view).startswith("The paper's setting: every value")
    line = next(p for p in panel.select(pn.pane.Markdown) if "paper-differs" in p.css_classes)
    assert "every value set on this page is the paper's" in str(line.object)


def test_every_method_page_has_the_button_and_the_card():
    """Each method page file puts `paper_panel` for its own method in its layout."""
    pages = {"saturation": "saturation", "conflicts": "conflicts", "icl_heads": "icl-heads",
             "itda": "itda", "neuron_eval": "neuron-eval", "parity": "parity",
             "linear_icl": "linear-icl", "task_emergence": "task-emergence",
             "shattering": "shattering", "unlearning": "unlearning", "circuits": "circuits"}
    root = Path(__file__).resolve().parents[1] / "apps"
    for page, method in pages.items():
        assert f'paper_panel("{method}", self)' in (root / f"{page}.py").read_text(), page
        assert method in P.PAPER_SETTINGS and method in P.PAPER_RESULTS
        for name in P.page_values(method):
            module = __import__(f"apps.{page}", fromlist=["x"])
            views = [c for c in vars(module).values()
                     if isinstance(c, type) and c.__module__ == module.__name__
                     and hasattr(c, "param") and name in c.param]
            assert views, f"{page}: no view parameter {name!r}"
            value = P.page_values(method)[name]
            views[0].param[name]._validate(value)          # the paper's value is allowed


# -- commands ---------------------------------------------------------------------------------

def _parsed(module: str, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed as `explorer.cli.main` parses it (the line kept for ``--paper``)."""
    import importlib

    from explorer.commands._common import parse_command_line

    parser = argparse.ArgumentParser()
    importlib.import_module(f"explorer.commands.{module}").register_cli(parser.add_subparsers())
    return parse_command_line(parser, argv)


def test_paper_flag_sets_the_papers_values_and_keeps_what_the_user_set(capsys):
    from explorer.commands._common import apply_paper_option

    args = _parsed("icl_heads", ["icl-heads", "--paper", "--n-shots", "4"])
    apply_paper_option(args, "icl-heads")
    assert (args.induction_sequences, args.induction_half_len, args.induction_measure,
            args.top_fraction, args.percents, args.n_prompts) == (
        1000, 50, "abs", 0.02, "0,1,3,5,7,9,15,20", 100)
    assert args.n_shots == 4                         # set on the line: kept
    assert "Yin & Steinhardt" in capsys.readouterr().err
    args = _parsed("icl_heads", ["icl-heads"])
    apply_paper_option(args, "icl-heads")            # without --paper nothing changes
    assert (args.induction_sequences, args.n_prompts) == (16, 8)


def test_paper_flag_keeps_an_option_given_its_default_value(capsys):
    from explorer.commands._common import apply_paper_option

    # 8 prompts and the first-token score are the defaults; given on the line, they stay
    args = _parsed("icl_heads", ["icl-heads", "--n-prompts", "8", "--paper",
                                 "--icl-score=first_token"])
    apply_paper_option(args, "icl-heads")
    assert (args.n_prompts, args.icl_score) == (8, "first_token")
    assert (args.n_shots, args.induction_sequences) == (10, 1000)      # not given: the paper's
    err = capsys.readouterr().err
    assert "n_shots=10" in err and "n_prompts" not in err and "icl_score" not in err


def test_task_emergence_setting_flags_reach_the_training_run(monkeypatch, capsys):
    from explorer.analyses import task_emergence as te

    seen = {}

    def fake_run(*, store=None, retrain=False, progress=None, **params):
        seen.update(params)
        raise SystemExit(0)

    monkeypatch.setattr(te, "task_emergence_run", fake_run)
    with pytest.raises(SystemExit):
        parse_and_run("task_emergence", ["task-emergence", "train", "--paper", "--steps", "10"])
    assert {k: seen[k] for k in ("d", "n_tasks", "rank", "n_examples", "coef_mean", "coef_std",
                                 "n_layers", "d_model", "n_heads")} == {
        "d": 16, "n_tasks": 4, "rank": 4, "n_examples": 20, "coef_mean": 0.0, "coef_std": 1.0,
        "n_layers": 12, "d_model": 128, "n_heads": 8}
    assert seen["steps"] == 10
    seen.clear()
    with pytest.raises(SystemExit):
        parse_and_run("task_emergence", ["task-emergence", "train", "--n-examples", "6",
                                         "--coef-mean", "0.5"])
    assert (seen["n_examples"], seen["coef_mean"], seen["d"]) == (6, 0.5, te.DEFAULTS["d"])


def test_main_keeps_the_line_for_paper_with_options_before_the_command(monkeypatch, capsys,
                                                                     tmp_path):
    """Through `explorer.cli.main`: an option given its default's value after the command
    keeps it under ``--paper``, with global options before the command, one of whose values
    spells the command's name."""
    from explorer.analyses import task_emergence as te

    seen = {}

    def fake_run(*, store=None, retrain=False, progress=None, **params):
        seen.update(params)
        raise SystemExit(0)

    monkeypatch.setattr(te, "task_emergence_run", fake_run)
    monkeypatch.chdir(tmp_path)                      # the cache folder "task-emergence"
    main = OneCommand("task_emergence", monkeypatch, capsys)
    assert (te.DEFAULTS["n_examples"], P.flag_values("task-emergence")["n_examples"]) == (4, 20)
    with pytest.raises(SystemExit):
        main(["--cache", "task-emergence", "--threads", "1", "task-emergence", "train",
              "--paper", "--n-examples", "4", "--steps", "10"])
    assert (seen["n_examples"], seen["steps"]) == (4, 10)             # given on the line
    assert (seen["d"], seen["rank"], seen["n_layers"]) == (16, 4, 12)  # the paper's
    err = capsys.readouterr().err
    assert "d=16" in err and "n_examples" not in err


@pytest.mark.slow
def test_conflicts_alpha_search_picks_the_alphas_of_the_library_search(monkeypatch, capsys,
                                                                        tmp_path):
    from explorer import load_model
    from explorer.analyses import conflicts as C
    from explorer.commands.conflicts import ALPHA_GRIDS

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    facts = C.load_facts(["country_capital"])[:7]
    monkeypatch.setattr(C, "closed_book_facts", lambda model, given: facts)
    monkeypatch.setattr(C, "juice_head_selection", lambda *a, **k: None)
    monkeypatch.setattr(C, "selected_heads", lambda sel: ([(1, 0)], [(0, 1)]))
    out = OneCommand("conflicts", monkeypatch, capsys).json(
        ["conflicts", "--model", "tiny-llama", "--paper", "--val-facts", "2", "--json"])
    model = load_model("tiny-llama")
    want = C.juice_alpha_search(model, facts[4:6], [(1, 0)], [(0, 1)],
                                alpha_s_grid=ALPHA_GRIDS["parametric"][0],
                                alpha_l_grid=ALPHA_GRIDS["parametric"][1])
    search = out["alpha_search"]
    assert (search["best_alpha_s"], search["best_alpha_l"]) == (
        want.attrs["best_alpha_s"], want.attrs["best_alpha_l"])
    assert (out["alpha_s"], out["alpha_l"]) == (search["best_alpha_s"], search["best_alpha_l"])
    assert out["n_eval"] == 1                       # 4 to select, 2 to search, 1 to score
    acc = C.conflict_accuracy(model, facts[6:], [(1, 0)], [(0, 1)], alpha_l=out["alpha_l"],
                              alpha_s=out["alpha_s"])
    assert out["memory_accuracy"]["juice"]["substitution"] == pytest.approx(
        float(acc.memory_accuracy.sel(intervention="juice", kind="substitution")))


def test_itda_compares_two_models_with_the_jaccard_of_atom_labels(tmp_path, monkeypatch,
                                                                  capsys):
    from explorer import load_model
    from explorer.analyses.itda import ITDA
    from explorer.analyses.similarity import perturbed_copy
    from explorer.trace import trace

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    prompts = ["The cat sat on the mat.", "Paris is the capital of France.",
               "One two three four five six seven."]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    out = OneCommand("itda", monkeypatch, capsys).json(
        ["itda", "--model", "tiny-llama", "--prompts", str(path), "--layer", "1",
         "--compare-noise", "0.05", "--l0", "4", "--json"])
    comp = out["comparison"]
    assert comp["similarity"] == "itda" and "not a second trained model" in comp["second_model"]
    model = load_model("tiny-llama")
    a = trace(model, prompts, sites=("resid_post",), progress=False)
    b = trace(perturbed_copy(model, scale=0.05, seed=1), prompts, sites=("resid_post",),
              progress=False)

    def labels(ds, layer):
        itda = ITDA(tau=0.3, l0=4).fit(ds, layer=layer, min_pos=1)
        return set(zip(itda.atom_prompt_.tolist(), itda.atom_pos_.tolist()))
    for layer, got in enumerate(comp["diagonal"]):
        la, lb = labels(a, layer), labels(b, layer)
        assert got == pytest.approx(len(la & lb) / len(la | lb))
    assert np.asarray(comp["matrix"]).shape == (model.n_layers, model.n_layers)


def test_circuits_page_paper_button_sets_eap_ig():
    """The Circuits page opens on EAP and its line says so; the button sets EAP-IG."""
    import panel as pn
    import param

    from apps._paper import page_differs_line, paper_panel
    from apps.circuits import CircuitsView

    assert 'paper_panel("circuits", self)' in (
        Path(__file__).resolve().parents[1] / "apps" / "circuits.py").read_text()
    assert CircuitsView.param["method"].default == "eap"

    class Page(param.Parameterized):   # the page's one parameter the table ties
        method = param.Selector(default="eap", objects=list(CircuitsView.param["method"].objects))

    view = Page()
    assert page_differs_line("circuits", view).startswith(
        "Differs from the paper: attribution eap (paper: eap-ig).")
    panel = paper_panel("circuits", view)
    button = next(w for w in panel.select(pn.widgets.Button) if w.label == "Paper's setting")
    button.clicks += 1
    assert view.method == "eap-ig"
    assert page_differs_line("circuits", view).startswith("The paper's setting: every value")
