"""The Circuits page's patching readouts: one edge patched to its corrupted value, every
edge outside the shown circuit patched (its own faithfulness), and the full model's task
metric with the workspace's edits."""
from __future__ import annotations

from typing import Any

import numpy as np

from apps._session import CancelToken
from apps._circuits_scoring import task_logit_diff
from explorer._checks import InputError
from explorer.analyses import circuits as ca
from explorer.workspace import edit_label

__all__ = ["CircuitAblation"]


class CircuitAblation:
    """The ablation part of `apps.circuits.CircuitsView` (a mixin): the patching jobs and
    the readout's text."""

    def _request_ablation(self) -> None:
        if not self.edge or self.scores is None or self.edge not in self._edge_labels:
            return
        index = self._edge_labels[self.edge]
        m, task, scores = self._model, self._task, self.scores
        label, key = self.edge, self._key()

        def job(token: CancelToken):
            keep = np.ones(scores.sizes["edge"], bool)
            keep[index] = False  # every edge clean but this one
            out = ca.patch_edges_metric(m, task, scores, keep, batch_size=len(task),
                                        progress=self.progress_fn(token))
            out.update(edge=label, estimate=float(scores["score"].values[index]),
                       index=int(index), key=key)
            return out

        self.status = f"patching {label}…"
        self.submit("ablate", job)

    def _got_ablation(self, out: dict) -> None:
        self._effects.setdefault(out["key"], {})[out["index"]] = out["metric"] - out["clean_metric"]
        self.ablation = out
        self.status = f"patched {out['edge']}"
        t = self._table
        if t is not None and out["key"] == self._key() and (t["edge"] == out["index"]).any():
            t["effect"][t["edge"] == out["index"]] = f"{out['metric'] - out['clean_metric']:+.4f}"
            self._frame_key = None
            self.redraw()   # the hover's patch effect

    def shown_edges(self) -> np.ndarray:
        """Bool mask over the shown scores' edges: the shown circuit (the pruned circuit of
        the current selection, the one the title counts and the faithfulness marker places;
        all of it, also past the `self.max_drawn_edges` drawn)."""
        scores, _, _ = self._current()
        return np.zeros(0, bool) if scores is None else self._circuit(scores).copy()

    def request_circuit_patch(self) -> None:
        """Patch every edge outside the shown circuit to its corrupted value (the shown
        circuit's own faithfulness, `circuits.patch_edges_metric`)."""
        scores, _, label = self._current()
        if scores is None or self._task is None:
            self.show_error(InputError("no circuit yet: press Compute circuit first."))
            return
        if scores is not self.scores:
            self.show_error(InputError(f"the graph shows the fine-tuning checkpoint ({label}); "
                                       "patching runs on the base model's circuit (checkpoint 0)."))
            return
        keep = self.shown_edges()
        m, task, key = self._model, self._task, self._key()

        def job(token: CancelToken):
            out = ca.patch_edges_metric(m, task, scores, keep, batch_size=len(task),
                                        progress=self.progress_fn(token))
            out.update(key=key, n_shown=int(keep.sum()), n_drawn=int(self._shown["drawn"]))
            return out

        self.status = f"patching every edge outside the circuit's {int(keep.sum()):,}…"
        self.submit("circuit_patch", job)

    def _got_circuit_patch(self, out: dict) -> None:
        self.circuit_patch = out
        self.status = f"patched every edge outside the circuit's {out['n_shown']:,}"

    def _request_edited(self) -> None:
        """The task metric of the full model without and with the workspace edits (on the
        shown task's pairs); nothing without edits or before a task has been scored."""
        task, edits = self._task, list(self.edits)
        if not edits or task is None:
            if self.edited is not None:
                self.edited = None
            return
        key = (self._key()[:2], tuple(edits))
        if self.edited is not None and self.edited.get("key") == key:
            return
        m = self._model

        def job(token: CancelToken):
            plain = task_logit_diff(m, task)
            token.check()
            edited = task_logit_diff(m, task, edits=edits)
            return {"key": key, "labels": [edit_label(e) for e in edits],
                    **{f"{k}_metric": float(v.mean()) for k, v in plain.items()},
                    **{f"edited_{k}_metric": float(v.mean()) for k, v in edited.items()}}

        self.submit("edited", job)

    def _got_edited(self, out: dict) -> None:
        span = out["clean_metric"] - out["corrupt_metric"]
        out["recovered"] = ((out["edited_clean_metric"] - out["corrupt_metric"]) / span
                            if span else float("nan"))
        self.edited = out

    def _readout(self, *_: Any) -> str:
        return "\n\n".join(p for p in (self._ablation_text(), self._circuit_patch_text(),
                                        self._edited_text()) if p)

    def _circuit_patch_text(self) -> str:
        c = self.circuit_patch
        if c is None or c.get("key") != self._key():
            return ""
        more = (f" ({c['n_drawn']:,} of them drawn)" if c["n_shown"] > c["n_drawn"] else "")
        return (f"**Only the circuit's {c['n_shown']:,} edges kept**{more}, every other edge patched "
                f"to corrupted: metric **{c['metric']:.4f}**, **{c['recovered']:.0%}** of the "
                f"clean − corrupted gap recovered (clean {c['clean_metric']:.4f}, corrupted "
                f"{c['corrupt_metric']:.4f}); accuracy {c['accuracy']:.0%} (clean "
                f"{c['clean_accuracy']:.0%}).")

    def _ablation_text(self) -> str:
        a, s = self.ablation, self.scores
        if s is None:
            return "**Edge ablation:** waiting for the edge scores."
        if a is None:
            return ("**Edge ablation:** click an edge or choose one in the list to patch it to "
                    "its corrupted value.")
        change = a["metric"] - a["clean_metric"]
        return (f"**{a['edge']}** patched: metric **{a['metric']:.4f}** (clean "
                f"{a['clean_metric']:.4f}, corrupted {a['corrupt_metric']:.4f}); change "
                f"**{change:+.4f}**, EAP estimate {a['estimate']:+.4f}")

    def _edited_text(self) -> str:
        """The full model's task metric clean vs with the workspace edits."""
        e = self.edited
        if not self.edits:
            return ""
        if e is None:
            return "**Workspace edits:** the task metric with them follows the edge scores."
        what = ", ".join(e["labels"])
        return (f"**Full model with the workspace edits** ({what}): logit difference on the "
                f"clean prompts **{e['clean_metric']:.4f} → {e['edited_clean_metric']:.4f}** "
                f"(clean → edited), {e['recovered']:.0%} of the clean − corrupted gap kept; on "
                f"the corrupted prompts {e['corrupt_metric']:.4f} → "
                f"{e['edited_corrupt_metric']:.4f}. The graph and scores are of the unedited "
                "model.")
