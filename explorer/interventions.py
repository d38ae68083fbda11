"""Interventions as data: small serialisable records applied inside one nnsight trace.

An app slider edits a record, a session export stores it, a remote run sends it. Each
record names the site and layer it acts on; `apply_edits` performs the edits for one
(layer, site) point while a trace runs. Positions are indices into each prompt's own
tokens (negative counts from its end), independent of padding. ``prompts`` (every record
has it) restricts an edit to those rows of the batch (all if None), e.g. to patch a
different head in each copy of a batch repeated k times (see `CleanRun.repeat`).
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ._checks import (InputError, absolute_position, check_choice, check_float, check_int,
                      check_site, check_token_ids, record_from_dict, records_from_json)

__all__ = [
    "Edit",
    "Ablate",
    "Scale",
    "Patch",
    "Steer",
    "AddHead",
    "Set",
    "PATCH_SITES",
    "STEER_SITES",
    "edit_from_dict",
    "edits_to_json",
    "edits_from_json",
    "first_edit_layer",
    "check_prompt_rows",
    "index_key",
]

PATCH_SITES = ("resid_pre", "attn_q", "attn_k", "attn_v", "attn_z", "mlp_hidden", "mlp_out",
               "resid_post")
# sites split into heads: an edit's ``head`` selects one (attn_k / attn_v: a key/value head)
HEAD_SITES = ("attn_q", "attn_k", "attn_v", "attn_z")
# the d_model-wide sites a steering vector is added to
STEER_SITES = ("resid_pre", "mlp_out", "resid_post")


@dataclass(frozen=True)
class Edit:
    """Base of the intervention records. Each has a ``site`` (a class constant, or a field
    where the record can act at several sites)."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, **asdict(self)}
        if d.get("prompts", 0) is None:
            del d["prompts"]  # every row: records without `prompts` read as before
        return d

    @property
    def edit_site(self) -> str:
        return self.site  # type: ignore[attr-defined]

    def validate(self, model: Any) -> None:
        model.check_layer(self.layer)


@dataclass(frozen=True)
class _OfHead(Edit):
    """An edit of one head's slice of ``attn_z``: head ``head`` of layer ``layer``."""

    layer: int
    head: int
    site: ClassVar[str] = "attn_z"

    def validate(self, model: Any) -> None:
        model.check_layer(self.layer)
        model.check_head(self.head)


@dataclass(frozen=True)
class Ablate(_OfHead):
    """Replace one head's output (its slice of ``attn_z``) with zero or a mean.

    ``mode="mean"`` uses ``value`` (a d_head vector, e.g. a mean over a reference set)
    when given, else the head's mean over the run's own real tokens. ``positions``
    restricts the edit to those per-prompt positions (all if None); it needs mode "zero"
    or an explicit ``value`` (e.g. the task-mean output patched at the last token for
    the function-vector score of Todd et al.). ``prompts`` restricts it to those batch
    rows (all if None); a value-less mean is then taken over those rows' real tokens.
    """

    mode: str = "zero"
    value: tuple[float, ...] | None = None
    positions: tuple[int, ...] | None = None
    prompts: tuple[int, ...] | None = None
    kind: ClassVar[str] = "ablate"

    def __post_init__(self):
        _check_prompts(self)
        check_choice("mode", self.mode, ("zero", "mean"))
        if self.value is not None:
            if self.mode != "mean":
                # a value with mode "zero" would be silently ignored by `apply_edits`
                raise InputError(f"`value` applies to mode 'mean' only; got mode {self.mode!r}.")
            object.__setattr__(self, "value", _as_tuple(self.value, "value"))
        _normalise_positions(self)
        if self.positions is not None and self.mode == "mean" and self.value is None:
            raise InputError("`positions` with mode 'mean' needs an explicit `value`.")

    def validate(self, model: Any) -> None:
        super().validate(model)
        if self.value is not None and len(self.value) != model.spec.d_head:
            raise InputError(f"`value` must have d_head={model.spec.d_head} entries; "
                             f"got {len(self.value)}.")


@dataclass(frozen=True)
class Scale(_OfHead):
    """Multiply one head's output (its slice of ``attn_z``) by ``alpha`` (in ``prompts`` rows)."""

    alpha: float
    prompts: tuple[int, ...] | None = None
    kind: ClassVar[str] = "scale"

    def __post_init__(self):
        _check_prompts(self)
        object.__setattr__(self, "alpha", _finite("alpha", self.alpha))


