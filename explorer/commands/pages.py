"""Page measurements the benches in `explorer.bench` take: this layer may load `apps` pages
(with ``importlib``), the bench module may not."""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["lens_slider_preview_times", "circuits_slider_redraw_times", "saturation_click_latency"]

PAGE_BENCHES = "apps._page_benches"   # the page harnesses; no page imports them


def lens_slider_preview_times(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """`apps._page_benches.slider_preview_times`: the lens page's redraws while its slider
    moves."""
    return importlib.import_module(PAGE_BENCHES).slider_preview_times(*args, **kwargs)


def circuits_slider_redraw_times(*args: Any, **kwargs: Any) -> dict[str, float]:
    """`apps._page_benches.slider_redraw_times`: the circuits page's redraws while its size
    slider moves."""
    return importlib.import_module(PAGE_BENCHES).slider_redraw_times(*args, **kwargs)


def saturation_click_latency(*args: Any, **kwargs: Any) -> dict[str, list[float]]:
    """`apps._page_benches.click_latency`: the saturation page's token clicks."""
    return importlib.import_module(PAGE_BENCHES).click_latency(*args, **kwargs)
