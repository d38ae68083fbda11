"""explorer: look inside language models, interactively.

The core API: `load_model`; `read` with the readout records (`Save`, `Logits`, `FinalNorm`,
`Lens`, `DLA`, `Grad`) and the intervention records, and the assemblers over it (`trace`,
`run_with`, `logit_lens`); `generate` under edits; `ActivationStore`. Importing has no side effects beyond
importing torch and xarray; models load only when asked.

``explorer.trace`` is the function (it shadows the module; use ``from explorer.trace import ...``).
"""
from ._checks import ExplorerError
from ._version import __version__
from .head_atlas import head_atlas
from .interventions import (Ablate, AddHead, Patch, Scale, Set, Steer, edits_from_json,
                            edits_to_json)
from .generate import Generation, generate
from .lens import logit_lens
from .models import SITES, Model, ModelSpec, known_models, load_model
from .patching import activation_patching
from .store import ActivationStore
from .readouts import (DLA, FinalNorm, Grad, Lens, Logits, Save, readouts_from_json,
                       readouts_to_json)
from .trace import clean_run, read, run_with, trace
from .workspace import Workspace

__all__ = [
    "ActivationStore",
    "Ablate",
    "AddHead",
    "DLA",
    "FinalNorm",
    "Grad",
    "Lens",
    "Logits",
    "Save",
    "ExplorerError",
    "Model",
    "ModelSpec",
    "Patch",
    "SITES",
    "Scale",
    "Set",
    "Steer",
    "Workspace",
    "activation_patching",
    "clean_run",
    "Generation",
    "generate",
    "edits_from_json",
    "edits_to_json",
    "head_atlas",
    "known_models",
    "load_model",
    "logit_lens",
    "read",
    "readouts_from_json",
    "readouts_to_json",
    "run_with",
    "trace",
]
