"""Choosing the heads of the Knowledge conflicts page's JuICE run: a click on the heatmap or
the scatter toggles a head in the set *Clicks add heads to* names, the top heads by direct
effect fill both sets, and the gallery's component menu adds a head."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import xarray as xr

from apps import theme
from apps._conflicts_plots import head_name, selected_heads_in
from apps._heads_heatmap import head_cell
from apps._session import CancelToken, user_message
from explorer import components
from explorer._checks import InputError, check_choice
from explorer.analyses import conflicts as C

__all__ = ["JUICE_SETS", "HeadsPart"]


JUICE_SETS = {"enhance": "heads_plus", "suppress": "heads_minus"}
"""`ConflictsView.add_to_juice`'s ``which`` and the head set it fills."""


class HeadsPart:
    """The head sets (S+ / S-) of `apps.conflicts.ConflictsView`."""

    def add_to_juice(self, component: str, which: str) -> bool:
        """Add the head ``component`` (``"L17.H3"``; other spellings `explorer.components`
        reads are accepted) to the JuICE enhance (S+, ``which="enhance"``) or suppress (S-,
        ``"suppress"``) set; the plots and bars redraw. A head in the other set moves.
        Anything that is not a head of this model, or a bad ``which``, gives a notification
        and changes nothing. Returns whether the head is now in the set."""
        spec = self._model.spec
        try:
            check_choice("which", which, list(JUICE_SETS))
            c = components.check_in_model(component, self._model.n_layers, spec.n_heads)
            if not c.is_head:
                raise InputError(f"{c} is not an attention head: the JuICE sets hold heads "
                                 "(e.g. L3.H1).")
        except (InputError, components.ComponentError, TypeError) as exc:
            theme.notify("error", f"Knowledge conflicts: {user_message(exc)}")
            return False
        name = str(c)
        into, other = JUICE_SETS[which], JUICE_SETS["suppress" if which == "enhance" else "enhance"]
        sets = {into: list(getattr(self, into)), other: list(getattr(self, other))}
        moved = name in sets[other]
        if name not in sets[into]:
            sets[into].append(name)
        sets[other] = [n for n in sets[other] if n != name]
        self.param.update(**sets)
        label = "S+ (enhance)" if which == "enhance" else "S- (suppress)"
        theme.notify("info", f"Knowledge conflicts: {name} {'moved to' if moved else 'in'} "
                             f"{label}.", duration=3000)
        return True

    def toggle_head(self, layer: int, head: int) -> None:
        """Add the head to the set the toggle names, or remove it if already chosen."""
        name = head_name(layer, head)
        plus, minus = list(self.heads_plus), list(self.heads_minus)
        if name in plus or name in minus:
            plus = [n for n in plus if n != name]
            minus = [n for n in minus if n != name]
        elif self.pick_set.startswith("S+"):
            plus.append(name)
        else:
            minus.append(name)
        self.param.update(heads_plus=plus, heads_minus=minus)

    def pick_top_heads(self, k: int = 3) -> None:
        """Fill S+ with the k heads whose direct effect pushes hardest toward the direction's
        answer on this example, and S- with the k pushing hardest against it."""
        if self.scores is None:
            return
        d = self.scores.direct_diff.mean(("kind", "fact")).values     # [layer, head]
        if self.direction == "context":
            d = -d
        order = np.argsort(d, axis=None)
        H = d.shape[1]
        plus = [head_name(*divmod(int(i), H)) for i in order[::-1][:k] if d.flat[i] > 0]
        minus = [head_name(*divmod(int(i), H)) for i in order[:k] if d.flat[i] < 0]
        self.param.update(heads_plus=plus, heads_minus=minus)

    def _scatter_tapped(self, index: list[int]) -> None:
        if index and self.scores is not None:
            H = self.scores.sizes["head"]
            self.toggle_head(*divmod(int(index[0]), H))

    def _heatmap_tapped(self, x: Any = None, y: Any = None) -> None:
        cell = head_cell(x, y, self.scores)
        if cell is not None:
            self.toggle_head(*cell)

    def _selection_note(self, highlighted: list[str], scores: xr.Dataset | None) -> str:
        """Which of the workspace's selected heads the plots outline (dashed)."""
        spec = self._model.spec
        cells = selected_heads_in(highlighted, self._model.n_layers, spec.n_heads)
        if not cells:
            return ""
        names = ", ".join(head_name(l, h) for l, h in cells)
        return (f"Your selected heads, outlined dashed on the heatmap and ringed dashed on the "
                f"scatter: {names}. *Clicks add heads to* puts a clicked head in S+ or S-.")

    def _select_job(self) -> Callable[[CancelToken], xr.Dataset]:
        """JuICE's head selection on the example (the intervention's effect on the three
        prompt types), with progress and the time left."""
        model, direction = self._model, self.direction
        facts = self.selection_facts()
        k = int(self.select_k)
        started = time.perf_counter()
        report = self.progress_fn(token=None)

        def job(token: CancelToken):
            def progress(done: int, total: int) -> None:
                token.check()
                report(done, total)
                left = (time.perf_counter() - started) * (total - done) / max(1, done)
                self.post(status=f"scoring heads by intervention: {done}/{total} "
                                 f"(about {left:.0f} s left)")
            return C.juice_head_selection(model, facts, direction=direction, k=k,
                                          prune=True, progress=progress)
        self.param.update(progress=0, progress_active=True)
        return job

    def _got_selection(self, ds: xr.Dataset) -> None:
        plus, minus = C.selected_heads(ds)
        self.param.update(heads_plus=[head_name(*h) for h in plus],
                          heads_minus=[head_name(*h) for h in minus],
                          status=f"JuICE selection: S+ {len(plus)}, S- {len(minus)} heads "
                                 "(consistent over the three prompt types)")
