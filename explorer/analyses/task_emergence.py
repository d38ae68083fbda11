"""Task-vector emergence: a small transformer learns a mixture of ICL tasks, checkpoint by checkpoint.

Han, Song, Gore & Agrawal (ICML 2025) train a GPT-2-style transformer from scratch on a
mixture of sparse linear regressions: every prompt's weight vector lies in one of a few
disjoint orthogonal subspaces (the latent task). As training proceeds the model's
representation of the query token comes to encode which subspace the prompt uses (task
decodability, TD: leave-one-out k-NN accuracy of the task label) and its in-context loss
falls towards the loss of regression restricted to the right subspace. This module trains
such a model and stores its weights at checkpoints (`train_task_emergence`: one
``xarray.Dataset`` with a ``step`` dimension; `save_run_safetensors` /
`load_run_safetensors` write and read them as safetensors), and measures TD per layer and
the ICL loss per task at every checkpoint (`task_emergence_analysis`), with the steps at
which each rises and their correlation over training (`emergence_summary`).

References
----------
S. Han, J. Song, J. Gore, P. Agrawal, "Emergence and Effectiveness of Task Vectors in
In-Context Learning: An Encoder-Decoder Perspective", ICML 2025.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr
from torch import nn

from explorer.defaults import DATASETS_DIR
from explorer._checks import InputError, check_float, check_int
from explorer.analyses._training import (datasets_from_safetensors, datasets_to_safetensors,
                                         run_training_steps, stored_training_run,
                                         training_versions)

__all__ = [
    "CITATION",
    "DEFAULTS",
    "TaskICLTransformer",
    "task_bases",
    "sample_task_prompts",
    "train_task_emergence",
    "task_emergence_model",
    "query_residuals",
    "task_emergence_analysis",
    "rise_step",
    "emergence_summary",
    "save_run_safetensors",
    "load_run_safetensors",
    "task_emergence_run",
    "stored_task_emergence_analysis",
    "SHIPPED_ANALYSIS",
    "save_analysis_safetensors",
    "load_analysis_safetensors",
    "default_analysis",
]

CITATION = ("S. Han, J. Song, J. Gore, P. Agrawal, \"Emergence and Effectiveness of Task Vectors "
            "in In-Context Learning: An Encoder-Decoder Perspective\", ICML 2025.")

#: A CPU-sized version of the paper's synthetic experiment (METHODS.md section 11): the paper
#: uses x in R^16, 4 bases of rank 4, 20 examples, coordinates N(0, 1) and a 12-layer d=128
#: GPT-2; here x in R^8, 4 bases of rank 2, 6 examples and 3 layers of width 64 (about 0.03 s
#: of CPU a step on one thread). The coordinates in each basis are N(1, 0.5^2): with the
#: paper's N(0, 1) this model stayed on its loss plateau, with chance-level TD, for the 1,500
#: steps tried here, while with a task-specific mean both rise within that budget.
DEFAULTS: dict[str, Any] = {
    "d": 8,
    "n_tasks": 4,
    "rank": 2,
    "n_examples": 4,
    "noise_std": 0.1,
    "coef_mean": 1.0,
    "coef_std": 0.3,
    "n_layers": 3,
    "d_model": 64,
    "n_heads": 4,
    "lr": 1e-3,
    "warmup": 500,
    "lr_decay": "cosine",
    "batch_size": 128,
    "steps": 20000,
    "checkpoint_every": 250,
    "seed": 0,
}

ProgressCallback = Callable[[int, int], Any]

_ARCH = ("d", "n_examples", "n_layers", "d_model", "n_heads")


# -- tasks ----------------------------------------------------------------------------

def task_bases(d: int, n_tasks: int, rank: int, *, seed: int = 0) -> np.ndarray:
    """Disjoint orthonormal bases, one per latent task: [task, d, rank].

    The columns of all bases together are orthonormal (the first ``n_tasks * rank``
    columns of a random orthogonal matrix), so the tasks' subspaces are mutually
    orthogonal, as in Han et al.'s B_1..B_4.
    """
    d = check_int("d", d, low=1, high=1024)
    n_tasks = check_int("n_tasks", n_tasks, low=2, high=64)
    rank = check_int("rank", rank, low=1, high=d)
    if n_tasks * rank > d:
        raise InputError(f"`n_tasks * rank` must be at most `d` ({d}) for disjoint orthogonal bases; "
                         f"got {n_tasks} * {rank} = {n_tasks * rank}.")
    rng = np.random.default_rng(check_int("seed", seed))
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    q = q * np.sign(np.diag(r))[None, :]                               # unique, Haar-distributed
    return q[:, :n_tasks * rank].reshape(d, n_tasks, rank).transpose(1, 0, 2).copy()


def _sample(bases: torch.Tensor, n_prompts: int, n_examples: int, noise_std: float,
            tasks: torch.Tensor | None, gen: torch.Generator, coef_mean: float = 0.0,
            coef_std: float = 1.0) -> dict[str, torch.Tensor]:
    n_tasks, d, rank = bases.shape
    if tasks is None:
        tasks = torch.randint(0, n_tasks, (n_prompts,), generator=gen)
    coef = coef_mean + coef_std * torch.randn(n_prompts, rank, generator=gen)
    w = torch.einsum("pdr,pr->pd", bases[tasks], coef)                 # [prompt, d]
    x = torch.randn(n_prompts, n_examples + 1, d, generator=gen)        # [prompt, example, d]
    y = torch.einsum("ped,pd->pe", x, w) + noise_std * torch.randn(n_prompts, n_examples + 1,
                                                                   generator=gen)
    return {"x": x, "y": y, "task": tasks, "w": w}


def sample_task_prompts(bases: np.ndarray, n_prompts: int, n_examples: int, *,
                        tasks: Sequence[int] | None = None, noise_std: float = 0.1,
                        coef_mean: float = 0.0, coef_std: float = 1.0, seed: int = 0) -> xr.Dataset:
    """ICL prompts of the sparse-regression mixture: ``n_examples`` pairs, then the query.

    For each prompt a task ``z`` (uniform, or given in ``tasks``), a weight vector
    ``w = B_z c`` with ``c ~ N(coef_mean, coef_std^2 I_rank)`` (Han et al.: mean 0, std 1;
    a non-zero mean gives every task a typical direction of its own), inputs ``x ~ N(0, I_d)`` and targets
    ``y = w.x + noise_std * N(0, 1)``. The last example is the query.

    Returns
    -------
    xarray.Dataset
        ``x`` (prompt, example, feature), ``y`` (prompt, example), ``task`` (prompt),
        ``w`` (prompt, feature).
    """
    bases = np.asarray(bases, dtype=np.float32)
    if bases.ndim != 3:
        raise InputError(f"`bases` must have dims [task, d, rank]; got shape {bases.shape}.")
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    n_examples = check_int("n_examples", n_examples, low=1, high=512)
    noise_std = check_float("noise_std", noise_std, low=0.0)
    coef_mean = check_float("coef_mean", coef_mean)
    coef_std = check_float("coef_std", coef_std, low=0.0)
    task_t = None
    if tasks is not None:
        task_list = [check_int("tasks[i]", int(t), low=0, high=bases.shape[0] - 1) for t in tasks]
        if len(task_list) != n_prompts:
            raise InputError(f"`tasks` must hold one task per prompt ({n_prompts}); got {len(task_list)}.")
        task_t = torch.as_tensor(task_list, dtype=torch.long)
    gen = torch.Generator().manual_seed(check_int("seed", seed))
    s = _sample(torch.as_tensor(bases), n_prompts, n_examples, noise_std, task_t, gen, coef_mean, coef_std)
    return xr.Dataset(
        {"x": (("prompt", "example", "feature"), s["x"].numpy()),
         "y": (("prompt", "example"), s["y"].numpy()),
         "task": (("prompt",), s["task"].numpy()),
         "w": (("prompt", "feature"), s["w"].numpy())},
        coords={"prompt": np.arange(n_prompts), "example": np.arange(n_examples + 1),
                "feature": np.arange(bases.shape[1])},
        attrs={"method": "sample_task_prompts", "noise_std": noise_std, "coef_mean": coef_mean,
               "coef_std": coef_std, "seed": int(seed)})


# -- model ----------------------------------------------------------------------------

class _Block(nn.Module):
    """Pre-LayerNorm GPT-2 block: causal multi-head attention, then a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_in = nn.Linear(d_model, 4 * d_model)
        self.mlp_out = nn.Linear(4 * d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, m = h.shape
        q, k, v = self.qkv(self.ln_1(h)).split(m, dim=-1)               # [batch, pos, d_model] each
        q, k, v = (a.view(b, t, self.n_heads, m // self.n_heads).transpose(1, 2) for a in (q, k, v))
        z = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, head, pos, d_head]
        h = h + self.proj(z.transpose(1, 2).reshape(b, t, m))
        return h + self.mlp_out(nn.functional.gelu(self.mlp_in(self.ln_2(h))))


class TaskICLTransformer(nn.Module):
    """A small GPT-2-style transformer reading ``(x_1, y_1), ..., (x_n, y_n), (x_q, ?)`` as tokens.

    Each example is one token ``[x_i, y_i, 0]`` and the query ``[x_q, 0, 1]`` (pairs in one
    token, as in He et al.'s linear-ICL setting: interleaving x and y tokens, as Garg et al.
    and Han et al. do, costs the model a long plateau before it links each y to its x, too
    long for a CPU budget). One linear map plus a learned position embedding, pre-LN blocks
    with causal attention, and a readout at the query token.

    Parameters
    ----------
    d : int
        Input dimension.
    n_examples : int
        Context pairs before the query (the sequence has ``n_examples + 1`` tokens).
    n_layers, d_model, n_heads : int
    seed : int, default=0
        Seed of the initialisation (normal, std 0.02, zero biases, as GPT-2).
    """

    def __init__(self, d: int, n_examples: int, *, n_layers: int = 4, d_model: int = 64,
                 n_heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        d = check_int("d", d, low=1, high=1024)
        n_examples = check_int("n_examples", n_examples, low=1, high=512)
        check_int("n_layers", n_layers, low=1, high=48)
        check_int("d_model", d_model, low=1, high=4096)
        check_int("n_heads", n_heads, low=1, high=d_model)
        if d_model % n_heads:
            raise InputError(f"`d_model` ({d_model}) must be a multiple of `n_heads`; got {n_heads}.")
        self.d, self.n_examples = d, n_examples
        self.read_in = nn.Linear(d + 2, d_model)
        self.pos = nn.Parameter(torch.zeros(n_examples + 1, d_model))
        self.blocks = nn.ModuleList(_Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.read_out = nn.Linear(d_model, 1)
        gen = torch.Generator().manual_seed(check_int("seed", seed))
        with torch.no_grad():
            for name, par in self.named_parameters():
                if name.endswith("bias"):
                    par.zero_()
                elif ".ln_" in name or name.startswith("ln_"):
                    par.fill_(1.0)
                else:
                    par.copy_(torch.randn(par.shape, generator=gen) * 0.02)

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    def tokens(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Pair tokens from ``x`` [prompt, n+1, d] and ``y`` [prompt, n+1]: [prompt, n+1, d+2].

        Example ``i`` is ``[x_i, y_i, 0]``; the query is ``[x_q, 0, 1]`` (its answer hidden).
        """
        p, e, d = x.shape
        tok = torch.zeros(p, e, d + 2, dtype=x.dtype)
        tok[..., :d] = x
        tok[:, :-1, d] = y[:, :-1]
        tok[:, -1, d + 1] = 1.0
        return tok

    def forward(self, x: torch.Tensor, y: torch.Tensor, *,
                residuals: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Prediction of the query's y: [prompt] (``y[:, -1]`` is never read).

        With ``residuals=True`` also the residual stream after every block at the query
        token: a list of ``n_layers`` tensors [prompt, d_model].
        """
        h = self.read_in(self.tokens(x, y)) + self.pos                   # [prompt, pos, d_model]
        kept = []
        for block in self.blocks:
            h = block(h)
            if residuals:
                kept.append(h[:, -1])
        pred = self.read_out(self.ln_f(h[:, -1]))[..., 0]               # [prompt]
        return (pred, kept) if residuals else pred

    def flat_weights(self) -> np.ndarray:
        return torch.cat([p.detach().flatten() for p in self.parameters()]).numpy().copy()

    def load_flat_weights(self, flat: np.ndarray) -> None:
        flat = torch.as_tensor(np.asarray(flat, dtype=np.float32))
        n = sum(p.numel() for p in self.parameters())
        if flat.numel() != n:
            raise InputError(f"the checkpoint holds {flat.numel()} weights; this model needs {n}.")
        with torch.no_grad():
            at = 0
            for p in self.parameters():
                p.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()


# -- training -------------------------------------------------------------------------

def train_task_emergence(
    *,
    d: int = DEFAULTS["d"],
    n_tasks: int = DEFAULTS["n_tasks"],
    rank: int = DEFAULTS["rank"],
    n_examples: int = DEFAULTS["n_examples"],
    noise_std: float = DEFAULTS["noise_std"],
    coef_mean: float = DEFAULTS["coef_mean"],
    coef_std: float = DEFAULTS["coef_std"],
    n_layers: int = DEFAULTS["n_layers"],
    d_model: int = DEFAULTS["d_model"],
    n_heads: int = DEFAULTS["n_heads"],
    lr: float = DEFAULTS["lr"],
    warmup: int = DEFAULTS["warmup"],
    lr_decay: str = DEFAULTS["lr_decay"],
    batch_size: int = DEFAULTS["batch_size"],
    steps: int = DEFAULTS["steps"],
    checkpoint_every: int = DEFAULTS["checkpoint_every"],
    seed: int = DEFAULTS["seed"],
    progress: ProgressCallback | None = None,
) -> xr.Dataset:
    """Train the transformer on the sparse-regression task mixture; keep checkpoints.

    Every step draws a fresh batch of prompts (task uniform over ``n_tasks``); the loss is
    the mean squared error of the query predictions; Adam.

    Parameters
    ----------
    d, n_tasks, rank : int, default=8, 4, 2
        Input dimension, number of latent tasks, rank of each task's basis.
    n_examples : int, default=6
        Context pairs before the query.
    noise_std : float, default=0.1
    coef_mean, coef_std : float, default=1.0, 0.5
        Coordinates of ``w`` in its task's basis are ``N(coef_mean, coef_std^2)``.
    n_layers, d_model, n_heads : int, default=3, 64, 4
    lr : float
        Peak Adam learning rate.
    warmup : int
        Steps of linear warm-up from 0 to ``lr``.
    lr_decay : {"cosine", "none"}
        After the warm-up, ``"cosine"`` decays the rate to 0 at the last step.
    batch_size : int, default=128
    steps : int, default=4000
    checkpoint_every : int, default=100
    seed : int, default=0
        Seeds the bases, the initialisation and the training prompts.
    progress : callable, optional
        ``progress(steps_done, steps)`` at every checkpoint; returning ``False`` stops
        (``attrs["cancelled"]`` is then True).

    Returns
    -------
    xarray.Dataset
        ``weights`` (step, parameter): all parameters flattened in module order (attrs
        ``parameter_names`` and ``parameter_shapes`` say how to cut them); ``bases``
        (task, feature, rank); ``train_loss`` (step; mean since the previous checkpoint);
        coordinates ``wall_seconds`` and ``cpu_seconds`` (step; time since the start of
        training, this process's CPU time for the latter). Attrs: method, params, seed, versions,
        citation, train_seconds (wall), train_cpu_seconds (this process's CPU time, which a
        busy machine inflates less), cancelled.
    """
    d = check_int("d", d, low=1, high=1024)
    n_tasks = check_int("n_tasks", n_tasks, low=2, high=64)
    rank = check_int("rank", rank, low=1, high=d)
    n_examples = check_int("n_examples", n_examples, low=1, high=512)
    noise_std = check_float("noise_std", noise_std, low=0.0)
    coef_mean = check_float("coef_mean", coef_mean)
    coef_std = check_float("coef_std", coef_std, low=0.0)
    lr = check_float("lr", lr, low=0.0)
    warmup = check_int("warmup", warmup, low=0)
    if lr_decay not in ("cosine", "none"):
        raise InputError(f"`lr_decay` must be 'cosine' or 'none'; got {lr_decay!r}.")
    batch_size = check_int("batch_size", batch_size, low=1)
    steps = check_int("steps", steps, low=0)
    checkpoint_every = check_int("checkpoint_every", checkpoint_every, low=1)
    seed = check_int("seed", seed)
    bases_np = task_bases(d, n_tasks, rank, seed=seed)
    model = TaskICLTransformer(d, n_examples, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                               seed=seed)
    params = {"d": d, "n_tasks": n_tasks, "rank": rank, "n_examples": n_examples,
              "noise_std": noise_std, "coef_mean": coef_mean, "coef_std": coef_std,
              "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads,
              "lr": lr, "warmup": warmup, "lr_decay": lr_decay, "batch_size": batch_size,
              "steps": steps, "checkpoint_every": checkpoint_every}
    bases = torch.as_tensor(bases_np, dtype=torch.float32)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    snapshots, at_steps, losses, walls, cpus, running = [], [], [], [], [], []
    start, cpu_start = time.perf_counter(), time.process_time()

    def rate(step: int) -> float:
        if step <= warmup:
            return lr * step / warmup
        if lr_decay == "cosine":
            return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))
        return lr

    def checkpoint(step: int) -> None:
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
        snapshots.append(model.flat_weights())
        at_steps.append(step)
        losses.append(float(np.mean(running)) if running else float("nan"))
        running.clear()

    def step_loss(step: int) -> torch.Tensor:
        for group in optimiser.param_groups:
            group["lr"] = rate(step)
        batch = _sample(bases, batch_size, n_examples, noise_std, None, gen, coef_mean, coef_std)
        return ((model(batch["x"], batch["y"]) - batch["y"][:, -1]) ** 2).mean()

    with torch.enable_grad():
        checkpoint(0)
    cancelled = run_training_steps(steps, step_loss, optimiser, losses=running,
                                   checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                                   progress=progress)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    names = [n for n, _ in model.named_parameters()]
    shapes = [list(p.shape) for p in model.parameters()]
    return xr.Dataset(
        {"weights": (("step", "parameter"), np.stack(snapshots).astype(np.float32)),
         "bases": (("task", "feature", "rank"), bases_np.astype(np.float32)),
         "train_loss": (("step",), np.asarray(losses))},
        coords={"step": np.asarray(at_steps, dtype=np.int64),
                "wall_seconds": ("step", np.asarray(walls)),
                "cpu_seconds": ("step", np.asarray(cpus)),
                "task": np.arange(n_tasks), "feature": np.arange(d), "rank": np.arange(rank)},
        attrs=_attrs("task_emergence_run", params, seed, train_seconds=round(seconds, 3),
                     train_cpu_seconds=round(cpu_seconds, 3), cancelled=cancelled,
                     parameter_names=names, parameter_shapes=shapes),
    )


def _attrs(method: str, params: dict, seed: int, **extra: Any) -> dict:
    return {"method": method, "params": params, "seed": int(seed),
            "versions": training_versions(), "citation": CITATION, **extra}


def _check_run(run: Any) -> xr.Dataset:
    if not isinstance(run, xr.Dataset):
        raise TypeError(f"`run` must be an xarray.Dataset from train_task_emergence; "
                        f"got {type(run).__name__}.")
    missing = [v for v in ("weights", "bases") if v not in run]
    if missing or "step" not in run.dims or "params" not in run.attrs:
        raise InputError(f"`run` is not a task-emergence training run (missing "
                         f"{', '.join(missing) or 'step/params'}); make one with train_task_emergence.")
    return run


def _check_step(run: xr.Dataset, step: int) -> int:
    steps = run["step"].values
    step = check_int("step", step)
    if step not in steps:
        shown = ", ".join(str(int(s)) for s in steps[:3])
        shown += f", ..., {int(steps[-1])}" if len(steps) > 3 else ""
        raise InputError(f"`step` must be a checkpoint step of the run ({shown}); got {step}.")
    return step


def task_emergence_model(run: xr.Dataset, step: int) -> TaskICLTransformer:
    """The transformer of ``run`` at checkpoint ``step``."""
    run = _check_run(run)
    step = _check_step(run, step)
    p = run.attrs["params"]
    model = TaskICLTransformer(p["d"], p["n_examples"], n_layers=p["n_layers"], d_model=p["d_model"],
                               n_heads=p["n_heads"])
    model.load_flat_weights(run["weights"].sel(step=step).values)
    return model.eval()


# -- safetensors ----------------------------------------------------------------------

def save_run_safetensors(run: xr.Dataset, path: str | Path) -> Path:
    """Write a run as one safetensors file: every checkpoint's parameters by name.

    Tensors are named ``step_<step>/<parameter>``; ``bases``, ``step``, ``train_loss`` and
    ``wall_seconds`` are tensors too; the run's attrs are JSON in the file's metadata.
    """
    from safetensors.torch import save_file

    run = _check_run(run)
    names, shapes = run.attrs["parameter_names"], run.attrs["parameter_shapes"]
    tensors: dict[str, torch.Tensor] = {}
    for step in run["step"].values:
        flat = torch.as_tensor(run["weights"].sel(step=step).values)
        at = 0
        for name, shape in zip(names, shapes):
            n = int(np.prod(shape)) if shape else 1
            tensors[f"step_{int(step)}/{name}"] = flat[at:at + n].reshape(shape).clone()
            at += n
    tensors["bases"] = torch.as_tensor(run["bases"].values).contiguous()
    tensors["step"] = torch.as_tensor(run["step"].values.astype(np.int64))
    tensors["train_loss"] = torch.as_tensor(run["train_loss"].values.astype(np.float64))
    tensors["wall_seconds"] = torch.as_tensor(run["wall_seconds"].values.astype(np.float64))
    if "cpu_seconds" in run.coords:
        tensors["cpu_seconds"] = torch.as_tensor(run["cpu_seconds"].values.astype(np.float64))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"attrs": json.dumps(run.attrs)})
    return path


def load_run_safetensors(path: str | Path) -> xr.Dataset:
    """Read a run written by `save_run_safetensors` (no pickle involved)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InputError(f"no safetensors run at {str(path)!r}; write one with save_run_safetensors "
                         "or `explorer task-emergence train --out PATH`.")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if "attrs" not in meta:
            raise InputError(f"{str(path)!r} is not a task-emergence run (no attrs in its metadata).")
        attrs = json.loads(meta["attrs"])
        steps = f.get_tensor("step").numpy()
        names = attrs["parameter_names"]
        weights = np.stack([torch.cat([f.get_tensor(f"step_{int(s)}/{n}").flatten() for n in names]).numpy()
                            for s in steps])
        bases = f.get_tensor("bases").numpy()
        loss = f.get_tensor("train_loss").numpy()
        walls = f.get_tensor("wall_seconds").numpy()
        extra = {"cpu_seconds": ("step", f.get_tensor("cpu_seconds").numpy())} if "cpu_seconds" in f.keys() else {}
    n_tasks, d, rank = bases.shape
    return xr.Dataset(
        {"weights": (("step", "parameter"), weights.astype(np.float32)),
         "bases": (("task", "feature", "rank"), bases),
         "train_loss": (("step",), loss)},
        coords={"step": steps, "wall_seconds": ("step", walls), **extra, "task": np.arange(n_tasks),
                "feature": np.arange(d), "rank": np.arange(rank)},
        attrs=attrs)


# -- analysis -------------------------------------------------------------------------

def query_residuals(model: TaskICLTransformer, x: torch.Tensor,
                    y: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Query predictions [prompt] and the query token's residual after every block
    [prompt, layer, d_model]."""
    with torch.no_grad():
        pred, kept = model(x, y, residuals=True)
    return pred.numpy(), torch.stack(kept, 1).numpy()


def _posterior_mean_loss(x: np.ndarray, y: np.ndarray, mean: np.ndarray, cov: np.ndarray,
                         noise_var: float) -> np.ndarray:
    """Squared error at the query of the posterior-mean weights under the prior N(mean, cov):
    w = mean + cov X^T (X cov X^T + noise_var I)^-1 (y - X mean), per prompt."""
    X, Y = x[:, :-1].astype(np.float64), y[:, :-1].astype(np.float64)   # [prompt, n, d], [prompt, n]
    gram = np.einsum("pnd,de,pme->pnm", X, cov, X) + noise_var * np.eye(X.shape[1])
    alpha = np.linalg.solve(gram, (Y - X @ mean)[..., None])[..., 0]    # [prompt, n]
    w = mean + np.einsum("de,pne,pn->pd", cov, X, alpha)
    return (np.einsum("pd,pd->p", x[:, -1].astype(np.float64), w) - y[:, -1]) ** 2


def _pca2(h: np.ndarray) -> np.ndarray:
    """First two principal components, each signed so its largest loading is positive."""
    h = np.where(np.isfinite(h), h, 0.0).astype(np.float64)
    centred = h - h.mean(0)
    # Eigenvectors of the d_model x d_model scatter matrix, in torch (one thread, as set by
    # the caller): numpy's SVD spawns BLAS threads that crawl on a busy machine.
    _, vecs = torch.linalg.eigh(torch.as_tensor(centred.T @ centred))
    comps = vecs.numpy()[:, ::-1][:, :2].T                              # [component, d_model]
    signs = np.sign(comps[np.arange(len(comps)), np.abs(comps).argmax(1)])
    comps = comps * np.where(signs == 0, 1, signs)[:, None]
    out = centred @ comps.T
    return np.pad(out, ((0, 0), (0, 2 - out.shape[1])))


def task_emergence_analysis(run: xr.Dataset, *, n_per_task: int = 100, k: int = 10, seed: int = 1,
                            steps: Sequence[int] | None = None,
                            progress: ProgressCallback | None = None) -> xr.Dataset:
    """Task decodability per layer and ICL loss per task at every checkpoint.

    A fixed evaluation set of ``n_per_task`` prompts per task (seeded by ``seed``, not the
    training seed) is run through every checkpoint. TD at a layer is the leave-one-out
    k-NN (k=10) accuracy of the task label from the residual after that block at the
    query token (the token before the answer), as in Han et al. The ICL loss is the
    squared error of the query prediction, per task; the same prompts give two reference
    losses: the posterior mean knowing the prompt's basis (``oracle_loss``) and not knowing
    it (ridge under the task-averaged prior, ``agnostic_loss``), and the loss of predicting
    0 (``zero_loss``, the variance of y); and the loss of knowing the task without reading
    the examples, i.e. predicting with the task's mean weights (``task_mean_loss``).

    Returns
    -------
    xarray.Dataset
        ``td`` (step, layer), ``td_per_task`` (step, layer, task), ``icl_loss`` (step,
        task) and ``icl_loss_mean`` (step), ``projection`` (step, layer, prompt,
        component: 2-D PCA of the query residuals), ``prompt_task`` (prompt); reference
        losses ``oracle_loss``, ``agnostic_loss``, ``zero_loss``, ``task_mean_loss`` (task); attrs: the
        `emergence_summary` numbers.
    """
    from explorer.analyses.task_vectors import knn_loo_predictions

    run = _check_run(run)
    n_per_task = check_int("n_per_task", n_per_task, low=2)
    p = run.attrs["params"]
    n_tasks = int(run.sizes["task"])
    k = check_int("k", k, low=1, high=n_per_task * n_tasks - 1)
    seed = check_int("seed", seed)
    steps = run["step"].values if steps is None else np.asarray([_check_step(run, s) for s in steps])
    bases = run["bases"].values
    labels = np.repeat(np.arange(n_tasks), n_per_task)
    coef_mean, coef_std = p.get("coef_mean", 0.0), p.get("coef_std", 1.0)
    evalset = sample_task_prompts(bases, len(labels), p["n_examples"], tasks=labels,
                                  noise_std=p["noise_std"], coef_mean=coef_mean, coef_std=coef_std,
                                  seed=seed)
    x, y = evalset["x"].values, evalset["y"].values
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    noise_var = max(p["noise_std"] ** 2, 1e-8)
    # Each task's prior on w: mean B_z 1 coef_mean, covariance coef_std^2 B_z B_z^T. The
    # task-agnostic reference uses one Gaussian with the mixture's mean and covariance.
    means = [b.sum(1) * coef_mean for b in bases.astype(np.float64)]
    covs = [coef_std**2 * b @ b.T for b in bases.astype(np.float64)]
    oracle = np.empty(len(labels))
    for t in range(n_tasks):
        rows = labels == t
        oracle[rows] = _posterior_mean_loss(x[rows], y[rows], means[t], covs[t], noise_var)
    mix_mean = np.mean(means, axis=0)
    mix_cov = (np.mean([c + np.outer(m, m) for m, c in zip(means, covs)], axis=0)
               - np.outer(mix_mean, mix_mean))
    agnostic = _posterior_mean_loss(x, y, mix_mean, mix_cov, noise_var)
    zero = y[:, -1].astype(np.float64) ** 2
    # Knowing the task but not reading the examples: predict with the task's mean weights.
    task_mean = (np.einsum("pd,pd->p", x[:, -1].astype(np.float64), np.asarray(means)[labels]) - y[:, -1]) ** 2

    def per_task(v: np.ndarray) -> np.ndarray:
        return np.array([v[labels == t].mean() for t in range(n_tasks)])

    n_layers = int(p["n_layers"])
    td = np.zeros((len(steps), n_layers))
    td_task = np.zeros((len(steps), n_layers, n_tasks))
    loss = np.zeros((len(steps), n_tasks))
    proj = np.zeros((len(steps), n_layers, len(labels), 2), dtype=np.float32)
    for i, step in enumerate(steps):
        model = task_emergence_model(run, int(step))
        pred, resid = query_residuals(model, xt, yt)        # [prompt], [prompt, layer, d_model]
        loss[i] = per_task((pred.astype(np.float64) - y[:, -1]) ** 2)
        for layer in range(n_layers):
            correct = knn_loo_predictions(resid[:, layer], labels, k) == labels
            td[i, layer] = correct.mean()
            td_task[i, layer] = per_task(correct.astype(np.float64))
            proj[i, layer] = _pca2(resid[:, layer])
        if progress is not None and progress(i + 1, len(steps)) is False:
            steps = steps[:i + 1]
            td, td_task, loss, proj = (a[:i + 1] for a in (td, td_task, loss, proj))
            break
    ds = xr.Dataset(
        {"td": (("step", "layer"), td),
         "td_per_task": (("step", "layer", "task"), td_task),
         "icl_loss": (("step", "task"), loss),
         "icl_loss_mean": (("step",), loss.mean(1)),
         "projection": (("step", "layer", "prompt", "component"), proj),
         "prompt_task": (("prompt",), labels),
         "oracle_loss": (("task",), per_task(oracle)),
         "agnostic_loss": (("task",), per_task(agnostic)),
         "zero_loss": (("task",), per_task(zero)),
         "task_mean_loss": (("task",), per_task(task_mean))},
        coords={"step": np.asarray(steps, dtype=np.int64),
                "wall_seconds": ("step", run["wall_seconds"].sel(step=np.asarray(steps)).values),
                **({"cpu_seconds": ("step", run["cpu_seconds"].sel(step=np.asarray(steps)).values)}
                   if "cpu_seconds" in run.coords else {}),
                "layer": np.arange(n_layers), "task": np.arange(n_tasks),
                "prompt": np.arange(len(labels)),
                "component": ["pc1", "pc2"]},
        attrs=_attrs("task_emergence_analysis", {"n_per_task": n_per_task, "k": k,
                                                 "run_params": p, "run_seed": run.attrs.get("seed")}, seed,
                     train_seconds=run.attrs.get("train_seconds")),
    )
    ds["td"].attrs["long_name"] = "task decodability (leave-one-out 10-NN accuracy)"
    ds["icl_loss"].attrs["long_name"] = "squared error of the query prediction"
    ds.attrs.update(emergence_summary(ds))
    return ds


def rise_step(values: Sequence[float], steps: Sequence[int], *, fraction: float = 0.5) -> int | None:
    """First step at which ``values`` has covered ``fraction`` of its change from the first
    value to the final one (the mean of the last three), in the direction of that change.

    None when the curve does not change (final equals first).
    """
    v = np.asarray(values, dtype=np.float64)
    s = np.asarray(steps)
    fraction = check_float("fraction", fraction, low=0.0, high=1.0)
    if len(v) < 2 or len(v) != len(s):
        raise InputError(f"`values` and `steps` must have the same length, at least 2; "
                         f"got {len(v)} and {len(s)}.")
    final = float(np.mean(v[-3:]))
    change = final - v[0]
    if change == 0 or not np.isfinite(change):
        return None
    level = v[0] + fraction * change
    hit = np.flatnonzero((v - level) * np.sign(change) >= 0)
    return int(s[hit[0]]) if len(hit) else None


def emergence_summary(analysis: xr.Dataset) -> dict[str, Any]:
    """When task encoding and ICL performance rise, and how closely they move together.

    TD is read at the layer with the highest TD at the last checkpoint (``best_layer``);
    ICL performance as ``icl_r2 = 1 - icl_loss_mean / zero_loss_mean`` (fraction of the
    target variance explained at the query). Reported: the first step each covers 10%,
    50% and 90% of its rise, and the Pearson correlation of TD and ``icl_r2`` over the
    checkpoints, overall and per task (TD per task at the best layer against that task's
    r2).
    """
    steps = analysis["step"].values
    td_all = analysis["td"].values
    best = int(np.argmax(td_all[-1]))
    td = td_all[:, best]
    zero = analysis["zero_loss"].values
    r2 = 1 - analysis["icl_loss"].values / zero[None, :]                # [step, task]
    r2_mean = 1 - analysis["icl_loss_mean"].values / zero.mean()

    def corr(a: np.ndarray, b: np.ndarray) -> float | None:
        if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
            return None
        return round(float(np.corrcoef(a, b)[0, 1]), 4)

    td_task = analysis["td_per_task"].values[:, best]                   # [step, task]
    out: dict[str, Any] = {
        "best_layer": best,
        "final_td": [round(float(t), 4) for t in td_all[-1]],
        "initial_td": round(float(td[0]), 4),
        "final_icl_loss": [round(float(v), 4) for v in analysis["icl_loss"].values[-1]],
        "oracle_loss": [round(float(v), 4) for v in analysis["oracle_loss"].values],
        "agnostic_loss": [round(float(v), 4) for v in analysis["agnostic_loss"].values],
        "zero_loss": [round(float(v), 4) for v in zero],
        **({"task_mean_loss": [round(float(v), 4) for v in analysis["task_mean_loss"].values]}
           if "task_mean_loss" in analysis else {}),
        "td_icl_correlation": corr(td, r2_mean),
        "td_icl_correlation_per_task": [corr(td_task[:, t], r2[:, t]) for t in range(r2.shape[1])],
    }
    def rise(values: np.ndarray, fraction: float = 0.5) -> int | None:
        return rise_step(values, steps, fraction=fraction) if len(steps) > 1 else None  # one checkpoint

    for frac in (0.1, 0.5, 0.9):
        tag = int(frac * 100)
        out[f"td_rise_step_{tag}"] = rise(td, frac)
        out[f"icl_rise_step_{tag}"] = rise(r2_mean, frac)
    out["icl_rise_step_50_per_task"] = [rise(r2[:, t]) for t in range(r2.shape[1])]
    return out


# -- cached runs ----------------------------------------------------------------------

def run_key_parts(params: dict[str, Any]) -> dict[str, Any]:
    """The parts of the store key of the training run with ``params`` (`Store.key` hashes them)."""
    return {"method": "task_emergence_run", "format": 1, **params}


def task_emergence_run(*, store=None, retrain: bool = False, progress: ProgressCallback | None = None,
                       **params: Any) -> xr.Dataset:
    """The training run for ``params`` (see `train_task_emergence`), from the store or trained."""
    return stored_training_run(run_key_parts, train_task_emergence, DEFAULTS, params,
                               what="task-emergence", store=store, retrain=retrain,
                               progress=progress)


def stored_task_emergence_analysis(run: xr.Dataset, *, store=None, n_per_task: int = 100, k: int = 10,
                                   seed: int = 1) -> xr.Dataset:
    """`task_emergence_analysis` of a run, from the store or computed and stored (keyed by the
    run's parameters and a hash of its weights)."""
    from explorer.store import ActivationStore

    run = _check_run(run)
    store = ActivationStore() if store is None else store
    digest = hashlib.sha256(np.ascontiguousarray(run["weights"].values).tobytes()).hexdigest()[:32]
    parts = {"method": "task_emergence_analysis", "format": 3,
             "run": {**run.attrs["params"], "seed": run.attrs.get("seed", 0)},
             "weights_sha256": digest, "n_per_task": n_per_task, "k": k, "seed": seed}
    return store.get_or_compute(parts, lambda: task_emergence_analysis(
        run, n_per_task=n_per_task, k=k, seed=seed)).load()


#: The analysis of the seed-0 run with `DEFAULTS`, shipped with the project so the page shows
#: it without training (the run's 81 checkpoints would take 50 MB; the analysis is small).
SHIPPED_ANALYSIS = (DATASETS_DIR / "dynamics"
                    / "task_emergence_seed0_analysis.safetensors")


def save_analysis_safetensors(analysis: xr.Dataset, path: str | Path) -> Path:
    """Write a `task_emergence_analysis` as safetensors (the PCA projection in float16)."""
    if not isinstance(analysis, xr.Dataset) or "td" not in analysis or "projection" not in analysis:
        raise InputError("`analysis` must be a Dataset from task_emergence_analysis.")
    return datasets_to_safetensors({"analysis": analysis}, path, half=("projection",))


def load_analysis_safetensors(path: str | Path) -> xr.Dataset:
    """Read a file of `save_analysis_safetensors` (the projection back in float32)."""
    parts, _ = datasets_from_safetensors(path, as_float32=("projection",))
    if "analysis" not in parts:
        raise InputError(f"{str(path)!r} holds no task-emergence analysis.")
    return parts["analysis"]


def default_analysis(*, store=None, progress: ProgressCallback | None = None) -> xr.Dataset:
    """The analysis of the default seed-0 run: from the store if the run is stored there,
    else the shipped one (`SHIPPED_ANALYSIS`), else the run is trained and analysed."""
    from explorer.store import ActivationStore

    store = ActivationStore() if store is None else store
    stored = store.get(store.key(run_key_parts(dict(DEFAULTS))), verify=False)
    if stored is None and SHIPPED_ANALYSIS.is_file():
        analysis = load_analysis_safetensors(SHIPPED_ANALYSIS)
        analysis.attrs["source"] = (f"shipped with the project ({SHIPPED_ANALYSIS.name}); "
                                    "`explorer task-emergence train` trains the run itself")
        return analysis
    run = stored.load() if stored is not None else task_emergence_run(store=store, progress=progress)
    return stored_task_emergence_analysis(run, store=store)