@dataclass(frozen=True)
class _AtSite(Edit):
    """An edit whose ``site`` is a field (one of `PATCH_SITES`) and that may restrict an
    edit of a head site (`HEAD_SITES`) to one ``head``."""

    def _check_site(self) -> None:
        _check_prompts(self)
        site = check_site(self.site, PATCH_SITES)
        if self.head is not None and site not in HEAD_SITES:
            raise InputError(f"`head` applies to the head sites {', '.join(HEAD_SITES)} only; "
                             f"got site {site!r}.")
        _normalise_positions(self)

    def validate(self, model: Any) -> None:
        model.check_layer(self.layer)
        if self.head is not None:
            model.check_head(self.head, kv=self.site in ("attn_k", "attn_v"))


@dataclass(frozen=True)
class Patch(_AtSite):
    """Write the activation of ``source`` at ``site`` of ``layer`` into the run.

    ``source`` is a prompt (a str) or its token ids (a sequence of ints, run as given: no
    special tokens added). Without ``positions`` the source must have as many tokens as every
    prompt in the run (every row in ``prompts`` when given). ``head`` restricts a patch of a
    head site (``attn_z``, ``attn_q``; ``attn_k``/``attn_v`` by key/value head) to one head.
    Values already computed (a cached run's activations) go in with `Set`, which runs no
    source forward at all; `explorer.activation_patching` does a whole grid that way.
    """

    site: str
    layer: int
    source: str | tuple[int, ...]
    head: int | None = None
    positions: tuple[int, ...] | None = None
    prompts: tuple[int, ...] | None = None
    kind: ClassVar[str] = "patch"

    def __post_init__(self):
        self._check_site()
        if not isinstance(self.source, str):
            object.__setattr__(self, "source", _token_ids("source", self.source))

    def validate(self, model: Any) -> None:
        super().validate(model)
        if not isinstance(self.source, str):
            check_token_ids("source", self.source, model.vocab_size)


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    """``value`` as a non-empty tuple of token ids (ints >= 0), or a clear error."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    try:
        ids = tuple(value)
    except TypeError:
        raise TypeError(f"`{name}` must be a prompt (str) or its token ids (ints); "
                        f"got {type(value).__name__}.") from None
    if not ids:
        raise InputError(f"`{name}` must hold at least one token id; got none.")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise InputError(f"`{name}` token ids must be ints >= 0; got {t!r}.")
    return tuple(int(t) for t in ids)


@dataclass(frozen=True)
class Steer(Edit):
    """Add ``alpha * vector`` (d_model wide) to ``site`` of ``layer`` at ``positions`` (all
    if None) in ``prompts`` rows (all if None); ``site`` is one of `STEER_SITES`."""

    layer: int
    vector: tuple[float, ...]
    alpha: float = 1.0
    positions: tuple[int, ...] | None = None
    prompts: tuple[int, ...] | None = None
    site: str = "resid_post"
    kind: ClassVar[str] = "steer"

    def __post_init__(self):
        _check_prompts(self)
        check_site(self.site, STEER_SITES)
        object.__setattr__(self, "vector", _as_tuple(self.vector, "vector"))
        object.__setattr__(self, "alpha", _finite("alpha", self.alpha))
        _normalise_positions(self)

    def validate(self, model: Any) -> None:
        model.check_layer(self.layer)
        if len(self.vector) != model.spec.d_model:
            raise InputError(f"`vector` must have d_model={model.spec.d_model} entries; "
                             f"got {len(self.vector)}.")


@dataclass(frozen=True)
class AddHead(_OfHead):
    """Add ``alpha * value`` to one head's slice of ``attn_z`` at ``positions`` (all if None).

    ``value`` holds one d_head vector per selected (prompt, position), prompt-major (in
    the order of ``prompts`` when given) and flattened: the head's cached ``attn_z`` from a
    first run. Added before ``o_proj``, it
    adds exactly ``alpha`` times that run's head output to the attention output; this is
    run 2 of the JuICE dual run (Li et al., ICML 2025).
    """

    value: tuple[float, ...]
    alpha: float = 1.0
    positions: tuple[int, ...] | None = None
    prompts: tuple[int, ...] | None = None
    kind: ClassVar[str] = "add_head"

    def __post_init__(self):
        _check_prompts(self)
        object.__setattr__(self, "value", _as_tuple(self.value, "value"))
        object.__setattr__(self, "alpha", _finite("alpha", self.alpha))
        _normalise_positions(self)

    def validate(self, model: Any) -> None:
        super().validate(model)
        d_head = model.spec.d_head
        if not self.value or len(self.value) % d_head:
            raise InputError(f"`value` must hold a whole number of d_head={d_head} vectors; "
                             f"got {len(self.value)} entries.")


@dataclass(frozen=True)
class Set(_AtSite):
    """Write ``value`` into ``site`` of ``layer`` at the selected (prompt, position)
    pairs, or add it there with ``add``.

    ``value`` holds vectors as wide as the site (`Model.site_width`: d_model; heads x d_head
    at a head site; d_mlp at ``mlp_hidden``; d_head with ``head``, which restricts a head
    site's write to that head's slice) flattened: one per selected pair, prompt-major
    (in the order of ``prompts`` when given), or one per position, the same for every
    selected prompt. Restoring a clean state in a corrupted run (causal tracing) sets the
    clean run's values there; the corruption adds noise at ``resid_pre`` of layer 0.
    """

    site: str
    layer: int
    value: tuple[float, ...]
    head: int | None = None
    add: bool = False
    positions: tuple[int, ...] | None = None
    prompts: tuple[int, ...] | None = None
    kind: ClassVar[str] = "set"

    def __post_init__(self):
        self._check_site()
        object.__setattr__(self, "value", _as_tuple(self.value, "value"))
        object.__setattr__(self, "add", bool(self.add))

    def validate(self, model: Any) -> None:
        super().validate(model)
        width = model.spec.d_head if self.head is not None else model.site_width(self.site)
        if not self.value or len(self.value) % width:
            raise InputError(f"`value` must hold a whole number of {width}-wide vectors; got "
                             f"{len(self.value)} entries.")


_KINDS: dict[str, type[Edit]] = {c.kind: c for c in (Ablate, Scale, Patch, Steer, AddHead, Set)}

# Site keywords of older releases: refused when constructing, read from saved JSON.
_OLD_SITE_KEYS: dict[type[Edit], str] = {Patch: "patch_site", Set: "set_site"}


def _refuse_old_site_keyword(cls: type[Edit], old: str) -> None:
    """Make ``cls(old=...)`` raise an InputError naming ``site=`` (instead of Python's
    "unexpected keyword argument")."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if old in kwargs:
            raise InputError(f"{cls.__name__} names its site with `site=`: use "
                             f"site={kwargs[old]!r}, not {old}=.")
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]


