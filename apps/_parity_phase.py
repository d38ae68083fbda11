"""The Parity page's phase diagram (`apps.parity`'s part; no other page imports it): the
stored grid of runs by initialisation gain and longest training string, and its caption."""
from __future__ import annotations

import holoviews as hv
import numpy as np
import xarray as xr

from apps import theme
from apps._view import ZOOM_TOOLS

__all__ = ["plot_phase_diagram", "phase_caption"]


def plot_phase_diagram(phase: xr.Dataset | None) -> hv.Element:
    """Phase diagram: initialisation gain x longest training string -> did the 2-state automaton
    appear (colour: worst long-string accuracy; text: the epoch it appeared, or the final
    number of minimal states)."""
    if phase is None:
        return theme.placeholder("No phase diagram stored yet.", height=200)
    gains = [f"{g:g}" for g in phase["gain"].values]
    lengths = [str(int(m)) for m in phase["max_length"].values]
    rows, labels = [], []
    for i, g in enumerate(gains):
        for j, m in enumerate(lengths):
            cell = phase.isel(gain=i, max_length=j)
            acc = float(cell["long_accuracy"])
            epoch = float(cell["transition_epoch"])
            text = (f"epoch {int(epoch)}" if np.isfinite(epoch) else
                    f"{int(cell['final_n_states_minimal'])} states"
                    if np.isfinite(float(cell["final_n_states_minimal"])) else "not run")
            # Cells at integer positions with tick labels: string categories trip Bokeh's
            # HeatMap on pyarrow-backed pandas strings.
            rows.append((j, i, acc))
            labels.append((j, i, text))
    heat = hv.HeatMap(rows, ["longest training string", "initialisation gain"],
                      "worst long-string accuracy").opts(
        xticks=list(enumerate(lengths)), yticks=list(enumerate(gains)),
        cmap=theme.MAGNITUDE_CMAP, clim=(0.5, 1.0), colorbar=True, tools=["hover"],
        default_tools=ZOOM_TOOLS, fontsize=theme.font_sizes(), responsive=True, height=300, title="Phase diagram")
    text = hv.Labels(labels, ["longest training string", "initialisation gain"], "text").opts(
        text_font_size="9pt", text_color="black")
    return heat * text


def phase_caption(phase: xr.Dataset | None) -> str:
    """What the phase diagram shows."""
    if phase is None:
        return ("The phase diagram (initialisation gain x longest training string) is shown once "
                "stored: run `explorer parity phase` (a few minutes on the default grid).")
    return (f"{phase.sizes['gain']} x {phase.sizes['max_length']} runs of "
            f"{phase.attrs['params']['epochs']} epochs each, by initialisation gain and longest "
            "training string. Colour: worst long-string accuracy; text: the epoch the 2-state "
            "automaton appeared, or the final number of minimal states.")
