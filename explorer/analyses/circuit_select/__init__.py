"""Choosing the circuit to show from a measured faithfulness curve.

The faithfulness curve (`circuits.faithfulness_curve`) patches every edge outside the top-n
circuit (pruned to input -> logits paths) at a list of sizes n. The circuit worth reading
first is the smallest of those that recovers a chosen share of the metric, as long as it is
small enough to read; when none is, the most faithful one within the cap (Hanna et al., "Have
Faith in Faithfulness", COLM 2024, read circuits the same way: the smallest that is faithful).

Two rules build the circuit of n edges from the edge scores (`SELECTION_RULES`):

- ``"top-n"``: the n edges of largest |score|, pruned to input -> logits paths
  (`circuits.select_circuit`; the EAP-IG library's ``Graph.apply_topn`` + ``prune``).
- ``"greedy"``: the paper's own construction (`greedy_circuit`; ``Graph.apply_greedy`` of
  hannamw/EAP-IG, used for every faithfulness curve of Hanna et al. 2024): start from the
  logits and repeatedly add the highest-|score| edge INTO a node already in the circuit, so
  every chosen edge leads to the logits; then prune dead nodes (`prune_dead_nodes`).

Both work on the q/k/v-split graph too (`circuits.edge_scores(split_qkv=True)`), as the
library does: an edge into a head's query, key or value input is an edge into the head, so a
head joins the circuit (and its in-edges become greedy candidates) through any of the three,
and patching keeps the other inputs' edges at their corrupted values.

`rule_faithfulness_curve` measures either rule's curve by patching (`circuits.
patch_edges_metric`), with per-pair values for bootstrap intervals (`bootstrap_recovered`);
`choose_default_circuit` is the one call that picks the circuit a page opens on.

Modules
-------
* `choice`: the smallest faithful circuit on a curve and readable sizes.
* `rules`: top-n and greedy selection, pruning, a rule's faithfulness curve, bootstrap.
* `nodes`: node-level circuits and their curves.
* `default`: the page's default circuit (bisection over measured curves).

Every public name is re-exported here; patch a function in the submodule that calls it.
"""
from __future__ import annotations

from explorer.analyses.circuit_select.choice import (CircuitChoice, smallest_faithful_circuit,
                                                     readable_sizes, READABLE_TARGETS,
                                                     CURVE_POINTS, REFINE_STEPS)
from explorer.analyses.circuit_select.rules import (SELECTION_RULES, greedy_circuit,
                                                    prune_dead_nodes, circuit_by_rule,
                                                    default_sizes, rule_faithfulness_curve,
                                                    bootstrap_recovered, edge_nodes)
from explorer.analyses.circuit_select.nodes import (node_scores, node_circuit_edges,
                                                    node_faithfulness_curve, node_ranking,
                                                    node_circuit, default_node_sizes,
                                                    smallest_faithful_nodes, measured_node_curve)
from explorer.analyses.circuit_select.default import (DefaultCircuit, choose_default_circuit,
                                                      next_bisection_size, merge_curves,
                                                      default_curve_sizes, measured_default_curve)

__all__ = [
    'CircuitChoice',
    'smallest_faithful_circuit',
    'readable_sizes',
    'READABLE_TARGETS',
    'SELECTION_RULES',
    'edge_nodes',
    'greedy_circuit',
    'prune_dead_nodes',
    'circuit_by_rule',
    'default_sizes',
    'rule_faithfulness_curve',
    'bootstrap_recovered',
    'DefaultCircuit',
    'choose_default_circuit',
    'next_bisection_size',
    'merge_curves',
    'node_scores',
    'node_circuit_edges',
    'node_faithfulness_curve',
    'node_ranking',
    'node_circuit',
    'default_node_sizes',
    'smallest_faithful_nodes',
    'measured_node_curve',
    'default_curve_sizes',
    'measured_default_curve',
    'CURVE_POINTS',
    'REFINE_STEPS',
]
