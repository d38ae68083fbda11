"""Page measurements the benches in `explorer.bench` take: this layer may load `apps` pages
(with ``importlib``), the bench module may not."""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["lens_slider_preview_times"]


def lens_slider_preview_times(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """`apps.lens.slider_preview_times`: the lens page's redraws while its slider moves."""
    return importlib.import_module("apps.lens").slider_preview_times(*args, **kwargs)
