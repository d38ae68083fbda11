"""Readouts as records: what a run brings back, named the way its edits are.

An edit (`Ablate`, `Patch`, `Steer`, ...) says what a run changes; a readout says what it
returns. Each record is a small frozen value that serialises to JSON (`readouts_to_json`)
and does two things for `explorer.trace.read`, the one function that runs a batch with
edits and readouts:

* `Readout.request` names what the single nnsight trace must compute for it (the fields of
  `explorer.trace.TraceRequest`: layer sites to keep, the lens or the attribution reduced
  inside the trace), so a remote run sends the same records and gets back only these values;
* `Readout.arrays` turns that batch's tensors into named arrays (positions unpadded, NaN or
  -1 past a prompt's end), and `Readout.dims` / `Readout.coords` label them.

==============  ====================================================================
`Save`          a layer site at some layers (every prompt position, or given points)
`Logits`        the output logits
`FinalNorm`     the final norm's output
`Lens`          the logit lens reduced in the trace: top tokens per layer, the ranks
                and log-probs of the output's top tokens, cosines of adjacent layers
`DLA`           direct logit attribution of target tokens (per head, MLP, embedding)
`Grad`          gradients of the answer tokens' probability at the last position with
                respect to layer sites
==============  ====================================================================
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from ._checks import (InputError, check_choice, check_int, check_site, check_token_ids,
                      record_from_dict, records_from_json)
from .models import Batch

__all__ = ["Readout", "Save", "Logits", "FinalNorm", "Lens", "DLA", "Grad", "Chunk",
           "check_readouts",
           "merge_requests", "readout_from_dict", "readouts_to_json", "readouts_from_json"]

SAVE_SITES = ("resid_pre", "attn_q", "attn_k", "attn_v", "attn_z", "head_out", "attn_pattern",
              "mlp_hidden", "mlp_out", "resid_post")
"""Layer sites a `Save` reads (``head_out`` is each head's write, made inside the trace)."""

_SITE_DIMS = {
    "resid_pre": ("d_model",), "resid_post": ("d_model",), "mlp_out": ("d_model",),
    "attn_z": ("head", "d_head"), "head_out": ("head", "d_model"),
    "attn_q": ("head", "d_head"), "attn_k": ("kv_head", "d_head"), "attn_v": ("kv_head", "d_head"),
    "mlp_hidden": ("neuron",),
}


class Chunk(NamedTuple):
    """One batch of a `read`: its rows of the whole prompt list and how positions are kept."""

    spec: Any                        # the model's spec (n_layers, n_heads, d_head, ...)
    batch: Batch
    rows: range                      # this batch's rows of the whole prompt list
    positions: list[int] | None      # per-prompt positions kept (None: every token)
    n_pos: int                       # width of the pos axis of the result
    n_src: int                       # width of attn_pattern's src_pos axis

    def unpad(self, x: torch.Tensor, fill: float = np.nan) -> np.ndarray:
        """[prompt, padded_pos or kept pos, ...] -> [prompt, n_pos, ...], ``fill`` past the end."""
        x = x.detach().cpu()
        if x.dtype.is_floating_point:
            x = x.double() if x.dtype == torch.float64 else x.float()
        a = x.numpy()
        if self.positions is not None:
            return a
        out = np.full((a.shape[0], self.n_pos, *a.shape[2:]), fill, dtype=a.dtype)
        for i, n in enumerate(self.batch.lengths):
            out[i, :n] = a[i, self.batch.width - n:]
        return out


@dataclass(frozen=True)
class Readout:
    """Base of the readout records."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}

    def checked(self, model: Any) -> Readout:
        """The record with its layers resolved against ``model`` (None -> every layer)."""
        return self

    def check_run(self, n_prompts: int, positions: list[int] | None) -> None:
        """Raise InputError where the record does not fit the run's prompts or positions."""

    def request(self, chunk: Chunk) -> dict[str, Any]:
        """The `explorer.trace.TraceRequest` fields this record needs for one batch."""
        raise NotImplementedError

    def arrays(self, out: dict[Any, Any], chunk: Chunk) -> dict[str, np.ndarray]:
        """This record's arrays of one batch (prompt-first), from `run_batch`'s tensors."""
        raise NotImplementedError

    def dims(self) -> dict[str, tuple[str, ...]]:
        """Variable name -> dims."""
        raise NotImplementedError

    def coords(self, spec: Any) -> dict[str, Any]:
        """Coordinates of the dims this record adds (beyond prompt and pos)."""
        return {}

    def finish(self, parts: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
        """The batches' arrays as one per variable (prompt-first: concatenated)."""
        return {name: p[0] if len(p) == 1 else np.concatenate(p, axis=0)
                for name, p in parts.items()}


def _normalise_layers(record: Readout) -> None:
    """A record's ``layers`` as a tuple of ints (None and a single int stay as given, for
    `_layer_tuple` to resolve against the model)."""
    layers = record.layers
    if layers is not None and not isinstance(layers, (int, np.integer)):
        object.__setattr__(record, "layers", tuple(int(x) for x in layers))


def _layer_tuple(model: Any, layers: Any, what: str) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(model.n_layers))
    if isinstance(layers, (int, np.integer)):
        layers = [layers]
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"`{what}.layers` must be a list of ints; got {type(layers).__name__}.")
    out = tuple(sorted({model.check_layer(int(x)) for x in layers}))
    if not out:
        raise InputError(f"`{what}.layers` is empty; pass None for every layer.")
    return out