for _cls, _old in _OLD_SITE_KEYS.items():
    _refuse_old_site_keyword(_cls, _old)


def _normalise_positions(e: Edit) -> None:
    """Normalise ``e.positions`` (None: every position) to a tuple of ints."""
    if e.positions is not None:
        object.__setattr__(e, "positions", tuple(int(p) for p in e.positions))


def _check_prompts(e: Edit) -> None:
    """Normalise ``e.prompts`` to a tuple of distinct non-negative ints (or None).

    Whether the rows exist is checked against the batch when the edit runs
    (`check_prompt_rows`).
    """
    rows = e.prompts
    if rows is None:
        return
    if isinstance(rows, (int, np.integer)):
        rows = (rows,)
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise TypeError(f"`prompts` must be a list of batch row indices; got "
                        f"{type(rows).__name__}.")
    rows = tuple(check_int(f"prompts[{i}]", r) for i, r in enumerate(rows))
    if not rows:
        raise InputError("`prompts` is empty; pass None to edit every prompt.")
    bad = [r for r in rows if r < 0]
    if bad:
        raise InputError(f"`prompts` holds batch row indices from 0; got {bad[0]}.")
    if len(set(rows)) != len(rows):
        dup = next(r for i, r in enumerate(rows) if r in rows[:i])
        raise InputError(f"`prompts` names row {dup} twice.")
    object.__setattr__(e, "prompts", rows)


def check_prompt_rows(prompts: Sequence[int] | None, n_prompts: int, what: str = "an edit") -> None:
    """InputError unless every row in ``prompts`` is a row of a batch of ``n_prompts``."""
    if prompts is None:
        return
    bad = [r for r in prompts if not 0 <= r < n_prompts]
    if bad:
        raise InputError(f"{what} targets prompt row {bad[0]}, but the batch has {n_prompts} "
                         f"prompt{'s' if n_prompts != 1 else ''} (rows 0 to {n_prompts - 1}).")


