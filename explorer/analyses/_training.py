"""Shared pieces of the training-dynamics modules (parity, linear ICL, task emergence).

A terminal progress bar for the command line, a run's attrs (`training_attrs`) and its check
(`check_training_run`), the store lookup that returns a stored training run or trains and stores it, and the step loop
of the regression labs (linear ICL, task emergence).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, StoreError, check_int, safetensors_problem

__all__ = ["ProgressCallback", "terminal_progress", "training_versions", "training_attrs",
           "check_training_run", "check_checkpoint_step", "stored_training_run",
           "datasets_to_safetensors", "datasets_from_safetensors", "run_training_steps",
           "CheckpointLog"]

ProgressCallback = Callable[[int, int], Any]


def terminal_progress(label: str, unit: str = "step") -> ProgressCallback:
    """A ``progress(done, total)`` callback drawing a tqdm bar on stderr."""
    from tqdm import tqdm

    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, leave=False)
        bar["bar"].update(done - bar["bar"].n)
        if done >= total:
            bar["bar"].close()

    return update


def training_versions() -> dict[str, str]:
    """Versions of explorer, torch, numpy and xarray, for a run's attrs."""
    import numpy as np
    import torch

    from explorer._version import __version__

    return {"explorer": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "xarray": xr.__version__}


def training_attrs(method: str, params: dict, seed: int, citation: str, **extra: Any) -> dict:
    """A training run's (or its analysis') attrs: method, params, seed, versions, citation."""
    return {"method": method, "params": params, "seed": int(seed),
            "versions": training_versions(), "citation": citation, **extra}


def check_training_run(run: Any, *, trainer: str, kind: str, variables: Sequence[str],
                       dims: Sequence[str] = (), attrs: Sequence[str] = ()) -> xr.Dataset:
    """``run`` when it is a run of ``trainer`` (an xarray.Dataset holding ``variables``, over
    ``dims``, with ``attrs``); a TypeError or InputError naming what is missing otherwise."""
    if not isinstance(run, xr.Dataset):
        raise TypeError(f"`run` must be an xarray.Dataset from {trainer}; got {type(run).__name__}.")
    missing = [v for v in variables if v not in run]
    if missing or any(d not in run.dims for d in dims) or any(a not in run.attrs for a in attrs):
        raise InputError(f"`run` is not a {kind} training run (missing "
                         f"{', '.join(missing) or '/'.join([*dims, *attrs])}); make one with {trainer}.")
    return run


def check_checkpoint_step(run: xr.Dataset, step: int) -> int:
    """``step`` when ``run`` holds a checkpoint at it; an InputError showing the run's steps
    otherwise."""
    steps = run["step"].values
    step = check_int("step", step)
    if step not in steps:
        shown = ", ".join(str(int(s)) for s in steps[:3])
        shown += f", ..., {int(steps[-1])}" if len(steps) > 3 else ""
        raise InputError(f"`step` must be a checkpoint step of the run ({shown}); got {step}.")
    return step


def stored_training_run(parts_of: Callable[[dict[str, Any]], dict[str, Any]],
                        train: Callable[..., xr.Dataset], defaults: Mapping[str, Any],
                        params: Mapping[str, Any], *, what: str, store=None, retrain: bool = False,
                        progress: ProgressCallback | None = None,
                        shipped: Callable[[dict[str, Any], Any], xr.Dataset | None] | None = None
                        ) -> xr.Dataset:
    """The run of ``train(**defaults, **params)``, from the store or trained and stored.

    ``parts_of(full_params)`` names the store entry; ``what`` names the run in the error for
    an unknown parameter. ``shipped(full_params, store)``, if given, is asked for a run that
    comes with the project (or None) before training one that the store lacks; what it
    returns is stored like a trained run.
    """
    from explorer.store import ActivationStore

    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise InputError(f"unknown {what} training parameter {unknown[0]!r}; allowed: "
                         f"{', '.join(defaults)}.")
    full = {**defaults, **params}
    store = ActivationStore() if store is None else store
    parts = parts_of(full)
    if retrain:
        store.put(store.key(parts), train(**full, progress=progress), parts=parts)
    elif shipped is not None and store.get(store.key(parts), verify=False) is None:
        run = shipped(full, store)
        if run is not None:
            store.put(store.key(parts), run, parts=parts)
    return store.get_or_compute(parts, lambda: train(**full, progress=progress)).load()


# -- runs as safetensors ----------------------------------------------------------------

