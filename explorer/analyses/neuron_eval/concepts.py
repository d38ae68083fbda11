"""Token-level concepts of a probing set: word lists, character classes, token identities."""
from __future__ import annotations

import string
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice

__all__ = ['NUMBER_WORDS', 'token_concepts', 'token_identity_concepts']


#: A default word list for token concepts: English number words.
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "twenty", "thirty", "hundred", "thousand", "million",
                "first", "second", "third", "half")


def _is_punctuation(s: str) -> bool:
    return bool(s) and all(ch in string.punctuation or unicodedata.category(ch).startswith("P") for ch in s)


_CONCEPT_TESTS: dict[str, Callable[[str], bool]] = {
    "digit": lambda s: bool(s) and any(ch.isdigit() for ch in s) and all(ch.isdigit() or ch in ".,"
                                                                          for ch in s),
    "capitalised": lambda s: bool(s) and s[0].isupper(),
    "punctuation": _is_punctuation,
}


def token_concepts(tokens: Any, *, word_lists: Mapping[str, Sequence[str]] | None = None,
                   families: Sequence[str] = ("digit", "capitalised", "punctuation")) -> xr.DataArray:
    """Binary token-level concepts: digits, capitalised tokens, punctuation, word lists.

    Tokens are tested with surrounding whitespace stripped (" Paris" is capitalised). A
    word-list concept holds where the lower-cased stripped token is in the list.

    Parameters
    ----------
    tokens : sequence of str, shape (n_inputs,)
    word_lists : mapping of name -> words, optional
        Default: ``{"number_word": NUMBER_WORDS}``.
    families : sequence of {"digit", "capitalised", "punctuation"}

    Returns
    -------
    xarray.DataArray of float, dims (input, concept)
    """
    toks = [str(t).strip() for t in np.asarray(tokens).ravel()]
    if not toks:
        raise InputError("`tokens` is empty.")
    lists = {"number_word": NUMBER_WORDS} if word_lists is None else dict(word_lists)
    cols, names = [], []
    for fam in families:
        check_choice("family", fam, _CONCEPT_TESTS)
        cols.append([_CONCEPT_TESTS[fam](t) for t in toks])
        names.append(fam)
    for name, words in lists.items():
        vocab = {w.lower() for w in words}
        cols.append([t.lower() in vocab for t in toks])
        names.append(str(name))
    data = np.array(cols, dtype=np.float64).T.reshape(len(toks), len(names))
    return xr.DataArray(data, dims=("input", "concept"), coords={"concept": names},
                        attrs={"description": "token-level concepts (1 = present)"})


def token_identity_concepts(token_ids: Any, ids: Sequence[int], *, names: Sequence[str] | None = None
                            ) -> xr.DataArray:
    """Concept j holds where the input's token id is ``ids[j]`` ("the token is ' the'")."""
    tid = np.asarray(token_ids).ravel()
    ids = [int(i) for i in ids]
    data = (tid[:, None] == np.array(ids)[None, :]).astype(np.float64)
    labels = list(names) if names is not None else [str(i) for i in ids]
    return xr.DataArray(data, dims=("input", "concept"), coords={"concept": labels})