def _as_tuple(values: Any, name: str) -> tuple[float, ...]:
    """``values`` (a tensor, array or sequence of numbers) as a flat tuple of finite floats;
    InputError naming ``name`` if an entry is NaN or infinite (it would spread through
    every later activation of the run)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().float().cpu().reshape(-1).numpy()
    if isinstance(values, np.ndarray) and values.dtype.kind == "f":
        flat = values.reshape(-1)
        if np.isfinite(flat).all():  # the common case, checked at once (restores are large)
            return tuple(flat.tolist())
        values = flat
    if hasattr(values, "tolist"):
        values = values.tolist()
    out = tuple(float(v) for v in values)
    bad = [i for i, v in enumerate(out) if not math.isfinite(v)]
    if bad:
        where = ", ".join(f"{out[i]} at {i}" for i in bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise InputError(f"`{name}` must hold finite numbers; {len(bad)} of its {len(out)} "
                         f"entries are not ({where}).")
    return out


def _finite(name: str, value: Any) -> float:
    """``value`` as a finite float (check_float already rejects NaN and non-numbers)."""
    value = check_float(name, value)
    if not math.isfinite(value):
        raise InputError(f"`{name}` must be a finite number; got {value}.")
    return value


def edit_from_dict(d: dict[str, Any]) -> Edit:
    """Rebuild an edit from `Edit.to_dict` output; unknown kinds raise InputError."""
    return record_from_dict(d, _KINDS, "edit", _edit_fields)


def _edit_fields(cls: type[Edit], d: dict[str, Any]) -> None:
    """An edit dict's fields as the record takes them: lists as tuples; a site saved under
    an older key (``patch_site``, ``set_site``) read as ``site``."""
    if cls in (Patch, Set):
        old = _OLD_SITE_KEYS[cls]
        if old in d and "site" not in d:
            d["site"] = d.pop(old)
        d.setdefault("site", None)  # a missing site fails `check_choice` by name
    for key in ("value", "vector", "positions", "prompts", "source"):
        if isinstance(d.get(key), list):
            d[key] = tuple(d[key])


def edits_to_json(edits: Iterable[Edit]) -> str:
    return json.dumps([e.to_dict() for e in edits])


def edits_from_json(text: str) -> list[Edit]:
    return records_from_json(text, "edit", edit_from_dict)


def first_edit_layer(edits: Sequence[Edit]) -> int | None:
    """Earliest layer any edit touches (the layer a resumed run must start from)."""
    return min((e.layer for e in edits), default=None)


# -- application inside a trace ----------------------------------------------------------

@dataclass
class EditContext:
    """What `apply_edits` needs about the running batch (built outside the trace)."""

    d_head: int
    mask: torch.Tensor                        # [prompt, padded_pos] 1 for real tokens
    # `index_key(edit)` -> padded (row, col) indices of the edit's (prompt, position) pairs
    index: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sources: dict[Any, torch.Tensor] = field(default_factory=dict)  # Patch -> [prompt, n, ...]


def index_key(e: Edit) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """The key of ``e``'s (row, col) indices in `EditContext.index`: (positions, prompts)."""
    return getattr(e, "positions", None), getattr(e, "prompts", None)


def _row_selector(prompts: tuple[int, ...] | None, device: Any) -> Any:
    """Index of the batch rows an edit touches: every row (a slice) or a LongTensor."""
    if prompts is None:
        return slice(None)
    return torch.tensor(prompts, dtype=torch.long, device=device)