@dataclass(frozen=True)
class Save(Readout):
    """Keep ``site`` at ``layers`` (None: every layer).

    Variable ``site``: (prompt, pos, layer, ...) with ``resid_*`` / ``mlp_out`` [d_model],
    ``attn_z`` / ``attn_q`` [head, d_head], ``attn_k`` / ``attn_v`` [kv_head, d_head] (the
    key/value heads: under grouped-query attention query head h reads kv head
    h // (n_heads // n_kv_heads)), ``mlp_hidden`` [neuron] (d_mlp), ``head_out`` [head,
    d_model]; ``attn_pattern`` is (prompt,
    layer, head, dst_pos, src_pos). With ``points`` ((prompt, pos) pairs, pos negative from
    the prompt's end) only those tokens are kept: (point, layer, ...), in the given order,
    with coords ``point_prompt`` and ``point_pos``. Every `Save` of a run keeps the same
    points or none, and points exclude the run's ``positions``.
    """

    site: str
    layers: tuple[int, ...] | None = None
    points: tuple[tuple[int, int], ...] | None = None
    kind: ClassVar[str] = "save"

    def __post_init__(self):
        check_site(self.site, SAVE_SITES)
        _normalise_layers(self)
        if self.points is not None:
            if self.site == "attn_pattern":
                raise InputError("`points` apply to sites other than 'attn_pattern'.")
            pts = tuple((int(p), int(q)) for p, q in self.points)
            object.__setattr__(self, "points", pts)

    def checked(self, model: Any) -> Save:
        return Save(self.site, _layer_tuple(model, self.layers, "Save"), self.points)

    def check_run(self, n_prompts: int, positions: list[int] | None) -> None:
        if self.points is None:
            return
        if positions is not None:
            raise InputError("`Save.points` and the run's `positions` cannot both be given.")
        bad = [p for p, _ in self.points if not 0 <= p < n_prompts]
        if bad:
            raise InputError(f"`Save.points` name prompt {bad[0]}; the run has {n_prompts}.")

    def _padded_points(self, chunk: Chunk) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The points in this batch: their indices in ``points`` and (row, padded col)."""
        idx, rows, cols = [], [], []
        for j, (p, q) in enumerate(self.points):
            if p not in chunk.rows:
                continue
            n = chunk.batch.lengths[p - chunk.rows.start]
            if not -n <= q < n:
                raise InputError(f"`Save.points` ({p}, {q}) is outside prompt {p}'s {n} tokens.")
            idx.append(j)
            rows.append(p - chunk.rows.start)
            cols.append(chunk.batch.width - n + (q % n))
        return idx, torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)

    def request(self, chunk: Chunk) -> dict[str, Any]:
        req: dict[str, Any] = {"save": {(layer, self.site) for layer in self.layers}}
        if self.points is not None:
            _, rows, cols = self._padded_points(chunk)
            req["save_points"] = (rows, cols)
        return req

    def arrays(self, out: dict[Any, Any], chunk: Chunk) -> dict[str, np.ndarray]:
        spec = chunk.spec
        if self.site == "attn_pattern":
            pats = [_unpad_pattern(out[(layer, self.site)], chunk) for layer in self.layers]
            return {self.site: np.stack(pats, axis=1)}           # [prompt, layer, head, dst, src]
        per_layer = []
        for layer in self.layers:
            x = out[(layer, self.site)]
            if self.site in ("attn_z", "attn_q"):
                x = x.reshape(*x.shape[:-1], spec.n_heads, spec.d_head)
            elif self.site in ("attn_k", "attn_v"):
                x = x.reshape(*x.shape[:-1], spec.n_kv_heads, spec.d_head)
            per_layer.append(x)
        if self.points is not None:
            idx, _, _ = self._padded_points(chunk)
            stacked = torch.stack(per_layer, 1).detach().cpu().float().numpy()  # [pt, layer, ...]
            return {self.site: stacked, f"_{self.site}_point": np.array(idx, dtype=np.int64)}
        return {self.site: _stack_layers(per_layer, chunk)}

    def finish(self, parts: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
        joined = super().finish(parts)
        if self.points is None:
            return joined
        order = joined.pop(f"_{self.site}_point")         # batches hold points by prompt
        values = np.empty_like(joined[self.site])
        values[order] = joined[self.site]
        return {self.site: values}

    def dims(self) -> dict[str, tuple[str, ...]]:
        if self.site == "attn_pattern":
            return {self.site: ("prompt", "layer", "head", "dst_pos", "src_pos")}
        lead = ("point",) if self.points is not None else ("prompt", "pos")
        return {self.site: (*lead, "layer", *_SITE_DIMS[self.site])}

    def coords(self, spec: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": np.array(self.layers)}
        if self.site in ("attn_z", "attn_q", "head_out", "attn_pattern"):
            out["head"] = np.arange(spec.n_heads)
        if self.site in ("attn_k", "attn_v"):
            out["kv_head"] = np.arange(spec.n_kv_heads)
        if self.points is not None:
            pts = np.array(self.points, dtype=np.int64).reshape(-1, 2)
            out.update(point=np.arange(len(pts)), point_prompt=("point", pts[:, 0]),
                       point_pos=("point", pts[:, 1]))
        return out


def _stack_layers(per_layer: list[torch.Tensor], chunk: Chunk) -> np.ndarray:
    """Per-layer [prompt, padded or kept pos, ...] -> [prompt, n_pos, layer, ...]: one copy."""
    stacked = None
    lengths, width = chunk.batch.lengths, chunk.batch.width
    for li, x in enumerate(per_layer):
        x = x.detach().cpu()
        xn = (x.float() if x.dtype != torch.float64 else x).numpy()
        if stacked is None:
            stacked = np.empty((len(lengths), chunk.n_pos, len(per_layer), *xn.shape[2:]),
                               dtype=xn.dtype)
        if chunk.positions is not None:
            stacked[:, :, li] = xn
            continue
        for i, n in enumerate(lengths):
            stacked[i, :n, li] = xn[i, width - n:]
            stacked[i, n:, li] = np.nan
    return stacked


def _unpad_pattern(p: torch.Tensor, chunk: Chunk) -> np.ndarray:
    """Padded [prompt, head, dst, src] weights -> [prompt, head, n_pos, n_src], NaN padded.

    Destination rows are each prompt's kept positions (every real token if None); source
    columns are every real token, so a selected row still shows all it attends to.
    """
    p = p.float().numpy()
    out = np.full((p.shape[0], p.shape[1], chunk.n_pos, chunk.n_src), np.nan, dtype=p.dtype)
    for i, n in enumerate(chunk.batch.lengths):
        offset = chunk.batch.width - n
        rows = (range(n) if chunk.positions is None
                else [q + n if q < 0 else q for q in chunk.positions])
        rows = [offset + r for r in rows]
        out[i, :, :len(rows), :n] = p[i][:, rows, offset:]  # [head, dst, src]
    return out


@dataclass(frozen=True)
class _Output(Readout):
    """An output of the model's last layers (not a layer site): variable ``var`` (prompt,
    pos, ``dim``) at the run's positions."""

    var: ClassVar[str] = ""
    dim: ClassVar[str] = ""
    needs: ClassVar[dict[str, Any]] = {}

    def request(self, chunk: Chunk) -> dict[str, Any]:
        return dict(self.needs)

    def arrays(self, out: dict[Any, Any], chunk: Chunk) -> dict[str, np.ndarray]:
        return {self.var: chunk.unpad(out[self.var])}

    def dims(self) -> dict[str, tuple[str, ...]]:
        return {self.var: ("prompt", "pos", self.dim)}


