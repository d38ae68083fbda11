"""Small files the analyses cache beside the activation store."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_json_atomic"]


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` (its folder made if missing) through a temporary file
    renamed into place, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
