"""Finite automata read off a recurrent network's hidden states.

Two steps, as in van Rossem & Saxe (ICML 2025): `merge_states` groups hidden vectors that
lie closer than a threshold (one group = one automaton state), and `minimise_automaton`
reduces the transition graph of the groups with Hopcroft's partition refinement.
The automata are Moore machines: each state carries an output (the network's readout),
and two states are equivalent when every continuation gives the same outputs.

References
----------
L. van Rossem and A. M. Saxe, "Algorithm Development in Neural Networks: Insights from
the Streaming Parity Task", ICML 2025.

J. Hopcroft, "An n log n algorithm for minimizing states in a finite automaton", Theory of
Machines and Computations, 1971.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from explorer._checks import InputError, check_float

__all__ = ["Automaton", "merge_states", "minimise_automaton", "reachable_states"]

#: Marks a transition that is not defined (the automaton is partial there).
UNDEFINED = -1


@dataclass(frozen=True)
class Automaton:
    """A deterministic Moore machine over symbols ``0..n_symbols-1``.

    Attributes
    ----------
    transitions : numpy.ndarray of int, shape (n_states, n_symbols)
        ``transitions[q, a]`` is the state after reading ``a`` in ``q``; ``-1`` where the
        transition is not defined (a partial automaton).
    outputs : numpy.ndarray of int, shape (n_states,)
        Output of each state.
    initial : int
        The start state.
    """

    transitions: np.ndarray
    outputs: np.ndarray
    initial: int = 0

    def __post_init__(self) -> None:
        trans = np.asarray(self.transitions)
        outs = np.asarray(self.outputs)
        if trans.ndim != 2 or not np.issubdtype(trans.dtype, np.integer):
            raise InputError(f"`transitions` must be a 2-d int array [state, symbol]; got shape "
                             f"{trans.shape} and dtype {trans.dtype}.")
        n = trans.shape[0]
        if outs.shape != (n,):
            raise InputError(f"`outputs` must have one entry per state ({n}); got shape {outs.shape}.")
        if n == 0:
            raise InputError("an automaton needs at least one state; got 0.")
        if trans.size and (trans.min() < UNDEFINED or trans.max() >= n):
            raise InputError(f"`transitions` must hold states in [0, {n - 1}] or -1 (undefined); "
                             f"got values in [{trans.min()}, {trans.max()}].")
        if not 0 <= int(self.initial) < n:
            raise InputError(f"`initial` must be a state in [0, {n - 1}]; got {self.initial}.")
        object.__setattr__(self, "transitions", trans.astype(np.int64))
        object.__setattr__(self, "outputs", outs)
        object.__setattr__(self, "initial", int(self.initial))

    @property
    def n_states(self) -> int:
        return int(self.transitions.shape[0])

    @property
    def n_symbols(self) -> int:
        return int(self.transitions.shape[1])

    @property
    def complete(self) -> bool:
        """True when every reachable state has a transition for every symbol."""
        reach = reachable_states(self)
        return bool((self.transitions[reach] != UNDEFINED).all())

    def run(self, symbols) -> int | None:
        """Output after reading ``symbols`` from the start state; None if a transition is undefined."""
        q = self.initial
        for a in symbols:
            q = int(self.transitions[q, int(a)])
            if q == UNDEFINED:
                return None
        return self.outputs[q].item()


def reachable_states(automaton: Automaton) -> np.ndarray:
    """Indices of the states reachable from the start state, in breadth-first order."""
    seen = np.zeros(automaton.n_states, dtype=bool)
    seen[automaton.initial] = True
    order = [automaton.initial]
    queue = deque(order)
    while queue:
        q = queue.popleft()
        for nxt in automaton.transitions[q]:
            if nxt != UNDEFINED and not seen[nxt]:
                seen[nxt] = True
                order.append(int(nxt))
                queue.append(int(nxt))
    return np.asarray(order, dtype=np.int64)


def minimise_automaton(automaton: Automaton) -> tuple[Automaton, np.ndarray]:
    """The minimal equivalent automaton, by Hopcroft's partition refinement.

    A tuple: the automaton and each state's class are different kinds of value, read together.

    Unreachable states are dropped first. Refinement starts from the partition by output
    (a Moore machine: states with different outputs are distinguishable by the empty word)
    and splits blocks until every block maps each symbol into a single block. A partial
    automaton is completed with a sink state whose output differs from every other, so an
    undefined transition is distinguishable from a defined one; the sink is removed again
    from the result (its transitions read ``-1``).

    Parameters
    ----------
    automaton : Automaton

    Returns
    -------
    minimal : Automaton
        States are the equivalence classes, numbered in breadth-first order from the start.
    block_of : numpy.ndarray of int, shape (automaton.n_states,)
        The minimal state each original state belongs to; ``-1`` for unreachable states.

    References
    ----------
    J. Hopcroft, "An n log n algorithm for minimizing states in a finite automaton", 1971.
    """
    reach = reachable_states(automaton)
    n_symbols = automaton.n_symbols
    # Relabel reachable states 0..m-1 and add the sink m if any transition is undefined.
    index = np.full(automaton.n_states, -1, dtype=np.int64)
    index[reach] = np.arange(len(reach))
    trans = automaton.transitions[reach]  # [state, symbol]
    trans = np.where(trans == UNDEFINED, -1, index[np.maximum(trans, 0)])
    m = len(reach)
    has_sink = bool((trans == -1).any())
    out_labels = [("out", automaton.outputs[q].item()) for q in reach]
    if has_sink:
        trans = np.where(trans == -1, m, trans)
        trans = np.vstack([trans, np.full((1, n_symbols), m, dtype=np.int64)])
        out_labels.append(("sink", None))
    n = len(out_labels)

    # Inverse transitions: preimage[a][q] = states p with delta(p, a) = q.
    preimage = [[[] for _ in range(n)] for _ in range(n_symbols)]
    for p in range(n):
        for a in range(n_symbols):
            preimage[a][trans[p, a]].append(p)

    # Initial partition by output.
    by_label: dict = {}
    for q, label in enumerate(out_labels):
        by_label.setdefault(label, set()).add(q)
    blocks: list[set[int]] = list(by_label.values())
    block_id = np.empty(n, dtype=np.int64)
    for b, members in enumerate(blocks):
        block_id[list(members)] = b
    # Hopcroft: start with every block as splitter except the largest.
    largest = max(range(len(blocks)), key=lambda b: len(blocks[b]))
    work = deque((b, a) for b in range(len(blocks)) if b != largest for a in range(n_symbols))
    while work:
        splitter, a = work.popleft()
        pre: set[int] = set()
        for q in blocks[splitter]:
            pre.update(preimage[a][q])
        touched: dict[int, set[int]] = {}
        for p in pre:
            touched.setdefault(int(block_id[p]), set()).add(p)
        for b, inside in touched.items():
            if len(inside) == len(blocks[b]):
                continue
            outside = blocks[b] - inside
            # Keep the larger half under the old id; the smaller becomes a new block.
            small, large = (inside, outside) if len(inside) <= len(outside) else (outside, inside)
            blocks[b] = large
            new = len(blocks)
            blocks.append(small)
            block_id[list(small)] = new
            # If (b, c) still waits, b now names the larger half, so both halves wait; if
            # not, waiting on the smaller half suffices (Hopcroft's "smaller half" trick).
            for c in range(n_symbols):
                work.append((new, c))
    # Number blocks in breadth-first order from the start, dropping the sink block.
    sink_block = int(block_id[m]) if has_sink else None
    start = int(block_id[0])
    order = {start: 0}
    queue = deque([start])
    rep = {b: min(members) for b, members in enumerate(blocks) if members}
    while queue:
        b = queue.popleft()
        for a in range(n_symbols):
            nb = int(block_id[trans[rep[b], a]])
            if nb != sink_block and nb not in order:
                order[nb] = len(order)
                queue.append(nb)
    k = len(order)
    min_trans = np.full((k, n_symbols), UNDEFINED, dtype=np.int64)
    min_out = np.empty(k, dtype=automaton.outputs.dtype)
    for b, new in order.items():
        q = rep[b]
        min_out[new] = automaton.outputs[reach[q]]
        for a in range(n_symbols):
            nb = int(block_id[trans[q, a]])
            min_trans[new, a] = UNDEFINED if nb == sink_block else order[nb]
    block_of = np.full(automaton.n_states, -1, dtype=np.int64)
    block_of[reach] = [order[int(block_id[i])] for i in range(m)]
    return Automaton(min_trans, min_out, 0), block_of


def merge_states(hidden: np.ndarray, merge_distance: float) -> np.ndarray:
    """Greedy grouping of hidden vectors: one group per automaton state.

    States are visited in order; each joins the first existing group whose first member
    (its representative) lies closer than ``merge_distance`` (Euclidean), and otherwise
    starts a new group, as in van Rossem & Saxe's automaton extraction.

    Parameters
    ----------
    hidden : numpy.ndarray, shape (n, d)
        One hidden vector per visited state (the initial state and every prefix).
    merge_distance : float
        Vectors strictly closer than this to a representative join its group (>= 0; with
        0 nothing merges).

    Returns
    -------
    numpy.ndarray of int, shape (n,)
        Group index of every vector; groups are numbered in order of their first member.

    References
    ----------
    L. van Rossem and A. M. Saxe, ICML 2025 (automaton extraction, Section 3).
    """
    hidden = np.asarray(hidden, dtype=np.float64)
    if hidden.ndim != 2:
        raise InputError(f"`hidden` must be a 2-d array [state, unit]; got shape {hidden.shape}.")
    merge_distance = check_float("merge_distance", merge_distance, low=0.0)
    n = hidden.shape[0]
    groups = np.empty(n, dtype=np.int64)
    reps = np.empty_like(hidden)
    n_groups = 0
    for i in range(n):
        if n_groups:
            # First group within the distance, in order of creation (greedy). A diverged
            # vector (inf/nan) compares False everywhere and so starts its own group.
            dist = np.sqrt(((reps[:n_groups] - hidden[i]) ** 2).sum(axis=1))
            close = np.flatnonzero(dist < merge_distance)
            if close.size:
                groups[i] = int(close[0])
                continue
        reps[n_groups] = hidden[i]
        groups[i] = n_groups
        n_groups += 1
    return groups