@dataclass(frozen=True)
class Logits(_Output):
    """The output logits: ``logits`` (prompt, pos, vocab)."""

    kind: ClassVar[str] = "logits"
    var: ClassVar[str] = "logits"
    dim: ClassVar[str] = "vocab"
    needs: ClassVar[dict[str, Any]] = {"logits": True}


@dataclass(frozen=True)
class FinalNorm(_Output):
    """The final norm's output: ``final_norm`` (prompt, pos, d_model)."""

    kind: ClassVar[str] = "final_norm"
    var: ClassVar[str] = "final_norm"
    dim: ClassVar[str] = "d_model"
    needs: ClassVar[dict[str, Any]] = {"save_final": ("final_norm",)}


@dataclass(frozen=True)
class Lens(Readout):
    """The logit lens at ``layers`` (None: every layer), reduced inside the trace. Layer l
    reads ``resid_post`` of layer l (TransformerLens' ``blocks.{l}.hook_resid_post``; no
    embedding row).

    Variables: ``lens_top_id`` / ``lens_top_logprob`` (prompt, pos, lens_layer, top): each
    layer's ``k`` most likely tokens through the final norm and unembedding;
    ``lens_final_id`` (prompt, pos, top): the output's top ``k`` tokens; ``lens_rank`` /
    ``lens_logprob`` (prompt, pos, lens_layer, ranked): the strict rank (tokens scoring
    higher) and log-probability at each layer of the output's first ``ranked`` top tokens
    (default ``k``); with ``cosine``, ``lens_cos`` (prompt, pos, lens_layer): the cosine of
    resid_post with the previous layer's (NaN at the first lens layer; every lens layer
    but the first needs its predecessor in ``layers``).
    """

    k: int
    layers: tuple[int, ...] | None = None
    ranked: int | None = None
    cosine: bool = False
    kind: ClassVar[str] = "lens"

    def __post_init__(self):
        check_int("k", self.k, low=1)
        _normalise_layers(self)
        object.__setattr__(self, "cosine", bool(self.cosine))

    def checked(self, model: Any) -> Lens:
        if self.k > model.vocab_size:
            raise InputError(f"`Lens.k` must be at most the vocabulary ({model.vocab_size}); "
                             f"got {self.k}.")
        return Lens(self.k, _layer_tuple(model, self.layers, "Lens"), self.ranked, self.cosine)

    def request(self, chunk: Chunk) -> dict[str, Any]:
        return {"lens_k": self.k, "lens_layers": self.layers, "lens_ranked": self.ranked,
                "lens_cosine": self.cosine}

    def arrays(self, out: dict[Any, Any], chunk: Chunk) -> dict[str, np.ndarray]:
        per = [out[("lens", layer)] for layer in self.layers]   # (ids, logp, rank, logp_final)
        names = ("lens_top_id", "lens_top_logprob", "lens_rank", "lens_logprob")
        got = {name: chunk.unpad(torch.stack([x[j] for x in per], 2), fill=_fill(per[0][j]))
               for j, name in enumerate(names)}
        got["lens_final_id"] = chunk.unpad(out["lens_final_id"], fill=-1)
        if self.cosine:
            first = torch.full(out[("lens", self.layers[0])][1].shape[:2], float("nan"))
            cos = [out[("lens_cos", layer)] if ("lens_cos", layer) in out else first
                   for layer in self.layers]
            got["lens_cos"] = chunk.unpad(torch.stack(cos, 2))
        return got

    def dims(self) -> dict[str, tuple[str, ...]]:
        d = {"lens_top_id": ("prompt", "pos", "lens_layer", "top"),
             "lens_top_logprob": ("prompt", "pos", "lens_layer", "top"),
             "lens_rank": ("prompt", "pos", "lens_layer", "ranked"),
             "lens_logprob": ("prompt", "pos", "lens_layer", "ranked"),
             "lens_final_id": ("prompt", "pos", "top")}
        if self.cosine:
            d["lens_cos"] = ("prompt", "pos", "lens_layer")
        return d

    def coords(self, spec: Any) -> dict[str, Any]:
        return {"lens_layer": np.array(self.layers), "top": np.arange(self.k),
                "ranked": np.arange(self.k if self.ranked is None else self.ranked)}


