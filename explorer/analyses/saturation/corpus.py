"""The corpus of the saturation analysis: the shipped documents and their cutting into prompts.

* `load_corpus`: the documents of a corpus folder (default `CORPUS_DIR`, the shipped one) or file.
* `corpus_chunks`: documents cut into prompts of at most ``chunk_tokens`` tokens at paragraph
  breaks (then sentence ends, then words), never across documents, optionally up to a token budget.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from explorer.defaults import DATASETS_DIR
from explorer._checks import InputError, check_int, check_prompts

__all__ = ["CORPUS_DIR", "load_corpus", "corpus_chunks", "pack_units"]

#: The shipped corpus: plain-text documents written for the project (see datasets/README.md).
CORPUS_DIR = DATASETS_DIR / "corpus"


def pack_units(units: list[str], n_tokens: Callable[[str], int], limit: int, *,
               sep: str = " ") -> list[str]:
    """``units`` (paragraphs, sentences) joined greedily with ``sep`` into pieces of at most
    ``limit`` tokens (``n_tokens`` counts them), in order; a unit longer than ``limit`` is a
    piece of its own."""
    out: list[str] = []
    cur = ""
    for unit in units:
        trial = unit if not cur else cur + sep + unit
        if cur and n_tokens(trial) > limit:
            out.append(cur)
            cur = unit
        else:
            cur = trial
    if cur:
        out.append(cur)
    return out


def load_corpus(path: str | Path | None = None) -> list[str]:
    """The documents of a corpus folder (``*.txt``, sorted by name), or of one text file.

    Parameters
    ----------
    path : str or Path, optional
        A folder of ``.txt`` files or one file; default the shipped corpus `CORPUS_DIR`.

    Returns
    -------
    list of str
        One string per document; paragraphs are separated by blank lines.
    """
    folder = Path(path) if path is not None else CORPUS_DIR
    if folder.is_file():
        files = [folder]
    elif folder.is_dir():
        files = sorted(folder.glob("*.txt"))
    else:
        raise InputError(f"corpus path {str(folder)!r} is neither a folder nor a file.")
    docs = [f.read_text(encoding="utf-8").strip() for f in files]
    docs = [d for d in docs if d]
    if not docs:
        raise InputError(f"corpus path {str(folder)!r} holds no non-empty .txt document.")
    return docs


def _paragraphs(doc: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", doc) if p.strip()]


def _sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?;:])\s+", paragraph) if s]


def corpus_chunks(model: Any, documents: Sequence[str], *, chunk_tokens: int = 256,
                  max_tokens: int | None = None) -> list[str]:
    """Cut documents into prompts of at most ``chunk_tokens`` tokens at paragraph breaks.

    Paragraphs are joined with a blank line while they fit; a paragraph longer than
    ``chunk_tokens`` is cut at sentence ends (a sentence longer still, at words). Chunks
    never cross a document boundary. With ``max_tokens`` the list stops once that many
    tokens are collected (the last chunk may be cut to fit).
    """
    check_prompts(list(documents))
    chunk_tokens = check_int("chunk_tokens", chunk_tokens, low=8, high=model.spec.context_length)
    if max_tokens is not None:
        max_tokens = check_int("max_tokens", max_tokens, low=1)

    def n_tok(text: str) -> int:
        return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def pieces(par: str) -> list[str]:
        if n_tok(par) <= chunk_tokens:
            return [par]
        out = []
        for sent in _sentences(par):
            if n_tok(sent) <= chunk_tokens:
                out.append(sent)
                continue
            words, cur = sent.split(" "), []
            for w in words:
                if cur and n_tok(" ".join([*cur, w])) > chunk_tokens:
                    out.append(" ".join(cur))
                    cur = []
                cur.append(w)
            if cur:
                out.append(" ".join(cur))
        return out

    chunks: list[str] = []
    total = 0
    for doc in documents:
        chunks += pack_units([p for par in _paragraphs(doc) for p in pieces(par)], n_tok,
                             chunk_tokens, sep="\n\n")
    if max_tokens is None:
        return chunks
    kept = []
    for c in chunks:
        n = n_tok(c)
        if total + n > max_tokens:
            room = max_tokens - total
            if room >= 8:
                ids = model.tokenizer(c, add_special_tokens=False)["input_ids"][:room]
                text = model.tokenizer.decode(ids).strip()
                if text:
                    kept.append(text)
            break
        kept.append(c)
        total += n
    if not kept:
        raise InputError(f"`max_tokens`={max_tokens} leaves no text; pass at least 8.")
    return kept
