"""The saturation page's injection test: a pair of tokens with the same prediction and
far-apart s_1, the early token's residual injected at a layer into the late one's, and the
new s_1 (`explorer.analyses.saturation.inject_residual`)."""
from __future__ import annotations

import html
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param

import explorer
from apps import theme
from apps._session import CancelToken
from explorer.analyses import saturation as sat

__all__ = ["plot_intervention", "InjectionPart"]

hv.extension("bokeh", logo=False)


def plot_intervention(r: dict[str, Any] | None, decode: Any) -> hv.Element:
    """Rank of the late token's prediction per layer, before and after the injection."""
    if r is None:
        return hv.Text(0, 0, "pick a pair").opts(title="Intervention", xaxis=None, yaxis=None,
                                                 responsive=True, min_height=260)
    cat = theme.CMAPS["categorical"]
    n = len(r["rank_before"])
    before = hv.Curve((np.arange(n), np.asarray(r["rank_before"]) + 1), "layer", "rank + 1",
                      label=f"before (s_1 = {r['s1_before']})").opts(color=cat[0])
    after = hv.Curve((np.arange(n), np.asarray(r["rank_after"]) + 1), "layer", "rank + 1",
                     label=f"after (s_1 = {r['s1_after']})").opts(color=cat[3])
    inj = hv.VLine(r["layer"]).opts(color="black", line_dash="dashed")
    return (before * after * inj).opts(
        title=f"Injection at layer {r['layer']}", logy=True, legend_position="right",
        responsive=True, min_height=260)


class InjectionPart:
    """The injection test of `SaturationView`."""

    def pairs(self) -> list[tuple[int, int, int]]:
        ds = self.result
        if ds is None or not ds.sizes.get("pair", 0):
            return []
        return list(zip(ds.pair_prompt.values.tolist(), ds.pair_early.values.tolist(),
                        ds.pair_late.values.tolist()))

    def pair_label(self, i: int) -> str:
        ds = self.result
        p, e, l = self.pairs()[i]
        tok = ds.token.values
        s1 = ds.sat_layer.values[..., 0]
        return (f"text {p}: {theme.show_token(str(tok[p, e]))!r} @ {e} (s_1={s1[p, e]}) → "
                f"{theme.show_token(str(tok[p, l]))!r} @ {l} (s_1={s1[p, l]})")

    def _pair_changed(self, *events: Any) -> None:
        pairs = self.pairs()
        if not pairs:
            self.intervention = None
            return
        p, e, _ = pairs[min(self.pair, len(pairs) - 1)]
        s_early = int(self.result.sat_layer.values[p, e, 0])
        layer = min(max(0, s_early), self._model.spec.n_layers - 2)
        if layer == self.inj_layer:
            self._request_intervention()
        else:
            self.inj_layer = layer          # triggers the run

    def _request_intervention(self, *events: Any) -> None:
        pairs = self.pairs()
        if not pairs:
            return
        p, e, l = pairs[min(self.pair, len(pairs) - 1)]
        ds, layer, weights = self.result, self.inj_layer, self.weights
        text = self.texts()[p]
        base = {"rank": ds.final_rank.values[p, l, :, 0].astype(int).tolist(),
                "top1": int(ds.final_token_id.values[p, l, 0])}

        def job(token: CancelToken):
            model = self.current_model()
            clean = None if model.remote else self.cached(   # a remote injection does not resume
                "injection clean", (weights, text), lambda: explorer.clean_run(model, [text]),
                limit=4)
            token.check()
            return sat.inject_residual(model, text, source_pos=e, target_pos=l, layer=layer,
                                       clean=clean, baseline=base)

        self.submit("intervention", job)

    def _show_intervention(self, r: dict[str, Any]) -> None:
        self.intervention = r

    @param.depends("result", "intervention", "pair")
    def _intervention(self):
        pairs = self.pairs()
        if self.result is None:
            return pn.pane.Markdown("The injection test waits for the corpus analysis: its "
                                    "token pairs come from the analysed text.")
        if not pairs:
            return pn.pane.Markdown("No token pairs with the same prediction and far-apart s_1 "
                                    "in the analysed text.")
        pair = min(self.pair, len(pairs) - 1)
        label = html.escape(self.pair_label(pair))
        r = self.intervention
        if r is None:
            line = "Running the intervention…"
        else:
            p, e, l = pairs[pair]
            words = self.decode([r["top1_before"], r["top1_after"]])
            line = (f'<span data-sat-injection="{p}:{e}:{l}:{r["layer"]}:{r["s1_before"]}:'
                    f'{r["s1_after"]}:{r["top1_before"]}:{r["top1_after"]}"></span>'
                    f'Injected at layer {r["layer"]}: s_1 {r["s1_before"]} → {r["s1_after"]}; '
                    f'prediction {"changed" if r["prediction_changed"] else "unchanged"} '
                    f'({html.escape(repr(words[r["top1_before"]]))} → '
                    f'{html.escape(repr(words[r["top1_after"]]))})')
        return pn.Column(pn.pane.HTML(f"<b>Pair {self.pair}</b>: {label}<br>{line}",
                                      css_classes=["sat-injection"]),
                         pn.pane.HoloViews(plot_intervention(self.intervention, self.decode),
                                           sizing_mode="stretch_width",
                                           css_classes=["sat-intervention"]),
                         sizing_mode="stretch_width")
