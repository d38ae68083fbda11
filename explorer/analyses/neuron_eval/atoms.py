"""Real units: ITDA atoms explained by their own token (or its family), probed and checked."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses.neuron_eval.concepts import token_concepts, token_identity_concepts
from explorer.analyses.neuron_eval.sanity import sanity_checks

__all__ = ['ATOM_EXPLANATIONS', 'atom_probe_set', 'itda_atom_sanity_checks']


#: How `itda_atom_sanity_checks` explains an atom, from its label alone.
ATOM_EXPLANATIONS = ("own_token", "token_family")


def atom_probe_set(activations: Any, *, site: str = "resid_post", layer: int | None = None,
                   min_pos: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The probing set of the ITDA-atom evaluations, from a traced activation Dataset.

    Returns ``(unit_x, token_id, token)``: every kept token's activation scaled to unit norm
    (float64, [input, d_model], so ``unit_x @ atom`` is the cosine an atom's activation is
    defined by), its token id and its token text (positions below ``min_pos`` left out).

    A triple of arrays: the activations, token ids and concept matrix that `sanity_checks`
    takes as arguments.
    """
    from explorer.analyses.itda import activation_chunks

    xs, ids, toks = [], [], []
    for chunk in activation_chunks(activations, site=site, layer=layer, min_pos=min_pos):
        xs.append(chunk["x"])
        ids.append(chunk["token_id"])
        toks.append(chunk["token"])
    x = np.concatenate(xs).astype(np.float64)
    unit_x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
    return unit_x, np.concatenate(ids), np.concatenate(toks)


def itda_atom_sanity_checks(itda: Any, activations: Any, *, site: str = "resid_post",
                            layer: int | None = None, explanation: str = "own_token",
                            min_count: int = 3, max_units: int = 200, min_pos: int = 0,
                            word_lists: Mapping[str, Sequence[str]] | None = None,
                            **options: Any) -> xr.Dataset:
    """Sanity checks on ITDA atoms of a real model, each explained through its own label.

    Unit = an atom; its activation on a token = the cosine between the token's activation
    and the atom. The explanation comes from the atom's source token, known in advance
    (no metric picks it):

    * ``"own_token"``: "the token is the atom's source token";
    * ``"token_family"``: the token-level concept (`token_concepts`: digit, capitalised,
      punctuation, a word list) the source token belongs to; atoms whose token is in no
      family, or in more than one, are skipped.

    Units whose concept holds on fewer than ``min_count`` tokens of ``activations`` (the
    probing set) are skipped; positions below ``min_pos`` are left out of the probing set.
    Other options go to `sanity_checks`.

    Returns
    -------
    xarray.Dataset
        As `sanity_checks` (pooled rule), with ``atom_token``, ``explanation`` and
        ``n_concept`` (unit).
    """
    check_choice("explanation", explanation, ATOM_EXPLANATIONS)
    check_int("min_count", min_count, low=1)
    check_int("max_units", max_units, low=1)
    unit_x, tid, tokens = atom_probe_set(activations, site=site, layer=layer, min_pos=min_pos)
    atoms = itda.atoms_.astype(np.float64)
    if explanation == "own_token":
        atom_ids = itda.atom_token_id_
        concepts_all = None
        names = itda.atom_token_.astype(str)
        counts = np.array([(tid == t).sum() for t in atom_ids])
        eligible = (counts >= min_count) & (counts < len(tid))
    else:
        probe = token_concepts(tokens, word_lists=word_lists)                    # [input, family]
        src = token_concepts(itda.atom_token_, word_lists=word_lists).values     # [atom, family]
        fam_counts = probe.values.sum(0)
        single = src.sum(1) == 1
        fam_of = np.where(single, src.argmax(1), -1)
        concepts_all = probe.values
        names = np.array([str(probe["concept"].values[f]) if f >= 0 else "" for f in fam_of])
        counts = np.array([fam_counts[f] if f >= 0 else 0 for f in fam_of])
        eligible = (fam_of >= 0) & (counts >= min_count) & (counts < len(tid))
    keep = np.flatnonzero(eligible)[:max_units]
    if keep.size == 0:
        raise InputError(f"no atom's explanation ({explanation}) holds on at least {min_count} tokens of "
                         "the probing set; use more prompts or a smaller `min_count`.")
    acts = unit_x @ atoms[keep].T                                     # [n_inputs, units]
    if concepts_all is None:
        concepts = token_identity_concepts(tid, atom_ids[keep]).values
    else:
        concepts = concepts_all[:, fam_of[keep]]
    options.setdefault("pass_rule", "pooled")
    out = sanity_checks(xr.DataArray(acts, dims=("input", "unit"), coords={"unit": keep}),
                        concepts, **options)
    out.attrs["explanation"] = explanation
    return out.assign(atom_token=("unit", itda.atom_token_[keep]), explanation=("unit", names[keep]),
                      n_concept=("unit", counts[keep].astype(np.int64)))
