"""Representation shattering: knowledge editing on a transformer trained on a cyclic knowledge graph.

Nishi et al. (ICML 2025) train a small transformer from scratch on random walks over a
synthetic knowledge graph whose entities sit on several cyclic orders, with relations "k
steps clockwise / anticlockwise" (k = 1..4) on each order. The entity representations then
form rings. A knowledge edit (ROME, MEMIT, ...) that rewrites one fact distorts these
rings: the pairwise-distance matrix ``D`` of the entity representations moves away from
the unedited ``D0``. The shattering ratio ``R = ||D* - D0||_F / ||D0||_F`` grows with the
counterfactual distance of the edit (how far along the cycle the new object is from the
true one) and tracks the loss of accuracy on facts that were not edited.

This package holds the graph generator (`knowledge_graph`, `random_walks`), the model
(`KnowledgeGPT`) and its training (`train_knowledge_model`), storage of a trained model as
safetensors in the cache folder (`save_knowledge_model`, `load_knowledge_model`,
`knowledge_model`), accuracy on direct recall / logical / compositional inference
(`fact_accuracy`), three edit methods (`rome_edit`: the closed-form rank-one update at one
MLP; `memit_edit` / `memit_edits`: MEMIT's least-squares update of one or several facts,
spread over the MLPs of several blocks; `finetune_edit`: gradient steps on one MLP only),
the shattering ratio
(`shattering_ratio`, `entity_representations`, `edit_embedding`) and the sweep of many
edits (`edit_sweep`, cached by `stored_edit_sweep`).

Modules
-------
* `graph`: the knowledge graph and its random walks (`knowledge_graph`, `random_walks`), the
  defaults (`DEFAULTS`), splits (`SPLITS`) and `CITATION`.
* `model`: the transformer and its training (`KnowledgeGPT`, `KnowledgeModel`,
  `train_knowledge_model`).
* `storage`: safetensors storage and the cached model (`save_knowledge_model`,
  `load_knowledge_model`, `knowledge_model`, `is_stored`).
* `evaluation`: accuracy by split and the shattering ratio (`fact_accuracy`,
  `entity_representations`, `distance_matrix`, `shattering_ratio`).
* `edits`: ROME, MEMIT and fine-tuning edits (`rome_edit`, `memit_edits`, `memit_edit`,
  `finetune_edit`, `edit_fact`, `edited_model`).
* `embedding`: one edit's representations, projected (`edit_embedding`).
* `sweep`: many edits (`edit_sweep`, `stored_edit_sweep`, `sweep_summary`).

Every public name (and the helpers `knowledge_model_path`, `edit_attrs` that the command
layer uses) is re-exported here. To replace a function in a test, patch it in the submodule
that calls it.

References
----------
K. Nishi, R. Ramesh, M. Okawa, M. Khona, H. Tanaka, E. S. Lubana, "Representation
Shattering in Transformers: A Synthetic Study with Knowledge Editing", ICML 2025.
K. Meng, D. Bau, A. Andonian, Y. Belinkov, "Locating and Editing Factual Associations in
GPT" (ROME), NeurIPS 2022.
K. Meng, A. S. Sharma, A. Andonian, Y. Belinkov, D. Bau, "Mass-Editing Memory in a
Transformer" (MEMIT), ICLR 2023.
"""
from __future__ import annotations

# the submodules' __all__ make up this package's
from explorer.analyses.shattering import (  # noqa: I001
    graph, model, edits, evaluation, sweep, embedding, storage,
)
from explorer.analyses.shattering.edits import (
    EDIT_METHODS,
    KnowledgeEdit,
    counterfactual_target,
    edit_fact,
    edited_model,
    finetune_edit,
    key_covariance,
    memit_edit,
    memit_edits,
    memit_update,
    rome_edit,
    rome_update,
)
from explorer.analyses.shattering.embedding import PROJECTIONS, edit_attrs, edit_embedding
from explorer.analyses.shattering.evaluation import (
    distance_matrix,
    entity_representations,
    fact_accuracy,
    shattering_ratio,
)
from explorer.analyses.shattering.graph import (
    CITATION,
    DEFAULTS,
    SPLITS,
    KnowledgeGraph,
    knowledge_graph,
    random_walks,
)
from explorer.analyses.shattering.model import KnowledgeGPT, KnowledgeModel, train_knowledge_model
from explorer.analyses.shattering.storage import (
    knowledge_model_path,
    is_stored,
    knowledge_model,
    load_knowledge_model,
    save_knowledge_model,
)
from explorer.analyses.shattering.sweep import edit_sweep, stored_edit_sweep, sweep_summary

__all__ = [
    *graph.__all__,
    *model.__all__,
    *edits.__all__,
    *evaluation.__all__,
    *sweep.__all__,
    *embedding.__all__,
    *storage.__all__,
]

# Not in __all__ but importable from here: `knowledge_model_path` and `edit_attrs`
# (explorer.commands.shattering), imported above.
