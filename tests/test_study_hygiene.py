"""The evaluation-hygiene checklist (Pičulin et al., ICML 2025) is computed from the study file
and its run: each criterion is met or not according to what the file and the folder hold."""
from __future__ import annotations

import json

import pytest
from test_studies import study_dict, write_study

from explorer.studies.analysis import simulate_participants
from explorer.studies.report import hygiene_checklist, study_report
from explorer.studies.run import StudyRun

CRITERIA = ("Baseline condition", "Placebo explanation", "Attention check", "Data-quality check",
            "Pre-registered hypotheses and analysis", "Reproducible",
            "Objective task (not self-reported trust)", "Questionnaire validated", "Pre-tested",
            "Limitations stated")


def _checklist(tmp_path, tiny_model, **changes):
    path = write_study(tmp_path, study_dict(**changes))
    run = StudyRun.prepare(path, tmp_path / "run", model=tiny_model)
    rows = {name: (met, note) for name, met, note in hygiene_checklist(run)}
    return run, rows


def test_a_complete_study_meets_every_criterion(tmp_path, tiny_model):
    run, rows = _checklist(tmp_path, tiny_model, limitations=["Six prompts, one model."],
                           pretest="piloted with 3 readers; two questions reworded",
                           questionnaire_validation="single-item confidence, as in Smith 2020")
    try:
        assert tuple(rows) == CRITERIA
        assert {name: met for name, (met, _) in rows.items()} == dict.fromkeys(CRITERIA, True)
        assert run.study.sha256[:16] in rows["Pre-registered hypotheses and analysis"][1]
        assert rows["Pre-tested"][1].startswith("piloted with 3 readers")
    finally:
        run.close()


@pytest.mark.parametrize("changes, failed", [
    ({}, {"Limitations stated", "Pre-tested", "Questionnaire validated"}),
    ({"analysis": None}, {"Pre-registered hypotheses and analysis", "Limitations stated",
                          "Pre-tested", "Questionnaire validated"}),
    ({"task": {"kind": "predict_next_token", "n_choices": 3, "attention_checks": 0}},
     {"Attention check", "Data-quality check", "Limitations stated", "Pre-tested",
      "Questionnaire validated"}),
    ({"conditions": [{"name": "real", "kind": "real"}, {"name": "none", "kind": "baseline"}],
      "hypotheses": [{"id": "H1", "statement": "real beats none", "compare": ["real", "none"]}]},
     {"Placebo explanation", "Limitations stated", "Pre-tested", "Questionnaire validated"}),
])
def test_each_missing_item_is_told(tmp_path, tiny_model, changes, failed):
    run, rows = _checklist(tmp_path, tiny_model, **changes)
    try:
        assert {name for name, (met, _) in rows.items() if not met} == failed
        for name in failed:
            assert rows[name][1], f"{name}: an unmet criterion must say what is missing"
    finally:
        run.close()


def test_data_quality_needs_the_exclusion_rule(tmp_path, tiny_model):
    run, rows = _checklist(tmp_path, tiny_model,
                           analysis={"bootstrap": 400, "permutations": 400,
                                     "exclude_failed_attention": False})
    try:
        assert rows["Attention check"][0] and not rows["Data-quality check"][0]
    finally:
        run.close()


def test_reproducibility_reads_the_run_folder(tmp_path, tiny_model):
    run, rows = _checklist(tmp_path, tiny_model)
    try:
        assert rows["Reproducible"][0]
        run.info.pop("versions")
        run.info["model"]["weights"] = ""
        met, note = {n: (m, t) for n, m, t in hygiene_checklist(run)}["Reproducible"]
        assert not met and "software versions" in note and "model weights id" in note
    finally:
        run.close()


def test_responses_before_preparation_break_preregistration(tmp_path, tiny_model):
    run, _ = _checklist(tmp_path, tiny_model)
    try:
        simulate_participants(run, {"real": 0.9, "none": 0.4, "fake": 0.4}, seed=1, n_participants=3)
        rows = {n: (m, t) for n, m, t in hygiene_checklist(run)}
        assert rows["Pre-registered hypotheses and analysis"][0]
        # a run whose stated preparation time is after its responses was not fixed in advance
        run.info["created"] = "2999-01-01T00:00:00+00:00"
        met, note = {n: (m, t) for n, m, t in hygiene_checklist(run)}[
            "Pre-registered hypotheses and analysis"]
        assert not met and "before the run was prepared" in note
    finally:
        run.close()


def test_report_shows_the_computed_checklist(tmp_path, tiny_model):
    run, rows = _checklist(tmp_path, tiny_model)
    try:
        md = study_report(run)
        assert "Pre-tested | no" in md and "Limitations stated | no" in md
        assert "Baseline condition | yes" in md
        assert json.dumps(run.study.to_dict())  # the new fields stay JSON-able
    finally:
        run.close()
