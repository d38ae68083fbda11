"""Circuit discovery by edge attribution: EAP and EAP-IG scores, circuits, faithfulness.

The graph has one node for the input embedding, one per attention head (``a{layer}.h{head}``),
one per MLP (``m{layer}``) and one for the logits. Every node writes to the residual stream
and every node but the input reads it, so there is an edge from each node to each later
node that reads the stream. A head reads the stream through ONE combined input: its query,
key and value are all computed from the same (per-head) copy of the residual stream, so a
head is one downstream node, not three. With grouped-query attention each head gets its own
copy of its group's key/value projection, so every query head can have its own input.

With ``split_qkv=True`` (`edge_scores`) the graph is the one of Hanna et al. 2024's code
(hannamw/EAP-IG, TransformerLens's ``use_split_qkv_input``): each head reads the stream
through THREE inputs, its query, key and value inputs, each normalised on its own, and an
edge into a head ends at one of them (``dst`` spelled ``a{layer}.h{head}<q>``, ``<k>``,
``<v>``, the library's edge names; ``dst_node`` names the head). SmolLM2-135M has 123,211
such edges against 44,371. Under grouped-query attention the library ungroups the key/value
heads, so each query head has its own key and value input here too. At an unpatched run the
three inputs are the same tensor, so the gradient w.r.t. a head's combined input is the sum
of the three (chain rule) and an edge's q, k and v scores sum to its combined score, for EAP
and for this EAP-IG (whose runs interpolate the input embeddings only; tested).

Edge scores (Syed et al. 2023, EAP; Hanna et al. 2024, EAP-IG), for an edge u -> v::

    score(u -> v) = sum over positions of (z_u(corrupt) - z_u(clean)) . dM/d(input of v)

averaged over prompts, where M is the metric (logit difference or KL to the clean run) at
the last position. EAP takes the gradient at the clean run; EAP-IG averages it over
``steps`` runs whose input embeddings are interpolated between the corrupted and the clean
prompt (k/steps, k = 1..steps). A score estimates the metric's change when that one edge is
patched to its corrupted value.

The forward, backward and edge-patched passes run on the core's per-head engine
(`explorer.heads.HeadEngine`, on the model's own weights), because each head needs its own
input, which the plain Hugging Face forward does not allow; the runs reproduce the Hugging
Face logits (tested). Supported families: every one in `explorer.models.ARCHITECTURES` --
llama (Llama, SmolLM2, Qwen2, Mistral), gpt2, gpt_neox (Pythia; its MLP reads what its
layer's heads read, so no head -> MLP edge inside a layer) and gemma2 (a head's write is
its slice of the attention output through the post-attention norm). On a remote (NDIF)
model the same code runs on the server, one batch per job (`explorer.trace.run_on_weights`):
the circuit forward is built over the served module tree, and only each batch's edge scores
(one float per edge) or patched-metric sums come back.

References: Wang et al., "Towards Understanding Fine-Tuning Mechanisms of LLMs via Circuit
Analysis", ICML 2025 (CircuitLoRA); Hanna, Pezzelle, Belinkov, "Have Faith in Faithfulness:
Going Beyond Circuit Overlap When Finding Model Mechanisms", COLM 2024 (EAP-IG); Syed, Rager,
Conmy, "Attribution Patching Outperforms Automated Circuit Discovery", 2023 (EAP).

Modules
-------
* `graph`: nodes, edges and the valid-edge mask (`circuit_graph`, `node_of`, `node_layer`).
* `forward`: the per-node forward on the per-head engine (`circuit_engine`, `graph_forward`).
* `pairs`: prompt pairs as batches and the metric (`prepare_pairs`, `METRICS`).
* `scores`: EAP and EAP-IG edge scores (`edge_scores`).
* `selection`: circuits from scores (`select_circuit`, `circuit_edges`, `circuit_nodes`).
* `faithfulness`: patched circuit-only runs (`patch_edges_metric`, `faithfulness_curve`).

Every public name is re-exported here. To replace a function in a test, patch it in the
submodule that calls it (e.g. ``explorer.analyses.circuits.scores.circuit_engine``).
"""
from __future__ import annotations

from explorer.analyses.circuit_tasks import (TASK_NAMES, CircuitTask, filter_task, make_task,
                                             name_variants, prompt_task, task_accuracy,
                                             task_generators)
from explorer.heads import UnsupportedModelError
from explorer.analyses.circuits.graph import (CircuitGraph, circuit_graph, SUPPORTED_FAMILIES, QKV,
                                              node_of, input_of, is_split, node_layer,
                                              valid_edge_mask)
from explorer.analyses.circuits.forward import circuit_engine, graph_forward
from explorer.analyses.circuits.pairs import (METRICS, CITATION, Progress, check_task, answer_ids,
                                              row_batches, prepare_pairs)
from explorer.analyses.circuits.scores import METHODS, edge_scores, prepare_circuit_run
from explorer.analyses.circuits.selection import (select_circuit, circuit_nodes, circuit_edges,
                                                  check_scores)
from explorer.analyses.circuits.faithfulness import (patch_edges_metric, faithfulness_curve,
                                                     keep_matrix, patched_metrics,
                                                     recovered_fraction)

__all__ = [
    'CircuitTask',
    'task_generators',
    'make_task',
    'name_variants',
    'TASK_NAMES',
    'CircuitGraph',
    'circuit_graph',
    'SUPPORTED_FAMILIES',
    'METHODS',
    'METRICS',
    'UnsupportedModelError',
    'QKV',
    'node_of',
    'input_of',
    'is_split',
    'edge_scores',
    'select_circuit',
    'circuit_nodes',
    'circuit_edges',
    'patch_edges_metric',
    'faithfulness_curve',
    'task_accuracy',
    'filter_task',
    'prompt_task',
    'CITATION',
    'Progress',
    'node_layer',
    'valid_edge_mask',
    'circuit_engine',
    'graph_forward',
    'check_task',
    'answer_ids',
    'row_batches',
    'prepare_pairs',
    'prepare_circuit_run',
    'check_scores',
    'keep_matrix',
    'patched_metrics',
    'recovered_fraction',
]
