"""explorer: look inside language models, interactively.

The core API: `load_model`, `trace`, `logit_lens`, `run_with` and the intervention
records, and `ActivationStore`. Nothing heavy runs at import: submodules load on first use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "explorer.models",
    "known_models": "explorer.models",
    "Model": "explorer.models",
    "ModelSpec": "explorer.models",
    "SITES": "explorer.models",
    "trace": "explorer.trace",
    "run_with": "explorer.trace",
    "clean_run": "explorer.trace",
    "logit_lens": "explorer.lens",
    "Ablate": "explorer.interventions",
    "Scale": "explorer.interventions",
    "Patch": "explorer.interventions",
    "Steer": "explorer.interventions",
    "edits_to_json": "explorer.interventions",
    "edits_from_json": "explorer.interventions",
    "ActivationStore": "explorer.store",
    "ExplorerError": "explorer._checks",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from ._checks import ExplorerError
    from .interventions import Ablate, Patch, Scale, Steer, edits_from_json, edits_to_json
    from .lens import logit_lens
    from .models import SITES, Model, ModelSpec, known_models, load_model
    from .store import ActivationStore
    from .trace import clean_run, run_with, trace


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'explorer' has no attribute {name!r}")
