"""Tracing: run prompts through the model once, apply edits, bring back readouts.

Edits (`explorer.interventions`) and readouts (`explorer.readouts`) are records. `read`
runs prompts in batches with both and returns an ``xarray.Dataset`` of the readouts'
labelled variables; `trace` (uniform sites), `run_with` (the logits of an edited run) and
`logit_attribution` are assemblers over it. Each batch is one `run_batch`, the one place
that talks to nnsight: it visits sites in forward order (nnsight 0.8 requires it), applies
the edits for each (layer, site) as it passes, and computes and saves only what the
readouts ask for.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import torch
import xarray as xr

from ._checks import (InputError, check_choice, check_int, check_local_weights, check_site,
                      check_token_ids)
from .interventions import (
    Ablate,
    Edit,
    EditContext,
    Patch,
    apply_edits,
    check_prompt_rows,
    edits_to_json,
    first_edit_layer,
    index_key,
    position_index,
)
from .models import SITES, Batch, Model
from .readouts import (
    DLA,
    GRAD_SITES,
    SAVE_SITES,
    Chunk,
    FinalNorm,
    Logits,
    Readout,
    Save,
    check_readouts,
    merge_requests,
    readouts_to_json,
)

__all__ = ["read", "trace", "run_with", "as_batch", "logit_attribution", "run_batch",
           "TraceRequest", "CleanRun", "clean_run", "KeyValuePrefix", "key_value_prefix", "runs_over_prefix",
           "provenance", "check_sites", "check_layers",
           "check_positions", "check_edits", "check_edit_rows", "edits_for_rows",
           "run_on_weights", "at_positions", "real_lengths"]

# Sites inside a layer, in the order the forward pass reaches them.
_LAYER_SITES = ("resid_pre", "attn_q", "attn_k", "attn_v", "attn_z", "attn_pattern",
                "mlp_hidden", "mlp_out", "resid_post")
_QKV_SITES = ("attn_q", "attn_k", "attn_v")


def provenance(model: Model, *, method: str, edits: Sequence[Edit] = (), **params: Any) -> dict:
    """JSON-able attrs: model provenance, method, parameters, edits, versions."""
    spec = model.spec.provenance()
    edits = check_edits(edits)
    return {
        "model": spec["name"],
        "model_spec": {k: v for k, v in spec.items() if k != "versions"},
        "versions": spec["versions"],
        "method": method,
        "params": _jsonable(params),
        "edits": [e.to_dict() for e in edits],
    }


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


def check_sites(sites: Any) -> tuple[str, ...]:
    if isinstance(sites, str):
        sites = (sites,)
    sites = tuple(sites)
    if not sites:
        raise InputError(f"`sites` must name at least one of {', '.join(SITES)}.")
    for s in sites:
        check_site(s, SITES)
    return tuple(dict.fromkeys(sites))


def check_layers(model: Model, layers: Any) -> list[int]:
    if layers is None:
        return list(range(model.n_layers))
    if isinstance(layers, (int, np.integer)):
        layers = [layers]
    layers = [model.check_layer(layer) for layer in layers]
    if not layers:
        raise InputError("`layers` is empty; pass None for every layer.")
    return sorted(set(layers))


def check_positions(positions: Any) -> list[int] | None:
    """Per-prompt positions as a list of ints (one int becomes a list of one), or None."""
    if positions is None:
        return None
    if isinstance(positions, (int, np.integer)):
        positions = [positions]
    if isinstance(positions, (str, bytes)) or not isinstance(positions, Iterable):
        raise TypeError(f"`positions` must be a list of ints; got {type(positions).__name__}.")
    positions = [check_int(f"positions[{i}]", p) for i, p in enumerate(positions)]
    if not positions:
        raise InputError("`positions` is empty; pass None for every token.")
    return positions


def check_edits(edits: Any) -> list[Edit]:
    """Edit records as a list (one record becomes a list of one)."""
    if isinstance(edits, Edit):
        return [edits]
    if isinstance(edits, (str, bytes, dict)) or not isinstance(edits, Iterable):
        raise TypeError("`edits` must be a list of edit records (Ablate, Scale, Patch, Steer); "
                        f"got {type(edits).__name__}.")
    edits = list(edits)
    for i, e in enumerate(edits):
        if not isinstance(e, Edit):
            raise TypeError(f"`edits[{i}]` must be an edit record (Ablate, Scale, Patch, Steer); "
                            f"got {type(e).__name__}. Records saved as dicts or JSON load with "
                            "`edit_from_dict` / `edits_from_json`.")
    return edits


@dataclass
class CleanRun:
    """The unedited residual stream of a batch, kept so edited runs can resume at a layer."""

    batch: Batch
    resid_pre: Sequence[torch.Tensor]   # per layer, [prompt, padded_pos, d_model]
    logits: torch.Tensor                # [prompt, padded_pos, vocab]
    kept: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # site -> per layer

    def repeat(self, k: int, *, logits: bool = False) -> CleanRun:
        """The clean run of this batch repeated ``k`` times, block-wise.

        Row ``j * n + i`` of the result is prompt ``i`` (of ``n``): resume a run of ``k``
        copies of the batch, e.g. with a different edit in each copy (edits' ``prompts``).
        Nothing is copied up front: each layer's residual is tiled when it is read (a
        resumed run reads one layer). The logits are tiled only with ``logits=True`` (k
        copies of [prompt, pos, vocab]); otherwise the result's ``logits`` is empty
        ([0, pos, vocab]), which a resumed run never reads. ``kept`` sites are not repeated.
        """
        k = check_int("k", k, low=1)
        lg = self.logits.repeat(k, 1, 1) if logits else self.logits[:0]
        return CleanRun(_repeat_batch(self.batch, k), _TiledLayers(self.resid_pre, k), lg)


class _TiledLayers(Sequence):
    """Per-layer tensors [n, ...] read as [k * n, ...] (k block-wise copies), tiled on access."""

    def __init__(self, layers: Sequence[torch.Tensor], k: int):
        self._layers, self._k = layers, k

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        x = self._layers[i]
        return x.repeat(self._k, *([1] * (x.dim() - 1)))


def clean_run(model: Model, prompts: Any, *, edits: Sequence[Edit] = (),
              keep: Sequence[str] = ()) -> CleanRun:
    """Run the prompts once as one batch, keeping every layer's resid_pre for resumption.

    ``prompts`` as in `trace`. ``edits`` run the edited model instead (the run that edited
    runs then resume from, e.g. run 1 of the JuICE dual run on a workspace's edits);
    ``keep`` names further layer sites kept at every layer, padded, in ``kept`` (e.g.
    ``("attn_z",)``: [prompt, padded_pos, head*d_head] per layer).
    """
    keep = tuple(keep)
    bad = [s for s in keep if s not in _LAYER_SITES or s == "attn_pattern"]
    if bad:
        raise InputError(f"`keep` names layer sites among "
                         f"{tuple(x for x in _LAYER_SITES if x != 'attn_pattern')}"
                         f"; got {bad[0]!r}.")
    batch, _ = as_batch(model, prompts)
    L = model.n_layers
    out = run_batch(model, batch, edits=edits,
                    save={(layer, s) for layer in range(L) for s in ("resid_pre", *keep)})
    return CleanRun(batch, [out[(layer, "resid_pre")] for layer in range(L)], out["logits"],
                    {s: [out[(layer, s)] for layer in range(L)] for s in keep})


@dataclass(frozen=True, eq=False)
class KeyValuePrefix:
    """Keys and values of every position but the last of a left-padded batch.

    A `run_batch` over it (``prefix=``) computes only the batch's last column, attending
    over these cached keys and values: the result equals the full run wherever nothing
    before the last position changes (edits at position -1 only; no earlier position can
    attend to the last). Build one with `key_value_prefix`; `repeat` reuses it for ``k``
    block-wise copies of the batch.
    """

    batch: Batch        # the full left-padded batch (with ``copies`` copies of the prompts)
    cache: Any          # a transformers Cache over positions [0, width - 1) of the prompts
    copies: int = 1

    def repeat(self, k: int) -> KeyValuePrefix:
        """The prefix of this batch repeated ``k`` times, block-wise (row ``j * n + i`` is
        prompt ``i``): run ``k`` copies, e.g. a different edit in each (edits' ``prompts``).
        The cache is tiled when a run starts, not here."""
        k = check_int("k", k, low=1)
        return KeyValuePrefix(_repeat_batch(self.batch, k), self.cache, self.copies * k)

    def fresh_cache(self) -> Any:
        """A new cache of ``copies`` block-wise copies: a run appends the last token's keys
        and values to the cache it is given, so every run gets its own. Each layer is a
        copy of the prefix's own layer object, so a sliding-window layer (Gemma 2, Mistral)
        keeps its kind and its count of the tokens seen, from which the masks are built."""
        tiled = copy.copy(self.cache)
        tiled.layers = []
        for layer in self.cache.layers:
            twin = copy.copy(layer)
            twin.keys = layer.keys.repeat(self.copies, 1, 1, 1)
            twin.values = layer.values.repeat(self.copies, 1, 1, 1)
            tiled.layers.append(twin)
        return tiled


def key_value_prefix(model: Model, prompts: Any) -> KeyValuePrefix:
    """One unedited run of ``prompts`` (as in `trace`) without their last column, keeping
    every layer's keys and values: the prefix `run_batch` resumes from at the last token.

    The batch is left-padded, so every prompt's last token is in the last column, and its
    explicit position ids make the cached run match the full forward. Local models only
    (the cache would travel with every request of a remote run).
    """
    check_local_weights(model, "a key/value prefix")
    batch, _ = as_batch(model, prompts)
    if batch.width < 2:
        raise InputError("a key/value prefix needs prompts of at least 2 tokens.")
    head = replace(batch, input_ids=batch.input_ids[:, :-1],
                   attention_mask=batch.attention_mask[:, :-1],
                   position_ids=batch.position_ids[:, :-1])
    out = run_batch(model, head, readouts=TraceRequest(logits=False, kv_cache=True))
    return KeyValuePrefix(batch, out["kv_cache"])


def _repeat_batch(b: Batch, k: int) -> Batch:
    """``k`` block-wise copies of ``b``: row ``j * n + i`` is prompt ``i``."""
    return Batch(b.input_ids.repeat(k, 1), b.attention_mask.repeat(k, 1),
                 b.position_ids.repeat(k, 1), list(b.lengths) * k,
                 [list(r) for r in b.token_ids] * k, [list(t) for t in b.tokens] * k)


def _cache_kwarg(model: Model) -> str:
    """The forward's name for the key/value cache: ``cache`` (transformers 5.24) or the
    older ``past_key_values``."""
    params = inspect.signature(model.hf.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _prefix_inputs(model: Model, batch: Batch, prefix: KeyValuePrefix, edits: Sequence[Edit],
                   r: TraceRequest) -> tuple[Batch, dict[str, Any]]:
    """The last column of ``batch`` as the batch a run over ``prefix`` traces, and the
    forward's inputs with a fresh copy of the cache (local models)."""
    check_local_weights(model, "a run over a key/value prefix (remote: `runs_over_prefix`)")
    if prefix.batch.input_ids.shape != batch.input_ids.shape or not torch.equal(
            prefix.batch.input_ids, batch.input_ids):
        raise InputError("`prefix` was computed for different prompts than this run.")
    tail, inputs = _tail_inputs(batch, edits, r)
    inputs[_cache_kwarg(model)] = prefix.fresh_cache()
    return tail, inputs


def _tail_inputs(batch: Batch, edits: Sequence[Edit], r: TraceRequest
                 ) -> tuple[Batch, dict[str, Any]]:
    """The last column of ``batch`` and the forward's inputs for it but the cache (the full
    attention mask); ``edits`` and ``r`` checked to be of the last token only."""
    for e in edits:
        if getattr(e, "positions", None) != (-1,):
            raise InputError("a run over a key/value prefix computes only the last token, so "
                             f"every edit must act at positions=(-1,); got {e!r}.")
    if r.save_points is not None or (r.save_positions is not None
                                     and list(r.save_positions) != [-1]):
        raise InputError("a run over a key/value prefix computes only the last token: read "
                         "it with save_positions=[-1] (or none).")
    n = len(batch.lengths)
    tail = Batch(batch.input_ids[:, -1:], batch.attention_mask[:, -1:],
                 batch.position_ids[:, -1:], [1] * n, [list(t[-1:]) for t in batch.token_ids],
                 [list(t[-1:]) for t in batch.tokens])
    return tail, dict(tail.model_inputs(), attention_mask=batch.attention_mask, use_cache=True)


def runs_over_prefix(model: Model, prompts: Any,
                     runs: Sequence[tuple[int, Sequence[Edit], TraceRequest]]) -> list[dict]:
    """Several runs of the last token of ``prompts`` over one key/value prefix of the rest.

    Each run is ``(k, edits, readouts)``: ``k`` block-wise copies of the prompts (row
    ``j * n + i`` is prompt ``i``) with ``edits`` at position -1, returning what
    `run_batch` returns for ``readouts``. A local model computes `key_value_prefix` once and
    each run with ``run_batch(prefix=...)``. A remote model runs them all in one NDIF
    session: the prefix's trace keeps its cache on the server, each run's trace takes a
    fresh copy of it there, and only the runs' readouts come back.
    """
    batch, _ = as_batch(model, prompts)
    if batch.width < 2:
        raise InputError("a key/value prefix needs prompts of at least 2 tokens.")
    runs = [(check_int("k", k, low=1), check_edits(e), r) for k, e, r in runs]
    if not model.remote:
        prefix = key_value_prefix(model, batch)
        outs = []
        for k, e, r in runs:
            big = prefix.repeat(k)
            outs.append(run_batch(model, big.batch, edits=e, prefix=big, readouts=r))
        return outs
    planned = []
    for k, e, r in runs:
        tail, inputs = _tail_inputs(_repeat_batch(batch, k), e, r)
        planned.append((k, inputs, _plan(model, tail, r, e), _edit_context(model, tail, e)))
    with model.lock, torch.no_grad():
        results = _session_over_prefix(model.nn, batch, planned, _cache_kwarg(model))
    return [{key: (v.value if hasattr(v, "value") and not isinstance(v, torch.Tensor) else v)
             for key, v in result.items()} for result in results]


def _session_over_prefix(nn: Any, batch: Batch, planned: list[tuple], kwarg: str) -> list[dict]:
    """One remote session: the prompts but their last column, keeping the cache on the
    server, then each planned run's trace (`_traced`) over a fresh copy of it."""
    head = {key: value[:, :-1] for key, value in batch.model_inputs().items()}
    with nn.session(remote=True) as session:  # noqa: F841
        with nn.trace(**head, use_cache=True, logits_to_keep=1) as tracer:  # noqa: F841
            cache = _output_cache(nn.output)
        results = []
        for k, inputs, plan, ctx in planned:
            inputs = {**inputs, kwarg: KeyValuePrefix(batch, cache, k).fresh_cache()}
            results.append(_traced(nn, inputs, plan, ctx, None, {}, remote=False))
        results.save()  # the list itself, so that the session sends it back whole
    return results


@contextlib.contextmanager
def _attention(model: Model, implementation: str | None):
    """Switch the attention implementation for one run (eager returns the weights)."""
    current = getattr(model.hf.config, "_attn_implementation", None)
    if implementation is None or implementation == current:
        yield
        return
    model.hf.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.hf.set_attn_implementation(current)


@dataclass(frozen=True, eq=False)
class TraceRequest:
    """The request of one `run_batch`: what its trace computes and brings back besides applying
    its edits, a record like an edit (the readout records' `Readout.request` fields combined).

    Parameters
    ----------
    save : set of (layer, site)
        Layer sites to return, as padded tensors (``attn_z`` as [prompt, pos, head*d_head]).
        ``(layer, "head_out")`` is computed inside the trace: each head's write [prompt, pos,
        head, d_model] through its slice of W_O.
    save_positions : sequence of int, optional
        Keep only these per-prompt positions; tensors become [prompt, n_positions, ...].
    logits : bool, default=True
        Return the output logits.
    save_final : subset of {"final_norm"}
        Non-layer sites to return.
    lens_k, lens_layers : int, sequence of int
        Logit-lens readouts computed inside the trace (for remote runs: only these small
        tensors cross the network): per layer in ``lens_layers`` the top ``lens_k`` tokens
        and log-probabilities, and the rank and log-probability of the output's top
        ``lens_k`` tokens.
    lens_ranked : int, optional
        Rank only the output's top ``lens_ranked`` (<= ``lens_k``) tokens; default all.
    lens_cosine : bool, default=False
        With ``lens_layers``: also ("lens_cos", layer) [prompt, pos], the cosine of
        resid_post at ``layer`` with resid_post at ``layer - 1`` (both in ``lens_layers``).
    save_points : (rows, cols) tensors of int, optional
        Keep saved layer sites only at these (batch row, padded column) points: each
        becomes [points, ...]. Exclusive with ``save_positions``.
    dla_ids : tensor [prompt, t] of token ids, optional
        Direct logit attribution computed inside the trace (see `direct_logit_attribution`):
        the logit of each of the t tokens at each kept position, split into the embedding,
        every head, every attention-output bias, every MLP and the final norm's bias,
        through the final norm linearised at the run's own scale. Only these per-head
        scalars cross the network on a remote run.
    kv_cache : bool, default=False
        Return the run's key/value cache as "kv_cache" (a transformers Cache; local models:
        `key_value_prefix`).
    prob_ids : tensor [prompt] of token ids, optional
        "prob" [prompt]: the probability of prompt i's token ``prob_ids[i]`` at its last
        position (softmax of the float32 logits), computed in the trace, so that only these
        numbers cross the network on a remote run.
    grad, grad_ids : set of (layer, site), tensor [prompt] of token ids
        Gradients: ("grad", layer, site) is the gradient of the sum over
        prompts of the probability of ``grad_ids[i]`` at prompt i's last position with
        respect to that site's value (after the site's edits), as a saved site is kept
        (``attn_z`` as [prompt, pos, head*d_head]). The forward tracks gradients from
        layer 0's input on; the weights get none. A remote run is one NDIF session that
        turns gradient tracking on around its trace.
    """

    save: Any = frozenset()
    save_positions: Sequence[int] | None = None
    logits: bool = True
    save_final: Sequence[str] = ()
    lens_k: int = 0
    lens_layers: Sequence[int] = ()
    lens_ranked: int | None = None
    lens_cosine: bool = False
    save_points: tuple[torch.Tensor, torch.Tensor] | None = None
    dla_ids: torch.Tensor | None = None
    kv_cache: bool = False
    prob_ids: torch.Tensor | None = None
    grad: Any = frozenset()
    grad_ids: torch.Tensor | None = None


class _Layout(NamedTuple):
    """Where a family's queries, keys, values and MLP neurons are, read from its `ArchSpec`
    before the trace (the trace body must not refer to the model: remote)."""

    qkv: tuple[str, ...]          # projection envoys under the layer (q, k, v) or one fused
    qkv_layout: str               # "separate", "blocks" (q|k|v columns), "per_head"
    rotary_call: str | None       # the attention's source call returning (q, k) after rotary
    mlp_down: str                 # the MLP's down projection under the layer
    n_heads: int
    n_kv_heads: int
    d_head: int


def _layout(model: Model) -> _Layout:
    arch, spec = model.arch, model.spec
    attn = arch.attn_path or ""
    qkv = tuple("attn" + p[len(attn):] if attn and p.startswith(attn + ".") else p
                for p in (arch.qkv_paths or ()))
    return _Layout(qkv, arch.qkv_layout, arch.rotary_call, arch.mlp_down_path, spec.n_heads,
                   spec.n_kv_heads, spec.d_head)


class _DlaConstants(NamedTuple):
    """What the attribution reads from the model before the trace (not inside: remote)."""

    centred: bool          # the final norm subtracts the mean (LayerNorm)
    eps: float
    dtype: torch.dtype     # the final norm's weight dtype
    unembed_bias: bool
    o_bias: bool           # attention output projections have a bias


@dataclass
class _Plan:
    """A run's readouts checked against its batch: what the trace body reads, and where.

    Holds no `Model` (the body of a remote trace must not refer to one): only the spec and
    the few values read from the model beforehand.
    """

    spec: Any
    save: Any
    sel: tuple[torch.Tensor, torch.Tensor] | None      # save_positions as (rows, cols)
    points: tuple[torch.Tensor, torch.Tensor] | None
    logits: bool
    logits_last: bool      # only the last position's logits are read: unembed only there
    save_final: Sequence[str]
    lens_k: int
    lens_layers: list[int]
    n_ranked: int
    lens_cosine: bool
    softcap: float | None
    dla_ids: torch.Tensor | None
    dla: _DlaConstants | None
    by_point: dict[tuple[int, str], list[Edit]]
    clone: bool
    n_prompts: int
    o_proj_transposed: bool
    kv_cache: bool = False
    prob_ids: torch.Tensor | None = None
    grad: Any = frozenset()
    grad_ids: torch.Tensor | None = None
    start: int = 0
    layout: _Layout | None = None


def run_batch(model: Model, batch: Batch, *, edits: Sequence[Edit] = (),
              resume: CleanRun | None = None, prefix: KeyValuePrefix | None = None,
              readouts: TraceRequest | None = None, **options: Any) -> dict[Any, torch.Tensor]:
    """One nnsight trace over a padded batch; the only function that drives nnsight.

    ``edits`` apply in place at their (layer, site) as the forward passes. With ``resume``
    (a `CleanRun` of the same batch) the layers before the first edit are skipped and the
    cached clean residual is fed instead. With ``prefix`` (a `KeyValuePrefix` of the same
    batch) only the last column runs, over the cached keys and values of the others: every
    edit must act at ``positions=(-1,)``, and the readouts are of the last token ([prompt,
    1, ...]). What comes back is ``readouts`` (a `TraceRequest`), or the same fields given as
    keywords (``save=...``, ``lens_k=...``).

    Returns
    -------
    dict mapping (layer, site) -> tensor, "final_norm" -> tensor, "logits" -> [prompt, pos, vocab],
    and with ``lens_k``: "lens_final_id" [prompt, pos, k] and ("lens", layer) -> tuple of
    top ids, top log-probs, final-token ranks, final-token log-probs, each [prompt, pos, k];
    with ``dla_ids``: ("dla", part) for the parts of `direct_logit_attribution`; with
    ``kv_cache``: "kv_cache" (a transformers Cache); with ``prob_ids``: "prob" [prompt];
    with ``grad``: ("grad", layer, site) -> tensor, shaped as a saved site.
    """
    if readouts is None:
        readouts = TraceRequest(**options)
    elif options:
        raise TypeError(f"give the readouts as `readouts` or as keywords, not both; got "
                        f"`readouts` and {sorted(options)}.")
    edits = check_edits(edits)
    inputs = batch.model_inputs()
    if prefix is not None:
        if resume is not None:
            raise InputError("give `resume` or `prefix`, not both.")
        batch, inputs = _prefix_inputs(model, batch, prefix, edits, readouts)
    ctx = _edit_context(model, batch, edits)
    plan = _plan(model, batch, readouts, edits)
    if resume is not None and edits and not (plan.lens_layers or plan.grad
                                             or plan.dla_ids is not None):
        plan.start = _resume_layer(batch, resume, edits, plan.save)
    result: dict[Any, Any] = {}
    if plan.start:  # saves before the first edit come from the clean run
        for layer, site in plan.save:
            if layer < plan.start:
                result[(layer, site)] = _at_sel(
                    plan, resume.resid_pre[layer if site == "resid_pre" else layer + 1])
    needs_pattern = any(site == "attn_pattern" for _, site in plan.save)
    grad_mode = torch.enable_grad() if plan.grad else torch.no_grad()
    with model.lock, grad_mode, _attention(model, "eager" if needs_pattern else None):
        if plan.grad and model.remote:
            result = _remote_traced_with_grad(model.nn, inputs, plan, ctx)
        else:
            result = _traced(model.nn, inputs, plan, ctx, resume, result, remote=model.remote)
    return {k: (v.value if hasattr(v, "value") and not isinstance(v, torch.Tensor) else v)
            for k, v in result.items()}


def _edit_context(model: Model, batch: Batch, edits: list[Edit]) -> EditContext:
    """The edits validated against the model and batch, with their position indices and
    patch sources."""
    for e in edits:
        e.validate(model)
    ctx = EditContext(d_head=model.spec.d_head, mask=batch.attention_mask)
    for e in edits:
        key = index_key(e)  # (positions, prompts)
        check_prompt_rows(key[1], len(batch.lengths), f"{type(e).__name__} at layer {e.layer}")
        if key not in ctx.index:
            ctx.index[key] = position_index(batch.lengths, batch.width, *key)
        if isinstance(e, Patch):
            ctx.sources[e] = _patch_source(model, e, batch)  # by value: ids change remotely
    return ctx


def _plan(model: Model, batch: Batch, r: TraceRequest, edits: list[Edit]) -> _Plan:
    """``r`` checked against ``batch`` (clear errors for bad points, ids or lens options)."""
    sel = None
    if r.save_positions is not None:
        sel = position_index(batch.lengths, batch.width, r.save_positions)
    points = _check_points(r.save_points, r.save_positions, batch)
    dla_ids = _check_dla_ids(r.dla_ids, batch, model.vocab_size)
    lens_layers = [int(x) for x in r.lens_layers] if r.lens_k else []
    n_ranked = r.lens_k if r.lens_ranked is None else int(r.lens_ranked)
    if lens_layers and not 1 <= n_ranked <= r.lens_k:
        raise InputError(f"`lens_ranked` must be an int in [1, {r.lens_k}]; got {r.lens_ranked}.")
    if r.lens_cosine and any(x - 1 not in lens_layers for x in lens_layers if x > 0):
        raise InputError("`lens_cosine` needs every lens layer's predecessor in `lens_layers`.")
    if r.kv_cache:
        check_local_weights(model, "a key/value cache readout")
    softcap = None
    if model.arch.logit_softcap_attr:
        softcap = getattr(model.hf.config, model.arch.logit_softcap_attr, None)
    dla = None
    if dla_ids is not None:  # read here: the trace body must not refer to `model` (remote)
        dla = _DlaConstants(*final_norm_kind(model), model.final_norm_module.weight.dtype,
                            model.unembed_module.bias is not None, model.b_O(0) is not None)
    by_point: dict[tuple[int, str], list[Edit]] = {}
    for e in edits:
        by_point.setdefault((e.layer, e.edit_site), []).append(e)
    # the unembedding runs for the last position only (~20% of a forward) when no other
    # position's logits are read; left padding puts every prompt's last token there
    logits_last = bool(r.logits and not lens_layers and sel is not None
                       and list(r.save_positions) == [-1])
    return _Plan(spec=model.spec, save=r.save, sel=sel, points=points, logits=r.logits,
                 logits_last=logits_last, save_final=r.save_final, lens_k=r.lens_k,
                 lens_layers=lens_layers, n_ranked=n_ranked, lens_cosine=r.lens_cosine,
                 softcap=softcap, dla_ids=dla_ids, dla=dla, by_point=by_point,
                 clone=bool(edits), n_prompts=len(batch.lengths),
                 o_proj_transposed=model.arch.o_proj_transposed, kv_cache=r.kv_cache,
                 prob_ids=_token_ids("prob_ids", r.prob_ids, model, batch),
                 grad=frozenset(r.grad), grad_ids=_check_grad(model, batch, r),
                 layout=_layout(model))


def _check_grad(model: Model, batch: Batch, r: TraceRequest) -> torch.Tensor | None:
    """``r.grad_ids`` checked against the batch, with ``r.grad``'s sites and layers."""
    if not r.grad and r.grad_ids is None:
        return None
    if not r.grad or r.grad_ids is None:
        raise InputError("gradients need both `grad` (the sites) and `grad_ids` (the tokens).")
    for layer, site in r.grad:
        check_site(site, GRAD_SITES, "gradient site")
        model.check_layer(layer)
    return _token_ids("grad_ids", r.grad_ids, model, batch)


def _token_ids(name: str, ids: Any, model: Model, batch: Batch) -> torch.Tensor | None:
    """One token id per prompt of ``batch``, inside the vocabulary (None stays None)."""
    if ids is None:
        return None
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.shape != (len(batch.lengths),):
        raise InputError(f"`{name}` must hold one token id per prompt ({len(batch.lengths)}); "
                         f"got shape {tuple(ids.shape)}.")
    check_token_ids(name, ids, model.vocab_size)
    return ids


def _check_points(save_points: Any, save_positions: Any, batch: Batch) -> tuple | None:
    if save_points is None:
        return None
    if save_positions is not None:
        raise InputError("`save_points` and `save_positions` cannot both be given.")
    points = tuple(torch.as_tensor(x, dtype=torch.long) for x in save_points)
    if len(points) != 2 or points[0].shape != points[1].shape or points[0].ndim != 1:
        raise InputError("`save_points` must be two 1-d tensors (rows, cols) of one length.")
    if points[0].numel() and not (0 <= int(points[0].min()) and
                                  int(points[0].max()) < len(batch.lengths) and
                                  0 <= int(points[1].min()) and
                                  int(points[1].max()) < batch.width):
        raise InputError(f"`save_points` must lie in [0, {len(batch.lengths)}) x "
                         f"[0, {batch.width}).")
    return points


def _check_dla_ids(dla_ids: Any, batch: Batch, vocab_size: int) -> torch.Tensor | None:
    if dla_ids is None:
        return None
    dla_ids = torch.as_tensor(dla_ids, dtype=torch.long)
    if dla_ids.ndim != 2 or dla_ids.shape[0] != len(batch.lengths):
        raise InputError(f"`dla_ids` must be [prompt, tokens] with {len(batch.lengths)} "
                         f"rows; got shape {tuple(dla_ids.shape)}.")
    if dla_ids.numel() and not (0 <= int(dla_ids.min()) and int(dla_ids.max()) < vocab_size):
        raise InputError(f"`dla_ids` must be token ids in [0, {vocab_size}).")
    return dla_ids


def _resume_layer(batch: Batch, resume: CleanRun, edits: list[Edit], save: Any) -> int:
    """The layer an edited run resumes at: the first edit's, or 0 where a site saved before
    it is not in the clean run (only resid_pre / resid_post are)."""
    if resume.batch.input_ids.shape != batch.input_ids.shape or not torch.equal(
            resume.batch.input_ids, batch.input_ids):
        raise InputError("`resume` was computed for different prompts than this run.")
    start = first_edit_layer(edits)
    early = [(layer, site) for layer, site in save if layer < start]
    if any(site not in ("resid_pre", "resid_post") for _, site in early):
        return 0
    return start


def _at_sel(plan: _Plan, x: Any) -> Any:
    """``x`` [prompt, padded_pos, ...] at the kept positions: [prompt, n_positions, ...]."""
    if plan.sel is None:
        return x
    return x[plan.sel[0], plan.sel[1]].reshape(plan.n_prompts, -1, *x.shape[2:])


def _traced(nn: Any, inputs: dict[str, Any], plan: _Plan, ctx: EditContext,
            resume: CleanRun | None, result: dict[Any, Any], *, remote: bool) -> dict[Any, Any]:
    """The trace itself (the forward's ``inputs``): edits and readouts layer by layer, then
    the outputs, the gradients, the lens and the attribution. ``result`` is saved whole, so
    a remote run sends it back as one dict."""
    last_only = {}
    if plan.logits_last or not (plan.logits or plan.lens_layers):
        last_only = {"logits_to_keep": 1}
    if plan.kv_cache:
        last_only["use_cache"] = True
    lens_resid: dict[int, Any] = {}
    dla_parts: dict[Any, Any] = {}
    live: dict[tuple[int, str], Any] = {}  # the values whose gradients are read
    with nn.trace(**inputs, **last_only, remote=remote) as tracer:  # noqa: F841
        if plan.start:
            # a copy: an edit at resid_pre[start] works in place and must not touch the cache
            replacement = resume.resid_pre[plan.start].clone()
            for layer in range(plan.start):
                nn.layers[layer].skip(replacement)
        for layer in range(plan.start, plan.spec.n_layers):
            _layer_readouts(nn.layers[layer], layer, plan, ctx, result, lens_resid,
                            dla_parts, live)
        _output_readouts(nn, plan, result)
        if plan.grad:
            _grad_readouts(nn, plan, result, live)
        if plan.lens_layers:
            _lens_readouts(nn, plan, result, lens_resid)
        if plan.dla_ids is not None:
            _dla_readouts(nn, plan, result, dla_parts)
        result.save()  # the dict itself, so that a remote (NDIF) run sends it back whole
    return result


def _remote_traced_with_grad(nn: Any, inputs: dict[str, Any], plan: _Plan,
                             ctx: EditContext) -> dict[Any, Any]:
    """A remote run with gradient readouts: one NDIF session whose body turns gradient
    tracking on around the trace (the server runs a request's own forward without it)."""
    with nn.session(remote=True) as session:  # noqa: F841
        with torch.enable_grad():
            result = _traced(nn, inputs, plan, ctx, None, {}, remote=False)
        result.save()  # the dict itself, so that the session sends it back whole
    return result


def _keep(plan: _Plan, result: dict[Any, Any], key: tuple[int, str], value: Any) -> None:
    """Save one layer site's value at the kept positions or points (a copy if edits follow)."""
    value = value.detach()
    if key[1] != "attn_pattern" and (plan.points is not None or plan.sel is not None):
        value = _kept(plan, value)
    elif plan.clone:
        value = value.clone()
    result[key] = value.save() if hasattr(value, "save") else value


def _kept(plan: _Plan, x: Any) -> Any:
    """``x`` [prompt, padded_pos, ...] at the kept points ([points, ...]) or positions."""
    if plan.points is not None:
        return x[plan.points[0], plan.points[1]]
    return _at_sel(plan, x)


def _site_value(block: Any, site: str, layout: _Layout) -> Any:
    """The envoy value of ``site`` in one layer's block (read only when needed: in order)."""
    if site == "resid_pre":
        return block.input
    if site == "attn_z":
        return block.attn.o_proj.input
    if site == "attn_pattern":
        return block.attn.output[1]
    if site == "mlp_hidden":
        return _envoy(block, layout.mlp_down).input
    if site == "mlp_out":
        return block.mlp.output
    return block.output


def _envoy(block: Any, path: str) -> Any:
    for part in path.split("."):
        block = getattr(block, part)
    return block


def _rotary_op(block: Any, layer: int, plan: _Plan) -> Any:
    """The attention's rotary call as an nnsight source operation, where this layer reads
    or edits queries or keys after rotary (None otherwise). Taken before the layer runs:
    the forward is instrumented when the source is first asked for."""
    if plan.layout.rotary_call is None or not any(
            (layer, s) in plan.save or plan.by_point.get((layer, s))
            for s in ("attn_q", "attn_k")):
        return None
    return getattr(block.attn.source, plan.layout.rotary_call)


def _qkv_values(block: Any, sites: Sequence[str], layout: _Layout,
                rotary: Any) -> dict[str, Any]:
    """The asked-for of ``attn_q``/``attn_k``/``attn_v`` in one layer as 4-d [prompt, pos,
    head, d_head] tensors that share memory with the forward's own (views, so an in-place
    write edits the run), read in forward order: the projections, then the rotary call."""
    out: dict[str, Any] = {}
    n, kv, dh = layout.n_heads, layout.n_kv_heads, layout.d_head
    from_proj = [s for s in sites if s == "attn_v" or layout.rotary_call is None]
    if from_proj:
        if layout.qkv_layout == "separate":
            for s in from_proj:
                x = _envoy(block, layout.qkv[_QKV_SITES.index(s)]).output
                out[s] = x.view(*x.shape[:2], n if s == "attn_q" else kv, dh)
        else:
            x = _envoy(block, layout.qkv[0]).output
            b, p = x.shape[:2]
            if layout.qkv_layout == "blocks":            # [q | k | v] columns (GPT-2)
                x = x.view(b, p, 3, n, dh)
                for s in from_proj:
                    out[s] = x[:, :, _QKV_SITES.index(s)]
            else:                                          # per head [q k v] (GPT-NeoX)
                x = x.view(b, p, n, 3, dh)
                for s in from_proj:
                    out[s] = x[:, :, :, _QKV_SITES.index(s)]
    rotated = [s for s in sites if s in ("attn_q", "attn_k") and s not in out]
    if rotated:
        q, k = rotary.output                               # [prompt, head, pos, d_head]
        for s in rotated:
            out[s] = (q if s == "attn_q" else k).transpose(1, 2)
    return out


def _qkv_readouts(block: Any, layer: int, plan: _Plan, ctx: EditContext,
                  result: dict[Any, Any], rotary: Any) -> None:
    """One layer's queries, keys and values: apply their edits, keep what is asked for.
    Each is edited as [prompt, pos, head*d_head] and written back where that is a copy."""
    needed = [s for s in _QKV_SITES
              if (layer, s) in plan.save or plan.by_point.get((layer, s))]
    if not needed:
        return
    for site, x4 in _qkv_values(block, needed, plan.layout, rotary).items():
        flat = x4.reshape(*x4.shape[:2], -1)
        edits = plan.by_point.get((layer, site), ())
        if edits:
            apply_edits(flat, edits, ctx)
            if flat.untyped_storage().data_ptr() != x4.untyped_storage().data_ptr():
                x4.copy_(flat.view(x4.shape))     # a copy (non-contiguous heads): write back
        if (layer, site) in plan.save:
            _keep(plan, result, (layer, site), flat)


def _layer_readouts(block: Any, layer: int, plan: _Plan, ctx: EditContext,
                    result: dict[Any, Any], lens_resid: dict[int, Any],
                    dla_parts: dict[Any, Any], live: dict[tuple[int, str], Any]) -> None:
    """One layer's sites in forward order: apply its edits, keep what the readouts ask for
    (``live``: the values whose gradients are read after the forward)."""
    spec = plan.spec
    rotary = _rotary_op(block, layer, plan)
    for site in _LAYER_SITES:
        if site in _QKV_SITES:  # read together, once per layer (one projection may hold all)
            if site == "attn_q":
                _qkv_readouts(block, layer, plan, ctx, result, rotary)
            continue
        point = (layer, site)
        track = bool(plan.grad) and point == (0, "resid_pre")  # where gradients start
        wanted = point in plan.save
        to_apply = plan.by_point.get(point, ())
        head_out = site == "attn_z" and (layer, "head_out") in plan.save
        lens_here = site == "resid_post" and layer in plan.lens_layers
        dla_here = plan.dla_ids is not None and (
            site in ("attn_z", "mlp_out") or (site, layer) in (
                ("resid_pre", 0), ("resid_post", spec.n_layers - 1)))
        if not (wanted or to_apply or head_out or lens_here or dla_here or track
                or point in plan.grad):
            continue
        value = _site_value(block, site, plan.layout)
        if track:  # a copy that tracks gradients, edited in place below like the input
            value = value.detach().requires_grad_(True).clone()
            block.input = value
        if point in plan.grad:
            live[point] = value
        if to_apply:
            apply_edits(value, to_apply, ctx)
        if wanted:
            _keep(plan, result, point, value)
        if head_out:
            w = block.attn.o_proj.weight  # Linear [d_model, head*d_head]; Conv1D .T
            w = w if plan.o_proj_transposed else w.T
            w = w.reshape(spec.n_heads, spec.d_head, spec.d_model)
            z = value.reshape(*value.shape[:2], spec.n_heads, spec.d_head)
            _keep(plan, result, (layer, "head_out"), torch.einsum("pshd,hdm->pshm", z, w))
        if lens_here:
            lens_resid[layer] = value.clone() if plan.clone else value
        if dla_here:
            x = _at_sel(plan, value).detach()
            dla_parts[(layer, site)] = x.clone() if plan.clone and plan.sel is None else x
            if site == "attn_z":
                w = block.attn.o_proj.weight
                dla_parts[(layer, "W_O")] = w if plan.o_proj_transposed else w.T
                if plan.dla.o_bias:
                    dla_parts[(layer, "b_O")] = block.attn.o_proj.bias


def _output_readouts(nn: Any, plan: _Plan, result: dict[Any, Any]) -> None:
    """The final norm's output, the key/value cache, the tokens' probabilities and the
    logits ([prompt, 1, vocab] when ``plan.logits_last``)."""
    if "final_norm" in plan.save_final:
        result["final_norm"] = _at_sel(plan, nn.final_norm.output.detach()).save()
    if plan.kv_cache:
        result["kv_cache"] = _output_cache(nn.output)
    if plan.prob_ids is not None:
        result["prob"] = _last_token_prob(nn.output.logits.detach(), plan.prob_ids).save()
    if plan.logits:
        lg = nn.output.logits.detach()
        if not plan.logits_last:
            lg = _at_sel(plan, lg)
        result["logits"] = lg.save()


def _output_cache(out: Any) -> Any:
    """The key/value cache of a forward's output: ``cache`` (transformers 5.24) or the
    older ``past_key_values``."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def _last_token_prob(logits: Any, ids: torch.Tensor) -> Any:
    """Each row's probability of its token ``ids[row]`` at the last position (float32
    softmax): [row], from logits [row, pos, vocab]."""
    last = logits[:, -1].float()
    rows = torch.arange(last.shape[0], device=last.device)
    return torch.softmax(last, -1)[rows, ids.to(last.device)]


def _grad_readouts(nn: Any, plan: _Plan, result: dict[Any, Any],
                   live: dict[tuple[int, str], Any]) -> None:
    """The gradients of the summed ``grad_ids`` probabilities at the last position, read in
    reverse forward order as the backward pass reaches each value."""
    p = _last_token_prob(nn.output.logits, plan.grad_ids).sum()
    with p.backward():
        for layer, site in sorted(live, key=lambda k: (k[0], _LAYER_SITES.index(k[1])),
                                  reverse=True):
            result[("grad", layer, site)] = _kept(plan, live[(layer, site)].grad).save()


def _lens_readouts(nn: Any, plan: _Plan, result: dict[Any, Any],
                   lens_resid: dict[int, Any]) -> None:
    """Per lens layer: top tokens and log-probs, and the output's top tokens' ranks there."""
    final_id = _at_sel(plan, nn.output.logits.detach()).float().topk(
        plan.lens_k, dim=-1).indices                                 # [prompt, pos, k]
    result["lens_final_id"] = final_id
    ranked = final_id[..., :plan.n_ranked]                            # [prompt, pos, r]
    for layer in plan.lens_layers:
        x = _at_sel(plan, lens_resid[layer])
        if plan.lens_cosine and layer > 0:
            y = _at_sel(plan, lens_resid[layer - 1])
            result[("lens_cos", layer)] = torch.nn.functional.cosine_similarity(
                x.float(), y.float(), dim=-1)                        # [prompt, pos]
        lg = nn.unembed(nn.final_norm(x)).float()                    # [prompt, pos, vocab]
        if plan.softcap:
            lg = torch.tanh(lg / plan.softcap) * plan.softcap
        lse = lg.logsumexp(-1, keepdim=True)
        top = lg.topk(plan.lens_k, dim=-1)
        target = lg.gather(-1, ranked)                                # [prompt, pos, r]
        rank = torch.stack([(lg > target[..., j:j + 1]).sum(-1)
                            for j in range(plan.n_ranked)], -1)
        result[("lens", layer)] = (top.indices, top.values - lse, rank, target - lse)


def _dla_readouts(nn: Any, plan: _Plan, result: dict[Any, Any],
                  dla_parts: dict[Any, Any]) -> None:
    """Direct logit attribution of ``plan.dla_ids`` from the parts kept layer by layer."""
    spec = plan.spec
    probe = torch.ones(2, spec.d_model)
    probe[:, 1::2] = -1.0
    probe[1] *= -1.0
    normed = nn.final_norm(probe.to(plan.dla.dtype)).detach()
    unembed = (nn.unembed.weight, nn.unembed.bias if plan.dla.unembed_bias else None)
    for part, value in direct_logit_attribution(
            dla_parts, normed, unembed, plan.dla_ids, n_layers=spec.n_layers,
            n_heads=spec.n_heads, eps=plan.dla.eps, centred=plan.dla.centred).items():
        result[("dla", part)] = value


def run_on_weights(model: Model, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(weights, *args, **kwargs)`` run where the model's weights are; its result.

    For a local model ``weights`` is ``model`` itself. For a remote one, ``fn`` runs on the
    NDIF server inside one nnsight trace, on a `Model` over the server's module tree (the
    trace's envoys: same structure, the served weights), and only its return value comes
    back. This is how computations that need the weights outside a plain forward (the
    circuits' per-head forward and backward, LoRA training steps, a function
    vector's W_O slices) run on NDIF: ``fn`` and everything it calls are explorer code,
    which travels with the request by value.

    The trace's own forward pass is one token, run after ``fn``. ``fn`` must call modules
    through the weights model's tree (``weights.hf_layer(0).mlp(x)``, `Model.lens_logits`):
    those are nnsight ad-hoc calls, which stand the trace down for their duration, so they
    are ordinary calls and not steps of the traced forward. It reads weights as attributes
    (``.weight``) and the device as ``weights.hf.device``; a sandboxed server may refuse other
    envoy attributes. Torch hooks it registers on the served modules must be removed before
    it returns (in a ``finally``): the model is shared by every request. ``fn`` must return
    tensors, numbers, strings or lists, tuples and dicts of them; tensors come back on the
    CPU.
    """
    if not model.remote:
        return fn(model, *args, **kwargs)
    nn = model.nn
    spec, arch = model.spec, model.arch  # the trace body must not refer to `model` (remote)
    vehicle = torch.zeros(1, 1, dtype=torch.long)
    with model.lock, nn.trace(input_ids=vehicle, remote=True) as tracer:  # noqa: F841
        result = _call_on_weights(nn, spec, arch, fn, args, kwargs)
        result.save()  # the dict itself, so that a remote (NDIF) run sends it back whole
    return result["value"]


def _call_on_weights(nn: Any, spec: Any, arch: Any, fn: Callable[..., Any], args: tuple,
                     kwargs: dict) -> dict[str, Any]:
    """Inside a trace (on the server): ``fn`` on a Model over the envoy tree."""
    weights = Model(None, nn, None, spec, arch)
    with torch.inference_mode(False):
        return {"value": _to_cpu(fn(weights, *args, **kwargs))}


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def final_norm_kind(model: Model) -> tuple[bool, float]:
    """(centred, eps) of the final norm: LayerNorm subtracts the mean, RMSNorm does not."""
    fn = model.final_norm_module
    centred = isinstance(fn, torch.nn.LayerNorm) or type(fn).__name__ == "LayerNorm"
    eps = getattr(fn, "eps", None)
    if eps is None:
        eps = getattr(fn, "variance_epsilon", 1e-6)
    return centred, float(eps)


def direct_logit_attribution(parts: dict[Any, torch.Tensor], normed_probe: torch.Tensor,
                             unembed: tuple[torch.Tensor, torch.Tensor | None],
                             ids: torch.Tensor, *, n_layers: int, n_heads: int, eps: float,
                             centred: bool) -> dict[str, torch.Tensor]:
    """Split the logits of tokens ``ids`` [prompt, t] into the residual stream's writers.

    The final residual x is the embedding plus every head's write (z through its slice
    of W_O), every attention-output bias and every MLP output. The final norm is
    linearised at the run's own scale, normed(c) = gain * centre(c) * scale(x) (+ its
    bias once), so each writer's term is r . centre(c) with r = W_U[token] * gain * scale,
    and the terms add up to the token's logit (before any soft cap). Runs inside the
    trace (`run_batch`'s ``dla_ids``), so only these scalars leave a remote run.

    ``parts`` holds the trace's tensors at the kept positions: (0, "resid_pre"),
    (L-1, "resid_post"), (layer, "attn_z"), (layer, "mlp_out"), (layer, "W_O") as
    [head*d_head, d_model], optionally (layer, "b_O"). ``normed_probe`` is the final norm
    applied to a zero-mean +-1 vector and its negation [2, d_model]; ``unembed`` the
    unembedding's weight [vocab, d_model] and bias (or None). All in float64.

    Returns ``embed`` [prompt, pos, t], ``head`` [prompt, pos, layer, head, t],
    ``attn_bias`` and ``mlp`` [prompt, pos, layer, t], ``norm_bias`` [prompt, pos, t]
    (the norm's and the unembedding's biases).
    """
    w_unembed, b_unembed = unembed
    probe = torch.ones(normed_probe.shape[-1], dtype=torch.float64)
    probe[1::2] = -1.0
    y = normed_probe.double()
    gain = (y[0] - y[1]) / 2 * probe * (1.0 + eps) ** 0.5     # [d_model]
    nbias = (y[0] + y[1]) / 2                                   # LayerNorm's bias; RMSNorm: 0
    x = parts[(n_layers - 1, "resid_post")].double()            # [p, s, d]
    if centred:
        x = x - x.mean(-1, keepdim=True)
    scale = 1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)       # [p, s, 1]
    u = w_unembed[ids].double()                                 # [p, t, d]
    r = u[:, None] * (gain * scale)[:, :, None, :]              # [p, s, t, d]

    def read(c: torch.Tensor) -> torch.Tensor:
        c = c.double()
        if centred:
            c = c - c.mean(-1, keepdim=True)
        return torch.einsum("pstm,ps...m->ps...t", r, c)

    heads, biases, mlps = [], [], []
    for layer in range(n_layers):
        z = parts[(layer, "attn_z")].double()
        z = z.reshape(*z.shape[:2], n_heads, -1)                # [p, s, h, d_head]
        w_o = parts[(layer, "W_O")].double().reshape(n_heads, z.shape[-1], -1)
        heads.append(read(torch.einsum("pshd,hdm->pshm", z, w_o)))
        b = parts.get((layer, "b_O"))
        biases.append(read(b.double().expand_as(x)) if b is not None
                      else torch.zeros(x.shape[:2] + ids.shape[-1:], dtype=torch.float64))
        mlps.append(read(parts[(layer, "mlp_out")]))
    norm_bias = torch.einsum("ptm,m->pt", u, nbias)
    if b_unembed is not None:
        norm_bias = norm_bias + b_unembed[ids].double()
    return {"embed": read(parts[(0, "resid_pre")]), "head": torch.stack(heads, 2),
            "attn_bias": torch.stack(biases, 2), "mlp": torch.stack(mlps, 2),
            "norm_bias": norm_bias[:, None].expand(x.shape[:2] + ids.shape[-1:])}


