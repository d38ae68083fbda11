"""The Circuits page's exports: the code that recomputes what the page shows, the circuit
as CSV and the picture as SVG, and the hidden state markers the browser tests read."""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from apps import _circuit_graph as cg
from apps._circuits_scoring import OWN_TASK, PROMPT_TASK, parse_counterfactual
from apps._recipe import MODEL, Call, Expr, Note, Recipe, Ref, Step

__all__ = ["CircuitExport"]


class CircuitExport:
    """The export part of `apps.circuits.CircuitsView` (a mixin)."""

    def code_recipe(self) -> Recipe:
        """What the page shows as records: the task's pairs, the edge scores, the faithfulness
        curve, the shown circuit (pruned) and its edges, and, with workspace edits, the task
        metric of the edited model."""
        scores, _, label = self._current()
        c, s = "explorer.analyses.circuits", "explorer.analyses.circuit_select"
        task, n = Ref("task"), Ref("len(task)")
        # the shown result's inputs (its provenance), not the widgets: the code recomputes
        # what the page shows, also after the prompt or the method changed without a compute
        prov = self.shown if self.scores is not None and self.shown is not None \
            else self.request_provenance()
        request = dict(prov.request)
        if prov.task == OWN_TASK and self._own_task is not None:
            steps: list[Step] = [Call("task", "explorer.analyses.user_items.parse_circuit_pairs",
                                      (self.own_pairs, MODEL), {"name": OWN_TASK})]
        elif prov.task == PROMPT_TASK:
            prompt = prov.prompts[0] if prov.prompts else self.prompt
            cf = prov.counterfactual
            if cf is not None:
                args, options, note = (cf.old.strip(), cf.new.strip()), {
                    "position": cf.position}, f"position {cf.position}: {cf.old!r} -> {cf.new!r}"
            elif not request.get("counterfactual"):
                args, options, note = ("", ""), {}, "mean ablation"
            else:
                word, pos, by = parse_counterfactual(request["counterfactual"])
                args, options, note = (word, by), ({} if pos is None else {"position": pos}), ""
            steps = [Call("task", f"{c}.prompt_task", (MODEL, prompt, *args),
                          {"answer": request.get("explain", ""), "name": PROMPT_TASK, **options},
                          note)]
        else:
            steps = [Call("task", f"{c}.make_task", (prov.task, prov.n_pairs), {"seed": 0})]
        method = prov.method
        steps.append(Call("scores", f"{c}.edge_scores", (MODEL, task),
                          {"method": method, "batch_size": n}))
        if self.curve is not None:
            steps.append(Call("curve", f"{c}.faithfulness_curve", (MODEL, task, Ref("scores")),
                              {"sizes": [int(v) for v in self.curve["n_edges"].values],
                               "batch_size": n}, "the faithfulness plot"))
        pruned = "the shown circuit, pruned to input -> logits paths"
        if self.nodes_mode():
            if self.node_curve is not None:
                steps.append(Call(
                    "node_curve", f"{s}.node_faithfulness_curve", (MODEL, task, Ref("scores")),
                    {"sizes": [int(v) for v in self.node_curve["n_nodes"].values],
                     "batch_size": n}, "the node faithfulness plot"))
            steps.append(Call("circuit", f"{s}.node_circuit", (Ref("scores"), self.n_nodes),
                              comment=f"the top {self.n_nodes} nodes by |node score| and the "
                              "edges between them"))
        elif self.mode == "top-n":
            steps.append(Call("circuit", f"{c}.select_circuit", (Ref("scores"),),
                              {"top_n": self.n_edges}, pruned))
        else:
            steps.append(Call("circuit", f"{c}.select_circuit", (Ref("scores"),),
                              {"threshold": self.threshold}, pruned))
        steps.append(Call("edges", "sorted", (Call(None, f"{c}.circuit_edges", (
            Ref("scores"), Ref("circuit"))),), comment="(src, dst) node names"))
        if self._shown["size"] > self.max_drawn_edges:
            steps.append(Note(f"the page draws the strongest {self.max_drawn_edges} of them"))
        steps.append(Call("faithfulness", f"{c}.patch_edges_metric",
                          (MODEL, task, Ref("scores"), Ref("circuit")), {"batch_size": n},
                          "'Patch all shown edges'"))
        if self.edits:
            steps.append(Expr("ids", "[[user_items.continuation_token(model.tokenizer, p, t) "
                              "for t in (a, w)] for p, a, w in zip(task.clean, task.answer, "
                              "task.wrong)]"))
            for name, edits in (("clean", "[]"), ("edited", "edits")):
                steps += [Expr("last", f"explorer.run_with(model, task.clean, {edits}, "
                               "positions=[-1])['logits'][:, 0]"),
                          Expr(name, "[float(last[i, a] - last[i, w]) for i, (a, w) in "
                               "enumerate(ids)]", f"the logit difference per pair, {name}")]
        if scores is not None and scores is not self.scores:
            steps.append(Note(f"the graph shows the fine-tuning checkpoint {label} "
                              "(explorer.analyses.circuit_lora.checkpoint_circuits)"))
        return Recipe(model=self._model.spec.name, edits=list(self.edits), steps=steps,
                      aliases={c: "ca", s: "cs", "explorer.analyses.user_items": "user_items"})

    def circuit_csv(self) -> str:
        """The shown circuit's edges as CSV (source, target, score, patch effect): all of
        them, also those the influence pruning leaves undrawn (a diff: the drawn table)."""
        self._update_table()
        return cg.circuit_csv(self._circuit_table if self._circuit_table is not None
                              else self._table)

    def _csv_file(self) -> io.StringIO:
        return io.StringIO(self.circuit_csv())

    def _svg_file(self) -> io.StringIO:
        L, H = self._model.n_layers, self._model.spec.n_heads
        return io.StringIO(cg.circuit_svg(self._table, self.node_columns(), n_layers=L,
                                          n_heads=H, title=self._csv.filename[:-4]))

    def _state_html(self, *_: Any) -> str:
        """Hidden markers of what the page shows (read by the browser test)."""
        self._update_table()
        t = self._table
        drawn = 0 if t is None else int((~np.isin(t["status"], ["lost", "outside"])).sum())
        metric = "none" if self.ablation is None else f"{self.ablation['metric']:.9g}"
        edge = "none" if self.ablation is None else self.ablation["edge"]
        n_ck = 0 if self.checkpoints is None else self.checkpoints.sizes["checkpoint"]
        d = self._default
        default = "none" if d is None else f"{d.n_edges} {d.n_kept} {d.recovered:.9g} {int(d.reached)}"
        interval = self.default_interval() if d is not None else None
        interval = "none" if interval is None else f"{interval[0]:.9g} {interval[1]:.9g}"
        e = self.edited
        edited = "none" if e is None else f"{e['clean_metric']:.9g} {e['edited_clean_metric']:.9g}"
        nd = self._node_default
        node_default = ("none" if nd is None else
                        f"{nd.n_edges} {nd.recovered:.9g} {int(nd.reached)}")
        c = self.circuit_patch
        patched = "none" if c is None else f"{c['n_shown']} {c['metric']:.9g} {c['recovered']:.9g}"
        return (f"<div class='circuit-state' data-circuit-scores="
                f"'{'ready' if self.scores is not None else 'none'}' "
                f"data-circuit-method='{self.method}' "
                f"data-circuit-edges='{drawn}' data-circuit-size='{self._shown['size']}' "
                f"data-circuit-chosen='{self._shown['chosen']}' data-circuit-mode='{self.mode}' "
                f"data-circuit-fraction='{self.fraction:.6g}' data-circuit-default='{default}' "
                f"data-circuit-cap='{self.max_default_edges}' "
                f"data-circuit-interval='{interval}' "
                f"data-circuit-share='{self.influence_share():.9g}' "
                f"data-circuit-nodes='{len(self._circuit_nodes())}' "
                f"data-circuit-selected='{self.selected}' "
                f"data-circuit-outside='{len(self._outside)}' "
                f"data-circuit-metric='{metric}' "
                f"data-circuit-ablated='{edge}' data-circuit-redraw-ms='{self.redraw_ms:.1f}' "
                f"data-circuit-redraw-cpu-ms='{self.redraw_cpu_ms:.1f}' "
                f"data-circuit-edited='{edited}' data-circuit-patched-all='{patched}' "
                f"data-circuit-granularity='{self.granularity}' "
                f"data-circuit-n-nodes='{self.n_nodes}' "
                f"data-circuit-node-default='{node_default}' "
                f"data-circuit-floor='{'ready' if self.noise_floor is not None else 'none'}' "
                f"data-circuit-checkpoints='{n_ck}'></div>")
