"""Inference-Time Decomposition of Activations (ITDA): dictionaries of real activations.

An ITDA dictionary is a set of unit-norm activations ("atoms") taken from the data itself.
An activation x is encoded by matching pursuit (MP) over the atoms with at most ``l0``
steps; while the dictionary is built, x is added as a new atom x/||x|| whenever its
relative reconstruction error ||x - x_hat||^2 / ||x||^2 exceeds ``tau`` (Leask et al.,
2025, Algorithm 1). Each atom keeps the label of the token it came from (prompt, position,
token), so two dictionaries built on the same token stream can be compared by their
labels alone (`explorer.analyses.similarity.jaccard_index`).

Building needs no gradient steps: one pass over the activations, one matrix product per MP
step per batch. `ITDA.fit` streams over an activation Dataset chunk by chunk (the lazy,
dask-backed Datasets of `explorer.store.ActivationStore` included), so the dictionary,
not the data, bounds the memory.

Also here: the measures of a dictionary (error, L0, size, fraction of variance explained,
downstream loss with the decoded activation spliced into the model) and a plain TopK
sparse autoencoder (`SparseAutoencoder`) trained on the same activations for a time and
quality comparison (`itda_vs_sae`).

Modules
-------
* `pursuit`: matching pursuit and orthogonal matching pursuit (`matching_pursuit`, `ENCODERS`).
* `activations`: streaming activations with their labels (`activation_chunks`) and tracing
  them once into the store (`cached_activations`).
* `dictionary`: the dictionary itself (`ITDA`).
* `measures`: error / L0 / FVE, the tau sweep, atom examples, downstream loss.
* `sae`: the TopK SAE baseline and the comparison (`SparseAutoencoder`, `itda_vs_sae`).

Every public name is re-exported here (``from explorer.analyses.itda import ITDA``). To
replace a function in a test, patch it in the submodule that calls it.

References
----------
P. Leask, N. Nanda, N. Al Moubayed, "Inference-Time Decomposition of Activations (ITDA):
A Scalable Approach to Interpreting Large Language Models", ICML 2025.

S. Mallat, Z. Zhang, "Matching pursuits with time-frequency dictionaries", IEEE Trans.
Signal Processing, 1993 (MP); Y. Pati, R. Rezaiifar, P. Krishnaprasad, "Orthogonal
matching pursuit", Asilomar 1993 (OMP).

L. Gao et al., "Scaling and evaluating sparse autoencoders", 2024 (TopK SAE).
"""
from __future__ import annotations

from explorer.analyses.itda.activations import activation_chunks, cached_activations
from explorer.analyses.itda.dictionary import CITATION, ITDA
from explorer.analyses.itda.measures import (
    downstream_loss,
    itda_atom_examples,
    itda_downstream_loss,
    itda_reconstruction,
    itda_tau_sweep,
)
from explorer.analyses.itda.pursuit import ENCODERS, matching_pursuit
from explorer.analyses.itda.sae import SparseAutoencoder, itda_vs_sae

__all__ = [
    "ITDA",
    "ENCODERS",
    "matching_pursuit",
    "activation_chunks",
    "cached_activations",
    "itda_reconstruction",
    "itda_tau_sweep",
    "itda_atom_examples",
    "itda_downstream_loss",
    "downstream_loss",
    "SparseAutoencoder",
    "itda_vs_sae",
]

# `CITATION` (not in __all__) is importable from here too.
