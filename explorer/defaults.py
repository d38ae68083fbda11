"""Package-wide defaults, importable without torch (the command line and the pages read them
before any model loads)."""

from pathlib import Path

__all__ = ["DATASETS_DIR", "DEFAULT_MODEL"]

#: The model every entry point uses when none is named: the packaged SmolLM2-135M-Instruct.
DEFAULT_MODEL = "smollm2-135m"

#: The shipped data (corpus, tasks, fact files, trained runs): ``datasets/`` of the checkout.
DATASETS_DIR = Path(__file__).resolve().parents[1] / "datasets"
