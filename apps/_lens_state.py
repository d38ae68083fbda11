"""The logit lens page's session state: its settings and results exported as JSON and
imported again (checked, size-limited), and its tables for the page-data export."""
from __future__ import annotations

import io
import json
from typing import Any

import bokeh
import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param

import explorer
from apps import theme
from apps._lens_tables import contrast_prompts, lens_grid_table
from apps._session import user_message
from explorer._checks import InputError, check_float, check_int

__all__ = ["STATE_FORMAT", "STATE_FORMAT_VERSION", "StatePart"]

hv.extension("bokeh", logo=False)


STATE_FORMAT = "explorer.lens-state"


STATE_FORMAT_VERSION = 1


_MAX_STATE_BYTES = 4_000_000


_RUN_PARAMS = ("prompt", "k", "steer_layer", "alpha", "contrast_a", "contrast_b")


class StatePart:
    """The state export and import of `apps.lens.LensView`."""

    def export_tables(self) -> dict[str, pd.DataFrame]:
        """The lens grid as tidy tables (`lens_grid_table`): ``lens`` (the heatmap's result)
        and, with workspace edits, ``lens_edited``; a row per (position, layer, rank)."""
        out = {}
        if self.result is not None:
            out["lens"] = lens_grid_table(self.result)
        if self.edited_result is not None:
            out["lens_edited"] = lens_grid_table(self.edited_result)
        return out

    def export_state(self) -> dict[str, Any]:
        """The page's state as JSON-able data: model, prompts, parameters, edits, versions."""
        p = self._run_params()
        spec = self._model.spec
        return {
            "format": STATE_FORMAT,
            "format_version": STATE_FORMAT_VERSION,
            "view": "lens",
            "model": spec.name,
            "model_weights": spec.weights,
            "prompts": [p["prompt"]],
            "params": p,
            "edits": json.loads(explorer.edits_to_json(self.edits_for(p))),
            "versions": {**spec.versions, "panel": pn.__version__,
                         "holoviews": hv.__version__, "bokeh": bokeh.__version__},
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore parameters and edits from `export_state` output (one run follows).

        Raises InputError naming the first bad field. A state saved with another model
        keeps its parameters; its steering vector is recomputed for this model.
        """
        if not isinstance(state, dict):
            raise InputError(f"a lens state must be a JSON object; got {type(state).__name__}.")
        if state.get("format") != STATE_FORMAT:
            raise InputError(f"`format` must be {STATE_FORMAT!r}; got {state.get('format')!r}.")
        params = state.get("params")
        if not isinstance(params, dict):
            raise InputError("`params` must be an object of lens parameters.")
        unknown = sorted(set(params) - set(_RUN_PARAMS))
        if unknown:
            raise InputError(f"unknown lens parameter {unknown[0]!r}; allowed: "
                             f"{', '.join(_RUN_PARAMS)}.")
        edits = explorer.edits_from_json(json.dumps(state.get("edits", [])))
        same_model = state.get("model") == self._model.spec.name
        if not same_model:
            theme.notify("warning", f"This state was saved with model {state.get('model')!r}; "
                                    f"the page runs {self._model.spec.name!r}. Parameters restored; "
                                    "the steering vector is recomputed.")
        new = {**self._run_params(), **params}
        for e in edits:
            if not isinstance(e, explorer.Steer):
                raise InputError(f"the lens page applies steer edits only; got a {e.kind!r} edit.")
            if e.layer != new["steer_layer"] or e.alpha != new["alpha"]:
                raise InputError("the steer edit does not match `steer_layer`/`alpha` in `params`.")
        new = self._checked_params(new)
        if same_model:
            for e in edits:
                key = (tuple(contrast_prompts(new["contrast_a"])),
                       tuple(contrast_prompts(new["contrast_b"])), e.layer)
                if len(e.vector) == self._model.spec.d_model:
                    self.cache_put("steering vectors", key,
                                   np.asarray(e.vector, dtype=np.float32), limit=16)
        self.param.update(**new)

    def _checked_params(self, p: dict[str, Any]) -> dict[str, Any]:
        """Parameters from a state file, each checked against its bounds before any is set."""
        for name in ("prompt", "contrast_a", "contrast_b"):
            if not isinstance(p[name], str):
                raise InputError(f"`{name}` must be a string; got {type(p[name]).__name__}.")
        out = dict(p)
        for name, check in (("steer_layer", check_int), ("alpha", check_float), ("k", check_int)):
            low, high = self.param[name].bounds
            out[name] = check(name, p[name], low=low, high=high)
        return out

    def _state_file(self) -> io.StringIO:
        return io.StringIO(json.dumps(self.export_state(), indent=1))

    def _upload_state(self, event: param.parameterized.Event) -> None:
        data, filename = event.new, event.obj.filename or ""
        if not data:
            return
        try:
            if not filename.lower().endswith(".json"):
                raise InputError(f"state files are .json; got {filename!r}.")
            if len(data) > _MAX_STATE_BYTES:
                raise InputError(f"{filename!r} is {len(data)} bytes; a state file is at most "
                                 f"{_MAX_STATE_BYTES}.")
            try:
                state = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise InputError(f"{filename!r} is not valid JSON ({exc}).") from None
            self.load_state(state)
        except (InputError, ValueError, TypeError) as exc:
            theme.notify("error", f"Import failed: {user_message(exc)}")
        else:
            theme.notify("success", f"Loaded {filename}.")
        finally:
            event.obj.clear()  # the same file can be loaded again
