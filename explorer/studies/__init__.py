"""User studies of the explorer's explanations, with baseline and placebo conditions.

A study file (YAML or JSON, `load_study`) states the task, the items, the conditions
(the real explanation, a baseline without one, placebo explanations the tool generates),
the participants, the seed and the pre-registered hypotheses. `StudyRun.prepare` computes
the items once with the model; the participant app (``apps/study.py``) stores each answer
in SQLite as it is given (`ResponseStore`); `analyse` and `study_report` give accuracy per
condition with bootstrap intervals, effect sizes and a report another lab can rerun.

References
----------
U. Pičulin, M. Petek, I. Ograjenšek and E. Štrumbelj, "Position: Explainable AI Cannot
Advance Without Better User Studies", ICML 2025.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Study": "explorer.studies.schema",
    "StudyFileError": "explorer.studies.schema",
    "load_study": "explorer.studies.schema",
    "study_from_dict": "explorer.studies.schema",
    "Trial": "explorer.studies.randomise",
    "participant_schedule": "explorer.studies.randomise",
    "study_schedule": "explorer.studies.randomise",
    "shuffled_attributions": "explorer.studies.placebo",
    "random_heads": "explorer.studies.placebo",
    "mismatched_example": "explorer.studies.placebo",
    "build_items": "explorer.studies.items",
    "ResponseStore": "explorer.studies.responses",
    "StudyRun": "explorer.studies.run",
    "analyse": "explorer.studies.analysis",
    "analyse_responses": "explorer.studies.analysis",
    "simulated_responses": "explorer.studies.analysis",
    "simulate_participants": "explorer.studies.analysis",
    "reader_choice": "explorer.studies.readers",
    "explanation_pick": "explorer.studies.readers",
    "study_report": "explorer.studies.report",
    "export_responses_csv": "explorer.studies.report",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from .analysis import (
        analyse,
        analyse_responses,
        simulate_participants,
        simulated_responses,
    )
    from .items import build_items
    from .placebo import mismatched_example, random_heads, shuffled_attributions
    from .randomise import Trial, participant_schedule, study_schedule
    from .readers import explanation_pick, reader_choice
    from .report import export_responses_csv, study_report
    from .responses import ResponseStore
    from .run import StudyRun
    from .schema import Study, StudyFileError, load_study, study_from_dict


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'explorer.studies' has no attribute {name!r}")
