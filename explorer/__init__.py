"""explorer: look inside language models, interactively.

The core API: `load_model`, `trace`, `logit_lens`, `run_with` and the intervention
records, and `ActivationStore`. Importing has no side effects beyond importing torch and
xarray; models load only when asked.
"""
from ._checks import ExplorerError
from ._version import __version__
from .head_atlas import head_atlas
from .interventions import Ablate, AddHead, Patch, Scale, Steer, edits_from_json, edits_to_json
from .lens import logit_lens
from .models import SITES, Model, ModelSpec, known_models, load_model
from .store import ActivationStore
from .trace import clean_run, run_with, trace
from .workspace import Workspace

__all__ = [
    "ActivationStore",
    "Ablate",
    "AddHead",
    "ExplorerError",
    "Model",
    "ModelSpec",
    "Patch",
    "SITES",
    "Scale",
    "Steer",
    "Workspace",
    "clean_run",
    "edits_from_json",
    "edits_to_json",
    "head_atlas",
    "known_models",
    "load_model",
    "logit_lens",
    "run_with",
    "trace",
]