def _patch_source(model: Model, e: Patch, batch: Batch) -> torch.Tensor:
    """Activation of the patch source at the edit's site, lined up with the run's positions."""
    src_batch = (model.tokenize([e.source]) if isinstance(e.source, str)
                 else model.batch_from_ids([list(e.source)]))
    n_src = src_batch.lengths[0]
    lengths = batch.lengths if e.prompts is None else [batch.lengths[i] for i in e.prompts]
    if e.positions is None:
        bad = [n for n in lengths if n != n_src]
        if bad:
            raise InputError(
                f"patch source has {n_src} tokens but a prompt has {bad[0]}; pass `positions` "
                "to patch prompts of different lengths.")
    out = run_batch(model, src_batch, save={(e.layer, e.edit_site)}, logits=False)
    src = out[(e.layer, e.edit_site)][0]  # [n_src, d]
    rows = []
    for n in lengths:
        positions = range(n) if e.positions is None else e.positions
        for p in positions:
            q = p + n_src if p < 0 else p
            if not 0 <= q < n_src:
                raise InputError(f"patch position {p} is out of range for the source with "
                                 f"{n_src} tokens.")
            rows.append(src[q])
    return torch.stack(rows)


# -- public API ------------------------------------------------------------------------

def _batches(n: int, batch_size: int) -> list[range]:
    return [range(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def progress_steps(total: int, progress: Any, *, unit: str = "prompt",
                   desc: str | None = None) -> Callable[[int], None]:
    """A step callback: tqdm in a terminal when progress is True, or the user's callback."""
    if callable(progress):
        done = [0]

        def step(k):
            done[0] += k
            progress(done[0], total)
        return step
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit=unit, leave=False, desc=desc)

        def step(k):
            bar.update(k)
            if bar.n >= total:
                bar.close()
        return step
    return lambda k: None


def as_batch(model: Model, prompts: Any) -> tuple[Batch, list[str] | None]:
    """The batch `trace` and `run_with` run, from text (a string or a list of strings),
    token id lists (each non-empty, at most the context length) or a `Batch`; with the
    prompt texts when given as text (None otherwise)."""
    if isinstance(prompts, Batch):
        return prompts, None
    if (isinstance(prompts, Sequence) and not isinstance(prompts, str) and prompts
            and not isinstance(prompts[0], str)):
        ids = []
        for i, row in enumerate(prompts):
            if isinstance(row, str) or not isinstance(row, Sequence | np.ndarray | torch.Tensor):
                raise TypeError(f"`prompts[{i}]` must be a token id list like the others; got "
                                f"{type(row).__name__}.")
            row = [int(t) for t in row]
            if not row:
                raise InputError(f"`prompts[{i}]` holds no tokens.")
            if len(row) > model.spec.context_length:
                raise InputError(f"`prompts[{i}]` is {len(row)} tokens; {model.spec.name} takes "
                                 f"at most {model.spec.context_length}.")
            if min(row) < 0 or max(row) >= model.vocab_size:
                raise InputError(f"`prompts[{i}]` holds a token id outside [0, "
                                 f"{model.vocab_size}).")
            ids.append(row)
        return model.batch_from_ids(ids), None
    batch = model.tokenize(prompts)
    return batch, [prompts] if isinstance(prompts, str) else list(prompts)


def read(model: Model, prompts: Any, readouts: Any, *, edits: Sequence[Edit] = (),
         positions: Sequence[int] | None = None, batch_size: int = 8, progress: Any = None,
         resume: CleanRun | None = None) -> xr.Dataset:
    """Run prompts under ``edits`` and return what the ``readouts`` records ask for.

    The one function that runs batches with edits and readouts: each batch is one nnsight
    trace (`run_batch`) that applies the edits as the forward passes and computes every
    record's values inside it, so a remote run sends the same records and only their
    values come back. `trace`, `run_with` and `logit_attribution` are assemblers over it.

    Parameters
    ----------
    model : Model
    prompts : str, list of str, list of token id lists, or a `Batch`
    readouts : sequence of `explorer.readouts.Readout`
        `Save`, `Logits`, `FinalNorm`, `Lens`, `DLA`, `Grad` records (see
        `explorer.readouts`).
    edits : sequence of Edit
        Interventions applied during the run; a value-less mean `Ablate` averages over
        every prompt whatever the batch size.
    positions : sequence of int, optional
        Per-prompt positions to keep (negative from the end); default every token.
    batch_size : int, default=8
    progress : bool or callable(done, total), optional
        tqdm bar (True), a callback, or nothing; default: a bar when there is more than one
        batch.
    resume : CleanRun, optional
        The clean run of the same prompts (one batch): layers before the first edit are not
        re-run.

    Returns
    -------
    xarray.Dataset
        The records' variables over (prompt, pos, ...), NaN (or -1 for ids and ranks) past a
        prompt's end; ``mask`` (prompt, pos) True on real tokens; coords ``token_id`` and
        ``token``; attrs: provenance, the edits and the readouts as JSON.
    """
    records = check_readouts(model, readouts)
    check_int("batch_size", batch_size, low=1)
    positions = check_positions(positions)
    edits = check_edits(edits)
    batch_all, texts = as_batch(model, prompts)  # validates every prompt before any work
    n_total = len(batch_all.lengths)
    if positions is not None:
        position_index(batch_all.lengths, batch_all.width, positions)  # range check up front
    check_edit_rows(edits, n_total)
    for r in records:
        r.check_run(n_total, positions)
    chunks = _batches(n_total, batch_size)
    if resume is not None and len(chunks) > 1:
        raise InputError(f"`resume` holds one batch; pass batch_size >= {n_total} with it.")
    step = progress_steps(n_total, len(chunks) > 1 if progress is None else progress)
    run_edits = edits
    if len(chunks) > 1:  # a mean ablation averages over every prompt, whatever the batch size
        run_edits = resolve_mean_ablations(model, batch_all.token_ids, edits, batch_size)
    n_pos = len(positions) if positions is not None else max(batch_all.lengths)
    parts: list[dict[str, list[np.ndarray]]] = [{} for _ in records]
    for rows in chunks:
        one = len(chunks) == 1
        batch = batch_all if one else model.batch_from_ids(
            [batch_all.token_ids[i] for i in rows])
        chunk = Chunk(model.spec, batch, rows, positions, n_pos, max(batch_all.lengths))
        fields = merge_requests([r.request(chunk) for r in records])
        out = run_batch(model, batch, edits=run_edits if one else edits_for_rows(run_edits, rows),
                        resume=resume, readouts=TraceRequest(save_positions=positions, **fields))
        for r, acc in zip(records, parts):
            for name, a in r.arrays(out, chunk).items():
                acc.setdefault(name, []).append(a)
        step(len(rows))
    return _read_dataset(model, batch_all, texts, records, parts, positions, edits)


def _read_dataset(model: Model, batch_all: Batch, texts: list[str] | None,
                  records: list[Readout], parts: list[dict[str, list[np.ndarray]]],
                  positions: list[int] | None, edits: list[Edit]) -> xr.Dataset:
    """`read`'s Dataset: the records' variables, token coords, mask and provenance."""
    n_pos = len(positions) if positions is not None else max(batch_all.lengths)
    tc = token_coords(model, batch_all, positions, n_pos)
    data: dict[str, Any] = {"mask": (("prompt", "pos"), tc.pop("mask"))}
    coords: dict[str, Any] = {
        "prompt": np.arange(len(batch_all.lengths)),
        "pos": np.array(positions) if positions is not None else np.arange(n_pos), **tc}
    for r, acc in zip(records, parts):
        dims = r.dims()
        data.update({name: (dims[name], a) for name, a in r.finish(acc).items()})
        coords.update(r.coords(model.spec))
        if isinstance(r, Save) and r.site == "attn_pattern":
            coords["dst_pos"] = coords["pos"]
            coords["src_pos"] = np.arange(max(batch_all.lengths))
    attrs = provenance(model, method="read", edits=edits, positions=positions, prompts=texts)
    attrs["edits_json"] = edits_to_json(edits)
    attrs["readouts_json"] = readouts_to_json(records)
    return xr.Dataset(data, coords=coords, attrs=attrs)


def trace(model: Model, prompts: Any, *, sites: Any = ("resid_post",), layers: Any = None,
          positions: Sequence[int] | None = None, edits: Sequence[Edit] = (),
          batch_size: int = 8, progress: Any = None) -> xr.Dataset:
    """Read uniform sites for every prompt; one nnsight trace per batch (`read` with a
    `Save` per layer site, `FinalNorm` and `Logits` for ``final_norm`` / ``unembed``).

    Parameters
    ----------
    model : Model
    prompts : str, list of str, list of token id lists, or a `Batch`
    sites : str or sequence of {"resid_pre", "resid_post", "attn_q", "attn_k", "attn_v",
        "attn_z", "head_out", "attn_pattern", "mlp_hidden", "mlp_out", "final_norm",
        "unembed"}, default=("resid_post",)
    layers : int or sequence of int, optional
        Layers to read (default all).
    positions : sequence of int, optional
        Per-prompt positions to keep (negative from the end); default all tokens.
    edits : sequence of Edit
        Interventions applied during the run.
    batch_size : int, default=8
    progress : bool or callable(done, total), optional
        tqdm bar (True), a callback, or nothing; default: a bar when there is more than one batch.

    Returns
    -------
    xarray.Dataset
        One variable per site: ``resid_pre``/``resid_post``/``mlp_out`` (prompt, pos, layer,
        d_model); ``attn_z`` and ``attn_q`` (prompt, pos, layer, head, d_head); ``attn_k``,
        ``attn_v`` (prompt, pos, layer, kv_head, d_head); ``mlp_hidden`` (prompt, pos,
        layer, neuron); ``head_out`` (prompt, pos,
        layer, head, d_model); ``attn_pattern`` (prompt, layer, head, dst_pos, src_pos),
        with ``dst_pos`` the kept positions and ``src_pos`` every token;
        ``final_norm`` (prompt, pos, d_model); ``unembed`` (prompt, pos, vocab). ``mask``
        (prompt, pos) is True on real tokens; padding is NaN. Coords ``token_id`` and
        ``token`` carry the tokens.
    """
    sites = check_sites(sites)
    layers = check_layers(model, layers)
    records: list[Readout] = [Save(s, tuple(layers)) for s in sites if s in SAVE_SITES]
    if "final_norm" in sites:
        records.append(FinalNorm())
    if "unembed" in sites:
        records.append(Logits())
    ds = read(model, prompts, records, edits=edits, positions=positions,
              batch_size=batch_size, progress=progress)
    ds = ds.rename({"logits": "unembed"}) if "unembed" in sites else ds
    ds = ds[[*sites, "mask"]].assign_coords(layer=np.array(layers))
    ds.attrs = provenance(model, method="trace", edits=edits, sites=list(sites), layers=layers,
                          positions=check_positions(positions),
                          prompts=ds.attrs["params"]["prompts"])
    return ds


def check_edit_rows(edits: Sequence[Edit], n_prompts: int) -> None:
    """Raise InputError if a row-targeted edit (``prompts``) names a row past ``n_prompts``
    (the whole prompt list, before it is split into batches)."""
    for e in edits:
        check_prompt_rows(getattr(e, "prompts", None), n_prompts,
                          f"{type(e).__name__} at layer {e.layer}")


def edits_for_rows(edits: Sequence[Edit], rows: range) -> list[Edit]:
    """The edits for prompts ``rows`` of a longer list, run as one batch.

    Row-targeted edits (``prompts``) are renumbered to the batch's rows, and left out
    where they target none of them; the others apply as they are.
    """
    out = []
    for e in edits:
        targets = getattr(e, "prompts", None)
        if targets is None:
            out.append(e)
        elif local := tuple(i - rows.start for i in targets if i in rows):
            out.append(replace(e, prompts=local))
    return out


def _edit_order(e: Edit) -> tuple[int, int]:
    """Where in the forward pass an edit acts: (layer, index of its site in the layer)."""
    return e.layer, _LAYER_SITES.index(e.edit_site)


def resolve_mean_ablations(model: Model, token_ids: list[list[int]], edits: Sequence[Edit],
                           batch_size: int) -> list[Edit]:
    """Give every value-less mean `Ablate` the head's mean over all prompts' real tokens.

    Run as one batch, a mean ablation averages over the batch's real tokens; split into
    batches it would average per batch. This pass computes the mean over every prompt (over
    the edit's ``prompts`` when it has them), with the edits that act before it applied, and
    returns the edits with the mean filled in.
    """
    resolved = check_edits(edits)
    d_head = model.spec.d_head
    # in forward order, so a mean taken after an earlier mean ablation sees it resolved
    for j in sorted(range(len(resolved)), key=lambda i: (_edit_order(resolved[i]), i)):
        e = resolved[j]
        if not (isinstance(e, Ablate) and e.mode == "mean" and e.value is None):
            continue
        e.validate(model)
        order = (_edit_order(e), j)
        before = [x for i, x in enumerate(resolved) if (_edit_order(x), i) < order]
        total = torch.zeros(d_head, dtype=torch.float64)
        count = 0
        for rows in _batches(len(token_ids), batch_size):
            if e.prompts is not None and not any(i in rows for i in e.prompts):
                continue
            batch = model.batch_from_ids([token_ids[i] for i in rows])
            z = run_batch(model, batch, save={(e.layer, "attn_z")},
                          edits=edits_for_rows(before, rows),
                          logits=False)[(e.layer, "attn_z")]  # [prompt, pos, head*d_head]
            z = z[..., e.head * d_head:(e.head + 1) * d_head].double()
            real = batch.attention_mask.bool()                  # [prompt, pos]
            if e.prompts is not None:
                real &= torch.tensor([i in e.prompts for i in rows])[:, None]
            total += z[real].sum(0)
            count += int(real.sum())
        mean = (total / count).float()
        resolved[j] = replace(e, value=mean)  # keeps `prompts`
    return resolved


def token_coords(model: Model, batch: Batch, positions: Sequence[int] | None,
                 n_pos: int) -> dict[str, Any]:
    """token_id / token (prompt, pos) coords and the mask; -1 / "" on padding."""
    n = len(batch.lengths)
    ids = np.full((n, n_pos), -1, dtype=np.int64)
    toks = np.full((n, n_pos), "", dtype=object)
    for i, length in enumerate(batch.lengths):
        idx = range(length) if positions is None else [p + length if p < 0 else p for p in positions]
        for j, q in enumerate(idx):
            ids[i, j] = batch.token_ids[i][q]
            toks[i, j] = batch.tokens[i][q]
    return {"token_id": (("prompt", "pos"), ids),
            "token": (("prompt", "pos"), toks.astype(str)),
            "mask": ids >= 0}


def real_lengths(obj: xr.Dataset | xr.DataArray) -> xr.DataArray:
    """Each prompt's count of real tokens in a Dataset `read` returned (or one of its
    variables): from its ``mask``, or from the ``token_id`` coord (-1 on padding)."""
    if isinstance(obj, xr.Dataset) and "mask" in obj.data_vars:
        real = obj["mask"].astype(bool)
    elif "token_id" in obj.coords:
        real = obj.coords["token_id"] >= 0
    else:
        raise InputError("per-prompt positions need the run's `mask` variable or its "
                         "`token_id` coord; index the Dataset `trace`/`read` returned, or a "
                         "variable of it.")
    if "pos" not in real.dims:
        raise InputError("this result has no `pos` dimension to index.")
    return real.sum("pos")


def at_positions(obj: xr.Dataset | xr.DataArray, pos: Any) -> xr.Dataset | xr.DataArray:
    """``obj`` at per-prompt positions ``pos`` (an int or a list of ints): a negative
    position counts from each prompt's own end, so ``-1`` is every prompt's last real token
    in a padded batch, never a padding column. Where the run kept chosen ``positions``, the
    ``pos`` labels are those positions and ``pos`` picks among them by label.

    With one int the ``pos`` dimension goes and ``pos`` becomes a (prompt,) coord of the
    column each prompt's value came from; with a list, ``pos`` holds the positions asked for.
    """
    many = not isinstance(pos, (int, np.integer))
    wanted = check_positions(pos)
    labels = obj.coords["pos"].values if "pos" in obj.coords else None
    if labels is None or "pos" not in obj.dims:
        raise InputError("this result has no `pos` dimension to index.")
    if not np.array_equal(labels, np.arange(len(labels))):   # kept positions: by label
        missing = [p for p in wanted if p not in labels.tolist()]
        if missing:
            raise InputError(f"position {missing[0]} was not kept by this run; it kept "
                             f"positions {labels.tolist()}.")
        return obj.sel(pos=wanted if many else wanted[0])
    lengths = real_lengths(obj)
    picked = []
    for p in wanted:
        q = lengths + p if p < 0 else xr.full_like(lengths, p)
        bad = (q < 0) | (q >= lengths)
        if bool(bad.any()):
            where = {d: int(v) for d, v in zip(bad.dims, np.argwhere(bad.values)[0])}
            n = int(lengths.values[tuple(where.values())]) if where else int(lengths)
            who = f"prompt {where['prompt']}" if "prompt" in where else "the prompt"
            raise InputError(f"position {p} is out of range for {who} with {n} tokens "
                             f"(allowed: -{n} to {n - 1}).")
        picked.append(obj.isel(pos=q))
    if not many:
        return picked[0]
    out = xr.concat([x.drop_vars("pos") for x in picked], dim="pos")
    return out.assign_coords(pos=np.array(wanted)).transpose(*obj.dims, ...)


@xr.register_dataset_accessor("explorer")
@xr.register_dataarray_accessor("explorer")
class PositionsAccessor:
    """``ds.explorer``: positions as a person means them on a Dataset `trace`, `read` or
    `run_with` returned, or on one of its variables.

    Results are aligned at each prompt's first token, so a shorter prompt of a padded
    batch ends in padding (NaN) and plain ``isel(pos=-1)`` is the batch's last column.
    ``ds.resid_post.explorer.isel(prompt=2, pos=-1)`` is prompt 2's own last token, and
    ``ds.explorer.last`` every prompt's last token (see `at_positions`).
    """

    def __init__(self, obj: xr.Dataset | xr.DataArray):
        self._obj = obj

    def isel(self, indexers: dict[str, Any] | None = None, **more: Any):
        """``obj.isel(...)`` where ``pos`` counts per prompt (negative: from its end)."""
        indexers = {**(indexers or {}), **more}
        pos = indexers.pop("pos", None)
        obj = self._obj.isel(indexers) if indexers else self._obj
        return obj if pos is None else at_positions(obj, pos)

    @property
    def last(self):
        """Every prompt's last real token (``pos`` -1 of each prompt)."""
        return at_positions(self._obj, -1)

    @property
    def lengths(self) -> xr.DataArray:
        """Real tokens per prompt (prompt,)."""
        return real_lengths(self._obj)

    def as_torch(self) -> torch.Tensor | dict[str, torch.Tensor]:
        """The values as a torch tensor (a Dataset: a dict of its variables' tensors), in
        the order of ``dims``; padding stays NaN. No copy where the array is contiguous."""
        if isinstance(self._obj, xr.Dataset):
            return {str(k): v.explorer.as_torch() for k, v in self._obj.data_vars.items()}
        return torch.from_numpy(np.ascontiguousarray(self._obj.values))


def logit_attribution(model: Model, prompts: Any, target_ids: Any, *,
                      positions: Sequence[int] = (-1,), edits: Sequence[Edit] = ()) -> xr.Dataset:
    """Direct logit attribution of ``target_ids`` [prompt, target] at each prompt's
    ``positions``, computed inside the trace (`direct_logit_attribution`: only these
    scalars leave a remote run), under ``edits``: `read` with one `DLA` record.

    ``prompts`` as in `trace`. Returns, in float64, ``embed``, ``heads`` (layer, head),
    ``attn_bias`` and ``mlp`` (layer) and ``norm_bias`` terms over (prompt, pos, ...,
    target) and ``logit`` (prompt, pos, target), the targets' logits; where the residual
    stream is a plain sum (not under Gemma 2's post-norms, nor a logit soft cap) the terms
    add up to it. Coord ``target_id`` (prompt, target).
    """
    positions = check_positions(positions)
    if positions is None:
        raise InputError("`positions` must name the positions to attribute; got None.")
    batch, texts = as_batch(model, prompts)   # tokenised once: `read` takes the Batch
    ids = np.asarray(target_ids)
    if ids.ndim != 2 or ids.shape[0] != len(batch.lengths):
        raise InputError(f"`target_ids` must be [prompt, target] with {len(batch.lengths)} "
                         f"rows; got shape {tuple(ids.shape)}.")
    ds = read(model, batch, [DLA(ids)], edits=edits, positions=positions,
              batch_size=len(batch.lengths))
    ds = ds.drop_vars(["mask", "token_id", "token"])
    ds.attrs = provenance(model, method="logit_attribution", edits=edits, positions=positions,
                          prompts=texts)
    return ds


def run_with(model: Model, prompts: Any, edits: Sequence[Edit] = (), *, sites: Any = (),
             layers: Any = None, positions: Sequence[int] | None = None,
             resume: CleanRun | None = None) -> xr.Dataset:
    """Run prompts under ``edits``; return ``logits`` (prompt, pos, vocab) and any sites
    (`read` with `Logits` and a `Save` per site, as one batch).

    ``prompts`` as in `trace` (text, token id lists or a `Batch`).

    With ``resume`` (from `clean_run` on the same prompts), layers before the first edit
    are not re-run: their clean output is fed forward instead (exact, and faster).
    """
    sites = check_sites(sites) if sites else ()
    layers = check_layers(model, layers)
    bad = [s for s in sites if s in ("final_norm", "unembed", "attn_pattern")]
    if bad:
        raise InputError(f"run_with reads layer sites; use `trace` for {bad[0]!r}.")
    batch, texts = as_batch(model, prompts)   # tokenised once: `read` takes the Batch
    ds = read(model, batch, [Logits(), *(Save(s, tuple(layers)) for s in sites)],
              edits=edits, positions=positions, batch_size=len(batch.lengths), resume=resume)
    ds = ds[["logits", *sites, "mask"]].assign_coords(layer=np.array(layers))
    ds.attrs.update(method="run_with", params={**ds.attrs["params"], "prompts": texts,
                                               "sites": list(sites), "layers": layers})
    del ds.attrs["readouts_json"]
    return ds