def _fill(x: torch.Tensor) -> float:
    return np.nan if x.dtype.is_floating_point else -1


_DLA_PARTS = {"embed": ("embed", ()), "heads": ("head", ("layer", "head")),
              "attn_bias": ("attn_bias", ("layer",)), "mlp": ("mlp", ("layer",)),
              "norm_bias": ("norm_bias", ())}
"""`DLA`'s variables: name -> (the `direct_logit_attribution` part, dims between pos and
target)."""


@dataclass(frozen=True)
class DLA(Readout):
    """Direct logit attribution of ``target_ids`` ([prompt][target] token ids) at the run's
    ``positions`` (required), computed inside the trace.

    Variables, float64: ``embed``, ``heads`` (layer, head), ``attn_bias`` and ``mlp``
    (layer), ``norm_bias``, each over (prompt, pos, ..., target), and ``logit`` (prompt, pos,
    target), the targets' logits; where the residual stream is a plain sum (not under
    Gemma 2's post-norms, nor a logit soft cap) the terms add up to it. Coord ``target_id``.
    """

    target_ids: tuple[tuple[int, ...], ...]
    kind: ClassVar[str] = "dla"

    def __post_init__(self):
        ids = np.asarray(self.target_ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise InputError(f"`DLA.target_ids` must be [prompt, target] ints; got shape "
                             f"{ids.shape}.")
        object.__setattr__(self, "target_ids", tuple(tuple(int(t) for t in r) for r in ids))

    def checked(self, model: Any) -> DLA:
        check_token_ids("DLA.target_ids", np.asarray(self.target_ids), model.vocab_size)
        return self

    def check_run(self, n_prompts: int, positions: list[int] | None) -> None:
        if positions is None:
            raise InputError("`DLA` needs the run's `positions` (the positions to attribute).")
        if len(self.target_ids) != n_prompts:
            raise InputError(f"`DLA.target_ids` must have one row per prompt ({n_prompts}); "
                             f"got {len(self.target_ids)}.")

    def _batch_ids(self, chunk: Chunk) -> torch.Tensor:
        """The target ids of this batch's prompts, [prompt, target]."""
        ids = torch.tensor([self.target_ids[i] for i in chunk.rows], dtype=torch.long)
        return ids.reshape(len(chunk.rows), -1)

    def request(self, chunk: Chunk) -> dict[str, Any]:
        return {"dla_ids": self._batch_ids(chunk), "logits": True}

    def arrays(self, out: dict[Any, Any], chunk: Chunk) -> dict[str, np.ndarray]:
        got = {name: out[("dla", part)].double().numpy()
               for name, (part, _) in _DLA_PARTS.items()}
        ids = self._batch_ids(chunk)
        logits = out["logits"].double()                                 # [prompt, pos, vocab]
        got["logit"] = logits.gather(-1, ids[:, None, :].expand(-1, logits.shape[1], -1)).numpy()
        return got

    def dims(self) -> dict[str, tuple[str, ...]]:
        d = {name: ("prompt", "pos", *mid, "target") for name, (_, mid) in _DLA_PARTS.items()}
        d["logit"] = ("prompt", "pos", "target")
        return d

    def coords(self, spec: Any) -> dict[str, Any]:
        ids = np.array(self.target_ids, dtype=np.int64).reshape(len(self.target_ids), -1)
        return {"layer": np.arange(spec.n_layers), "head": np.arange(spec.n_heads),
                "target": np.arange(ids.shape[1]), "target_id": (("prompt", "target"), ids)}


GRAD_SITES = ("resid_pre", "attn_z", "mlp_out", "resid_post")
"""Layer sites a `Grad` differentiates by."""


@dataclass(frozen=True)
class Grad(Readout):
    """Gradients of the summed probability of ``token_ids`` (one token per prompt) at each
    prompt's last position with respect to ``sites`` at ``layers`` (None: every layer).

    Variables ``grad_<site>`` (prompt, pos, layer, ...) shaped as the site's `Save`
    (``attn_z`` [head, d_head]), float32: the gradient with respect to the site's value
    after the run's edits there. The trace tracks gradients from layer 0's input on, so
    the weights get none; a remote run is one NDIF session that turns gradient tracking on
    around the trace (the server runs a request's own forward without it).
    """

    sites: tuple[str, ...]
    token_ids: tuple[int, ...]
    layers: tuple[int, ...] | None = None
    kind: ClassVar[str] = "grad"

    def __post_init__(self):
        sites = (self.sites,) if isinstance(self.sites, str) else tuple(self.sites)
        if not sites:
            raise InputError("`Grad.sites` is empty: name at least one of "
                             f"{', '.join(GRAD_SITES)}.")
        object.__setattr__(self, "sites", tuple(check_site(x, GRAD_SITES)
                                                for x in dict.fromkeys(sites)))
        ids = np.asarray(self.token_ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InputError(f"`Grad.token_ids` must be one token id per prompt; got shape "
                             f"{ids.shape}.")
        object.__setattr__(self, "token_ids", tuple(int(t) for t in ids))
        _normalise_layers(self)

    def checked(self, model: Any) -> Grad:
        check_token_ids("Grad.token_ids", np.asarray(self.token_ids), model.vocab_size)
        return Grad(self.sites, self.token_ids, _layer_tuple(model, self.layers, "Grad"))

    def check_run(self, n_prompts: int, positions: list[int] | None) -> None:
        if len(self.token_ids) != n_prompts:
            raise InputError(f"`Grad.token_ids` must hold one token per prompt ({n_prompts}); "
                             f"got {len(self.token_ids)}.")

    def request(self, chunk: Chunk) -> dict[str, Any]:
        return {"grad": {(layer, site) for layer in self.layers for site in self.sites},
                "grad_ids": torch.tensor([self.token_ids[i] for i in chunk.rows])}

    def arrays(self, out: dict[Any, Any], chunk: Chunk) -> dict[str, np.ndarray]:
        spec, got = chunk.spec, {}
        for site in self.sites:
            per_layer = [out[("grad", layer, site)] for layer in self.layers]
            if site == "attn_z":
                per_layer = [x.reshape(*x.shape[:-1], spec.n_heads, spec.d_head)
                             for x in per_layer]
            got[f"grad_{site}"] = _stack_layers(per_layer, chunk)
        return got

    def dims(self) -> dict[str, tuple[str, ...]]:
        return {f"grad_{site}": ("prompt", "pos", "layer", *_SITE_DIMS[site])
                for site in self.sites}

    def coords(self, spec: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": np.array(self.layers)}
        if "attn_z" in self.sites:
            out["head"] = np.arange(spec.n_heads)
        return out


_KINDS: dict[str, type[Readout]] = {c.kind: c for c in (Save, Logits, FinalNorm, Lens, DLA,
                                                          Grad)}


def check_readouts(model: Any, readouts: Any) -> list[Readout]:
    """Readout records as a list, layers resolved; clear errors for anything else, for two
    records writing one variable or disagreeing on a shared axis, and for a second `Lens`
    or `DLA` (one trace computes one of each)."""
    if isinstance(readouts, Readout):
        readouts = [readouts]
    if isinstance(readouts, (str, bytes, dict)) or not isinstance(readouts, Iterable):
        raise TypeError("`readouts` must be a list of readout records (Save, Logits, FinalNorm, "
                        f"Lens, DLA, Grad); got {type(readouts).__name__}.")
    out: list[Readout] = []
    for i, r in enumerate(readouts):
        if not isinstance(r, Readout):
            raise TypeError(f"`readouts[{i}]` must be a readout record (Save, Logits, FinalNorm, "
                            f"Lens, DLA, Grad); got {type(r).__name__}. Records saved as JSON "
                            "load with `readouts_from_json`.")
        out.append(r.checked(model))
    if not out:
        raise InputError("`readouts` is empty: name at least one of Save, Logits, FinalNorm, "
                         "Lens, DLA, Grad.")
    seen: dict[str, int] = {}
    for i, r in enumerate(out):
        for name in r.dims():
            if name in seen:
                raise InputError(f"`readouts[{seen[name]}]` and `readouts[{i}]` both write "
                                 f"{name!r}; read it once.")
            seen[name] = i
    for cls in (Lens, DLA, Grad):
        if sum(isinstance(r, cls) for r in out) > 1:
            raise InputError(f"one run computes one `{cls.__name__}`; got several.")
    saves = [r for r in out if isinstance(r, Save)]
    if len({r.points for r in saves}) > 1:
        raise InputError("every `Save` of a run keeps the same `points` (or none).")
    layer_axes = [tuple(c["layer"]) for r in out if "layer" in (c := r.coords(model.spec))]
    if len(set(layer_axes)) > 1:
        raise InputError("the records of one run share the `layer` axis; give every `Save` "
                         "the same `layers` (and a `DLA` reads every layer), or read twice.")
    return out


def merge_requests(requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The `explorer.trace.TraceRequest` fields of one batch: the records' requests combined."""
    fields: dict[str, Any] = {"save": set(), "logits": False, "save_final": ()}
    for req in requests:
        for key, value in req.items():
            if key == "save":
                fields["save"] |= value
            elif key == "logits":
                fields["logits"] = fields["logits"] or value
            elif key == "save_final":
                fields["save_final"] = tuple(dict.fromkeys((*fields["save_final"], *value)))
            else:
                fields[key] = value
    return fields


def readout_from_dict(d: dict[str, Any]) -> Readout:
    """A readout record from its `Readout.to_dict` form (e.g. read back from JSON)."""
    return record_from_dict(d, _KINDS, "readout")


def readouts_to_json(readouts: Iterable[Readout]) -> str:
    return json.dumps([r.to_dict() for r in readouts])


def readouts_from_json(text: str) -> list[Readout]:
    return records_from_json(text, "readout", readout_from_dict)
