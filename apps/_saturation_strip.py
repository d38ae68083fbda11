"""The saturation page's token strip: the corpus text as clickable tokens coloured by s_1
(a small custom component: real spans, real clicks)."""
from __future__ import annotations

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme

__all__ = ["TokenStrip", "strip_tokens"]

hv.extension("bokeh", logo=False)


_NEVER_COLOR = "#bdbdbd"


class TokenStrip(pn.custom.JSComponent):
    """Tokens as coloured spans; clicking one sets ``selected`` to its position."""

    tokens = param.List(default=[], doc="Dicts with text, bg, fg, title per token.")
    selected = param.Integer(default=-1, doc="Position of the clicked token (-1: none).")

    _esm = """
    export function render({ model, el }) {
      const draw = () => {
        el.innerHTML = "";
        const box = document.createElement("div");
        box.className = "sat-strip";
        model.tokens.forEach((t, i) => {
          const s = document.createElement("span");
          s.textContent = t.text;
          s.title = t.title;
          s.style.background = t.bg;
          s.style.color = t.fg;
          s.dataset.pos = String(i);
          s.className = "sat-token" + (i === model.selected ? " sat-selected" : "");
          s.addEventListener("click", () => { model.selected = i; });
          box.appendChild(s);
        });
        el.appendChild(box);
      };
      draw();
      model.on("tokens", draw);
      model.on("selected", draw);
    }
    """
    _stylesheets = ["""
    .sat-strip { line-height: 1.9; font-family: ui-monospace, monospace; font-size: 13px; }
    .sat-token { padding: 1px 2px; margin: 0 1px; border-radius: 3px; cursor: pointer;
                 white-space: pre; display: inline-block; }
    .sat-token:hover { outline: 2px solid #444; }
    .sat-selected { outline: 3px solid #000; }
    """]


def _layer_colors(values: np.ndarray, n_layers: int) -> tuple[list[str], list[str]]:
    """Background and text colour per saturation layer (grey for never)."""
    cmap = theme.CMAPS["magnitude"]
    top = max(1, n_layers - 1)
    bg, vals = [], []
    for v in values:
        if v < 0:
            bg.append(_NEVER_COLOR)
            vals.append(float("nan"))
        else:
            bg.append(cmap[min(len(cmap) - 1, int(round(v / top * (len(cmap) - 1))))])
            vals.append(float(v))
    fg = theme.text_colors(vals, cmap, 0.0, float(top))
    return bg, fg


def strip_tokens(ds: xr.Dataset, prompt: int) -> list[dict[str, str]]:
    """The token strip's input for one text: visible token, colours by s_1, a tooltip."""
    one = ds.isel(prompt=prompt)
    n = int(one.mask.values.sum())
    s1 = one.sat_layer.values[:n, 0].astype(int)
    kept = one.kept.values[:n]
    bg, fg = _layer_colors(s1, ds.sizes["layer"])
    toks = one.token.values[:n]
    ids = one.token_id.values[:n]
    out = []
    for i in range(n):
        label = "never" if s1[i] < 0 else str(s1[i])
        out.append({"text": theme.show_token(str(toks[i])), "bg": bg[i], "fg": fg[i],
                    "title": f"pos {i} · id {ids[i]} · s_1 = {label}"
                             f"{'' if kept[i] else ' (filtered out)'}"})
    return out
