"""The Knowledge conflicts page's α sliders, live: a preview of the answer bars while a slider
moves, the exact bars on release.

The preview (`preview_after`) re-runs run 2 of the dual run (or the single run) in plain torch
from the lowest layer with a chosen head, on the example's cached run 1: the residual before
that layer and every head's output there are run 1's, so only the layers from there on run
again (`explorer.lens_preview.head_edited_forward`, the logit lens preview's blocks), at one
torch thread (`preview_threads`), and only the last position is unembedded, over the whole
vocabulary. The page's previews compute in float32 (``precision="float32"``): their
probabilities are the exact path's up to float32 rounding (1e-5; checked against the exact
path and a plain-torch forward with hooks in tests/test_apps_conflicts_preview.py).
``precision="bfloat16"`` runs the products on bfloat16 copies of the weights (the lens
preview's choice where the CPU has native bfloat16 arithmetic): faster, but each product
carries bfloat16 rounding and the probabilities move up to `BF16_BOUND`. The bars' caption
says which. Where the forward does not cover the model (not a Llama-style block), where run 1
carries workspace edits, or with ``precision="exact"``, the preview is the exact path itself.

The controller is the logit lens page's (`apps._preview_slot`): one preview computes at a
time on an uncounted runner (a drag's moves do not toggle the sidebar's stop button), the
newest move waits in a single slot and older ones are dropped, the slider (`live_slider`)
sends each move at once, and releasing it sets the α Parameter, which runs the exact bars.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import panel as pn
import param
import torch

from apps._conflicts_plots import answer_bars_data, parse_head
from apps._preview_slot import PreviewSlot, live_slider
from apps._provenance import Provenance, computed_at_now
from apps._session import CancelToken, Cancelled
from explorer._checks import InputError
from explorer.analyses import conflicts as C
from explorer.lens_preview import (Gemm, forward_model_reason, head_edited_forward,
                                   preview_threads)
from explorer.models import Model

__all__ = ["preview_after", "preview_dtype", "BF16_BOUND", "PreviewPart", "PRECISIONS"]

BF16_BOUND = 0.05
"""A bound on |P(bfloat16 preview) - P(exact)| (SmolLM2, 3 facts, both conflict prompt types,
heads from layer 0 to 27, both interventions, α up to 5: at most 0.036)."""

PRECISIONS = ("float32", "bfloat16", "exact")


def _unembedding(model: Model) -> Gemm:
    """The unembedding as a `Gemm`, kept on the model (its bfloat16 copy is made once)."""
    w = model.unembed_module.weight
    cached = model.__dict__.get("_conflicts_unembed")
    if cached is None or cached[0] != (w.data_ptr(), w._version):
        bias = getattr(model.unembed_module, "bias", None)
        cached = model.__dict__["_conflicts_unembed"] = ((w.data_ptr(), w._version),
                                                         Gemm(w, bias))
    return cached[1]


def _heads(model: Model, heads: Sequence[Any]) -> list[tuple[int, int]]:
    """(layer, head) pairs from names (``L3.H1``) or pairs, checked against the model."""
    out = []
    for h in heads:
        layer, head = parse_head(h) if isinstance(h, str) else (int(h[0]), int(h[1]))
        out.append((model.check_layer(layer, "head layer"), model.check_head(head, "head")))
    return out


def preview_dtype(model: Model, run1: C.JuiceFirstRun, precision: str = "float32") -> str:
    """What `preview_after` computes with: "bfloat16" or "float32" (the plain-torch forward's
    products), or "exact" (the exact path: the forward does not cover the model, or run 1
    carries edits)."""
    if precision not in PRECISIONS:
        raise InputError(f"`precision` must be one of {', '.join(map(repr, PRECISIONS))}; "
                         f"got {precision!r}.")
    if precision == "exact" or run1.edits or forward_model_reason(model) is not None \
            or len(run1.batch.lengths) != 1:
        return "exact"
    return precision


def preview_after(model: Model, run1: C.JuiceFirstRun, fact: C.Fact, plus: Sequence[Any],
                  minus: Sequence[Any], *, alpha_l: float, alpha_s: float,
                  mode: str = "juice", precision: str = "float32") -> np.ndarray:
    """P(memory answer), P(context answer) [2] of ``fact`` after the intervention, previewed
    (see the module doc): run 2 (``mode="juice"``: ``+α_l`` / ``-α_s`` times run 1's head
    output added before ``o_proj``) or the single run (``"single"``: each head scaled by
    ``1 + α_l`` / ``1 - α_s``) re-run from the lowest chosen layer on ``run1``.
    ``precision``: "float32", "bfloat16" or "exact" (`preview_dtype`)."""
    if mode not in ("juice", "single"):
        raise InputError(f"`mode` must be 'juice' or 'single'; got {mode!r}.")
    plus, minus = _heads(model, plus), _heads(model, minus)
    dtype = preview_dtype(model, run1, precision)
    with preview_threads(), torch.no_grad():
        return _after(model, run1, fact, plus, minus, float(alpha_l), float(alpha_s), mode,
                      dtype)


def _after(model: Model, run1: C.JuiceFirstRun, fact: C.Fact, plus: list[tuple[int, int]],
           minus: list[tuple[int, int]], alpha_l: float, alpha_s: float, mode: str,
           dtype: str) -> np.ndarray:
    """`preview_after`'s computation, at the thread count it set."""
    if dtype == "exact":
        run = C.juice_logits if mode == "juice" else C.single_run_logits
        logits = run(model, None, plus, minus, alpha_l=alpha_l, alpha_s=alpha_s, run1=run1)
        return C.answer_probabilities(model, logits, [fact])[0]
    if not plus + minus:
        return C.answer_probabilities(model, run1.logits, [fact])[0]
    d = model.spec.d_head
    n = int(run1.batch.lengths[0])
    edits: dict[int, list[tuple[slice, float]]] = {}
    for heads, a in ((plus, alpha_l), (minus, -alpha_s)):
        for layer, head in heads:
            scale = a if mode == "juice" else 1.0 + a
            edits.setdefault(layer, []).append((slice(head * d, (head + 1) * d), scale))

    def z_edit(layer: int, z: torch.Tensor) -> torch.Tensor:
        if layer not in edits:
            return z
        z = z.clone()
        for cols, a in edits[layer]:
            if mode == "juice":        # run 1's head output, a times again
                z[:, cols] += a * run1.attn_z[layer][0, -n:, cols].float()
            else:                      # the head's own output, scaled
                z[:, cols] *= a
        return z

    backend = "bfloat16" if dtype == "bfloat16" else "torch"
    h = head_edited_forward(model, run1.clean, min(edits), z_edit, backend=backend,
                            final_norm=True)[-1:]                           # [1, d_model]
    logits = _unembedding(model)(h, backend)                                # [1, vocab]
    cap_attr = model.arch.logit_softcap_attr
    cap = getattr(model.hf.config, cap_attr, None) if cap_attr else None
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return C.answer_probabilities(model, logits, [fact])[0]


