"""Recording torch's thread count in tests: the count a function is called at, to check that
a command or a preview runs at the count it promises. (A block at a set count, the count put
back afterwards: `explorer.commands._common.torch_threads`.)"""
from __future__ import annotations

from typing import Any

import torch


def record_threads(monkeypatch: Any, owner: Any, name: str) -> list[int]:
    """Replace ``owner.name`` (for the test, through ``monkeypatch``) by a function that
    notes torch's thread count and then calls the original; returns the list of the counts,
    one per call, in call order."""
    seen: list[int] = []
    real = getattr(owner, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return seen
