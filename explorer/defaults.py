"""Package-wide defaults, importable without torch (the command line and the pages read them
before any model loads)."""

__all__ = ["DEFAULT_MODEL"]

#: The model every entry point uses when none is named: the packaged SmolLM2-135M-Instruct.
DEFAULT_MODEL = "smollm2-135m"