class PreviewPart(param.Parameterized):
    """The α sliders' preview of `apps.conflicts.ConflictsView` (the lens page's controller:
    one preview at a time, the newest move waiting, older ones dropped)."""

    preview_precision = "float32"
    """`preview_after`'s ``precision`` for the page's previews."""

    def _init_preview(self) -> None:
        self.runner("preview", self._show_preview, busy=False, counted=False)
        self.runner("warm", self._show_preview, busy=False)     # `_warm_preview`
        self._slot = PreviewSlot(self._submit_preview)
        self._seq = 0            # requests (previews and exact runs)
        self._exact_seq = 0      # the newest exact request: older previews are not drawn
        self.preview_runs = 0    # previews computed (tests and the bench read it)
        self.preview_ms: list[float] = []     # each preview's computation (server side)
        self._sliders: dict[str, pn.widgets.FloatSlider] = {}

    @property
    def previewing(self) -> bool:
        """Whether the clean bars show a preview (a slider is moving, or its exact bars are
        still computing)."""
        return self.shown is not None and bool(self.shown.setting("preview"))

    def _exact_requested(self) -> None:
        """An exact run of the bars was asked for: previews asked before it are stale."""
        self._yield_timing()
        self._seq += 1
        self._exact_seq = self._seq
        self._slot.drop_pending()

    def request_preview(self, name: str, value: float) -> None:
        """Preview the bars with the α Parameter ``name`` (alpha_l or alpha_s) at ``value``
        (its slider is being dragged). Nothing happens before the example's run 1 and first
        bars are in: the exact bars follow the release."""
        p = self._preview_params()
        if p is None:
            return
        self._yield_timing()
        self._seq += 1
        p[name] = float(value)
        request = (self._seq, p)
        self._slot.request(request)

    def _preview_params(self) -> dict | None:
        """The inputs of a preview of the current bars (run 1 None where it is not computed
        yet: the preview job makes it); None before the example's first bars."""
        key, run1 = self._run1
        if key != (self._fact(), self.kind) or self.bar_rows is None:
            return None
        return {"fact": self._fact(), "kind": self.kind, "mode": self.mode,
                "heads_plus": list(self.heads_plus), "heads_minus": list(self.heads_minus),
                "alpha_l": self.alpha_l, "alpha_s": self.alpha_s, "run1": run1}

    def _warm_preview(self) -> None:
        """Served, after exact bars: one preview that is not drawn, so that a drag's first
        move finds run 1 and the forward's blocks ready (run 1 is not made when the bars came
        from the result cache; the blocks are built on the first forward, seconds on a busy
        machine). Without chosen heads it runs the last layer's first head. A move made
        meanwhile waits in the slot."""
        if not self._background or self._model.remote:
            return
        p = self._preview_params()
        if p is None or (p["run1"] is not None and self.preview_runs):
            return
        if not p["heads_plus"] + p["heads_minus"]:
            p["heads_plus"] = [(self._model.n_layers - 1, 0)]
        self._slot.warm((self._exact_seq, p))

    def _submit_preview(self, request: tuple[int, dict], lane: str) -> CancelToken | None:
        """Start the preview job of ``request`` on the runner ``lane`` (`PreviewSlot`)."""
        return self.submit(lane, lambda token: self._preview_job(request, token))

    def _preview_job(self, request: tuple[int, dict], token: CancelToken) -> tuple:
        seq, p = request
        token.check()
        start = time.perf_counter()
        if p["run1"] is None:          # the bars came from the result cache
            p = {**p, "run1": C.juice_first_run(self._model, [C.conflict_prompt(p["fact"],
                                                                                p["kind"])])}
            if self._run1[0] == (p["fact"], p["kind"]) and self._run1[1] is None:
                self._run1 = ((p["fact"], p["kind"]), p["run1"])
            token.check()
        try:
            after = preview_after(self._model, p["run1"], p["fact"], p["heads_plus"],
                                  p["heads_minus"], alpha_l=p["alpha_l"], alpha_s=p["alpha_s"],
                                  mode=p["mode"], precision=self.preview_precision)
            before = C.answer_probabilities(self._model, p["run1"].logits, [p["fact"]])[0]
            rows, exc = answer_bars_data(before, after), None
        except Cancelled:
            raise
        except Exception as exc_:  # a failed preview is not drawn; the exact run reports
            rows, exc = None, exc_
        self.preview_runs += 1
        self.preview_ms.append(1000 * (time.perf_counter() - start))
        return seq, p, rows, exc

    def _show_preview(self, out: tuple) -> None:
        seq, p, rows, exc = out
        self._slot.landed()
        # served, the waiting move starts computing while this one is drawn
        self._slot.next()
        if exc is None and rows is not None and seq > self._exact_seq:
            self.param.update(bar_rows=rows, shown=self.preview_record(p), result_note="")

    def preview_record(self, p: dict) -> Provenance:
        """The record of a preview at ``p``: the request's record (`conflicts_request`) with
        the time and the settings ``preview`` and ``precision`` (`preview_dtype`)."""
        from apps._conflicts_record import conflicts_request

        record = conflicts_request(self._model.spec.name, p["fact"], p["kind"], p["mode"],
                                   p["heads_plus"], p["heads_minus"], p["alpha_l"],
                                   p["alpha_s"], list(self.edits))
        dtype = preview_dtype(self._model, p["run1"], self.preview_precision)
        return dataclasses.replace(record, computed_at=computed_at_now(),
                                   settings=(("preview", True), ("precision", dtype)))

    def alpha_slider(self, name: str) -> pn.widgets.FloatSlider:
        """The slider of the α Parameter ``name``: a preview while it moves (``value``), the
        exact bars on release (``value_throttled`` sets the Parameter)."""
        if name not in self._sliders:
            self._sliders[name] = live_slider(
                self, name, lambda value: self.request_preview(name, value))
        return self._sliders[name]