def datasets_to_safetensors(parts: Mapping[str, xr.Dataset], path, *, half: Sequence[str] = (),
                            metadata: Mapping[str, Any] | None = None):
    """Write xarray Datasets (numeric variables, numeric or text coordinates) into one
    safetensors file; no pickle.

    Every variable and numeric coordinate of ``parts[name]`` becomes the tensor
    ``name/<variable>``; dims, text coordinates and attrs go into the file's metadata as JSON. Variables named
    in ``half`` are stored as float16 (half the size; about 3 significant digits).
    """
    import json
    from pathlib import Path

    import numpy as np
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    for name, ds in parts.items():
        entry: dict[str, Any] = {"vars": {}, "coords": {}, "text_coords": {}, "attrs": ds.attrs}
        for kind, items in (("vars", ds.data_vars.items()), ("coords", ds.coords.items())):
            for var, arr in items:
                values = np.asarray(arr.values)
                if kind == "coords" and values.dtype.kind in "UO" and values.ndim == 1:
                    entry["text_coords"][var] = [list(arr.dims), [str(v) for v in values]]
                    continue
                if values.dtype.kind not in "biuf":
                    raise InputError(f"{name}/{var} has dtype {values.dtype}; only numbers and bools "
                                     "can be written to safetensors.")
                if var in half:
                    values = values.astype(np.float16)
                tensors[f"{name}/{var}"] = torch.from_numpy(np.ascontiguousarray(values).copy())
                entry[kind][var] = list(arr.dims)
        layout[name] = entry
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"layout": json.dumps(layout),
                                            **{k: json.dumps(v) for k, v in (metadata or {}).items()}})
    return path


def datasets_from_safetensors(path, *, as_float32: Sequence[str] = ()) -> tuple[dict[str, xr.Dataset],
                                                                                  dict[str, Any]]:
    """Read the Datasets written by `datasets_to_safetensors`, and the extra metadata.

    Variables named in ``as_float32`` are cast back to float32 (exactly the stored values).
    """
    import json
    from pathlib import Path

    import numpy as np
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InputError(f"no safetensors file at {str(path)!r}.")
    problem = safetensors_problem(path)
    if problem is not None:
        raise StoreError(f"{str(path)!r} is damaged ({problem}); restore it (`git checkout -- "
                         f"{path}` for a file that ships with the project) or write it again.")
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        if "layout" not in meta:
            raise InputError(f"{str(path)!r} holds no xarray layout in its metadata.")
        layout = json.loads(meta.pop("layout"))
        out: dict[str, xr.Dataset] = {}
        for name, entry in layout.items():
            def read(var: str) -> np.ndarray:
                values = f.get_tensor(f"{name}/{var}").numpy()
                return values.astype(np.float32) if var in as_float32 else values

            data = {var: (tuple(dims), read(var)) for var, dims in entry["vars"].items()}
            coords = {var: (tuple(dims), read(var)) for var, dims in entry["coords"].items()}
            coords.update({var: (tuple(dims), values) for var, (dims, values)
                           in entry.get("text_coords", {}).items()})
            out[name] = xr.Dataset(data, coords=coords, attrs=entry["attrs"])
    return out, {k: json.loads(v) for k, v in meta.items()}


class CheckpointLog:
    """What a run of `run_training_steps` keeps at each checkpoint: the step, the training
    loss averaged over the steps since the previous checkpoint (the losses ``running``
    collects), wall and CPU seconds since the log began, and a snapshot of the weights."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.train_loss: list[float] = []
        self.wall_seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.snapshots: list[Any] = []
        self.running: list[float] = []          # pass as `run_training_steps`' ``losses``
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def record(self, step: int, snapshot: Any) -> None:
        """A checkpoint at ``step`` holding ``snapshot``; the running losses start afresh."""
        self.wall_seconds.append(time.perf_counter() - self._start)
        self.cpu_seconds.append(time.process_time() - self._cpu_start)
        self.snapshots.append(snapshot)
        self.steps.append(step)
        self.train_loss.append(float(np.mean(self.running)) if self.running else float("nan"))
        self.running.clear()

    def timing_attrs(self, cancelled: bool) -> dict[str, Any]:
        """A finished run's timing attrs: ``train_seconds`` (wall) and ``train_cpu_seconds``
        (this process) since the log began, to the millisecond, and whether it was
        ``cancelled``."""
        seconds = time.perf_counter() - self._start
        cpu_seconds = time.process_time() - self._cpu_start
        return {"train_seconds": round(seconds, 3), "train_cpu_seconds": round(cpu_seconds, 3),
                "cancelled": cancelled}


def run_training_steps(steps: int, step_loss: Callable[[int], torch.Tensor],
                       optimiser: torch.optim.Optimizer, *, losses: list[float],
                       checkpoint: Callable[[int], None], checkpoint_every: int,
                       progress: Callable[[int, int], bool | None] | None = None) -> bool:
    """``checkpoint(0)`` (the initial weights), then steps 1..``steps`` with gradients on:
    ``step_loss(step)`` (which samples its batch), backward, one optimiser step; the loss goes
    to ``losses``. Every ``checkpoint_every`` steps and at the last, ``checkpoint(step)``, then
    ``progress(step, steps)``: False stops the loop. Returns whether it stopped early
    (cancelled)."""
    with torch.enable_grad():
        checkpoint(0)
        for step in range(1, steps + 1):
            loss = step_loss(step)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            losses.append(float(loss.detach()))
            if step % checkpoint_every == 0 or step == steps:
                checkpoint(step)
                if progress is not None and progress(step, steps) is False:
                    return True
    return False