def apply_edits(value: torch.Tensor, edits: Sequence[Edit], ctx: EditContext) -> None:
    """Apply ``edits`` in place to ``value``, the live activation at their (layer, site).

    ``value`` is [prompt, padded_pos, d] (``attn_z`` is [prompt, padded_pos, head*d_head]).
    An edit with ``prompts`` touches only those rows.
    """
    for e in edits:
        if isinstance(e, (Ablate, Scale)):
            sl = _head_slice(e.head, ctx.d_head)
            r = _row_selector(e.prompts, value.device)
            if isinstance(e, Scale):
                value[r, :, sl] *= e.alpha
            elif e.positions is not None:
                rows, cols = ctx.index[index_key(e)]
                if e.mode == "zero":
                    value[rows, cols, sl] = 0.0
                else:
                    value[rows, cols, sl] = torch.tensor(e.value, dtype=value.dtype,
                                                         device=value.device)
            elif e.mode == "zero":
                value[r, :, sl] = 0.0
            elif e.value is not None:
                value[r, :, sl] = torch.tensor(e.value, dtype=value.dtype, device=value.device)
            else:
                m = ctx.mask[_row_selector(e.prompts, ctx.mask.device)]
                m = m.to(device=value.device, dtype=value.dtype).unsqueeze(-1)  # [prompt, pos, 1]
                mean = (value[r, :, sl] * m).sum((0, 1)) / m.sum()              # [d_head]
                value[r, :, sl] = mean
        elif isinstance(e, Steer):
            rows, cols = ctx.index[index_key(e)]
            vec = torch.tensor(e.vector, dtype=value.dtype, device=value.device)
            value[rows, cols] += e.alpha * vec
        elif isinstance(e, AddHead):
            rows, cols = ctx.index[index_key(e)]
            vec = torch.tensor(e.value, dtype=value.dtype, device=value.device)
            if vec.numel() != len(rows) * ctx.d_head:
                raise InputError(f"AddHead at layer {e.layer}, head {e.head} holds "
                                 f"{vec.numel() // ctx.d_head} vectors but the run selects "
                                 f"{len(rows)} (prompt, position) pairs.")
            sl = _head_slice(e.head, ctx.d_head)
            value[rows, cols, sl] += e.alpha * vec.reshape(len(rows), ctx.d_head)
        elif isinstance(e, Set):
            _apply_set(value, e, ctx)
        elif isinstance(e, Patch):
            rows, cols = ctx.index[index_key(e)]
            src = ctx.sources[e].to(value.dtype)  # [n_selected, d]
            if e.head is not None:
                sl = _head_slice(e.head, ctx.d_head)
                value[rows, cols, sl] = src[:, sl]
            else:
                value[rows, cols] = src
        else:  # pragma: no cover - every record type is handled above
            raise TypeError(f"unknown edit {e!r}")


def _head_slice(head: int, d_head: int) -> slice:
    """One head's columns of ``attn_z`` [..., head * d_head]."""
    return slice(head * d_head, (head + 1) * d_head)


def _apply_set(value: torch.Tensor, e: Set, ctx: EditContext) -> None:
    """`Set` ``e`` on the live ``value`` [prompt, padded_pos, d]: one vector per selected
    pair, or one per position repeated for every selected prompt."""
    rows, cols = ctx.index[index_key(e)]                  # prompt-major (row, col) pairs
    sl = slice(None) if e.head is None else _head_slice(e.head, ctx.d_head)
    width = value.shape[-1] if e.head is None else ctx.d_head
    vec = torch.tensor(e.value, dtype=value.dtype, device=value.device).reshape(-1, width)
    if vec.shape[0] != len(rows):                         # one per position, every prompt
        per_prompt = torch.unique_consecutive(rows, return_counts=True)[1]
        if not bool((per_prompt == vec.shape[0]).all()):
            raise InputError(f"Set at {e.site} layer {e.layer} holds {vec.shape[0]} vectors; "
                             f"the run selects {len(rows)} (prompt, position) pairs in "
                             f"{len(per_prompt)} prompts: give one vector per pair or per "
                             "position.")
        vec = vec.repeat(len(per_prompt), 1)
    if e.add:
        value[rows, cols, sl] += vec
    else:
        value[rows, cols, sl] = vec


def position_index(lengths: Sequence[int], width: int, positions: Sequence[int] | None,
                   prompts: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded (row, col) indices of per-prompt positions in a left-padded batch.

    ``positions`` None means every real token; ``prompts`` (rows of the batch, in this
    order) restricts the rows (all if None). Out-of-range positions or rows raise InputError.
    """
    check_prompt_rows(prompts, len(lengths))
    rows, cols = [], []
    for i in range(len(lengths)) if prompts is None else prompts:
        n = lengths[i]
        pos = range(n) if positions is None else positions
        for p in pos:
            rows.append(i)
            cols.append(width - n + absolute_position(p, n, f"prompt {i}"))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
