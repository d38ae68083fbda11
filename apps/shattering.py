"""Representation-shattering page: edit one fact of a transformer trained on a cyclic knowledge
graph and watch the entity representations move.

Nishi et al. (ICML 2025): entities sit on cyclic orders and a small transformer trained on random
walks over the graph represents them on rings. A knowledge edit (ROME's rank-one update, MEMIT's
least-squares update spread over the MLPs of blocks 0..L, or fine-tuning one MLP) that sends ``e r`` to an entity ``d`` steps past the true one distorts the
rings, measured by ``R = ||D* - D0||_F / ||D0||_F`` on the entity distance matrix. The strength
slider scales the edit's parameter change (0 = unedited, 1 = the edit). The plane is a pair of
components (1-2, 1-3 or 2-3) of a PCA or an Isomap fitted on the unedited representations, with
entities joined in cycle order and coloured by their place on the cycle.
The scatter shows R against the accuracy drop over many edits, with the fitted line and r².
The edit is computed in the background when its controls change; its record (`edit_record`:
the model, the fact, the method, the block, when) writes the page's code and the export's
manifest, and a note marks the shown edit outdated until the new one lands. The strength,
projection and components are drawn at once from their controls.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import colorcet as cc
import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._paper import paper_panel
from apps._controls import labelled_controls
from apps._lab_provenance import (LabInput, drawn_as, lab_record, lab_stale_text,
                                  recompute_state, stale_pane, stamped)
from apps._provenance import Provenance
from apps._recipe import Call, Expr, Let, Note, Recipe, Ref, Step
from apps._session import CancelToken
from apps._view import ZOOM_TOOLS, Scope, View, serve, shown_dataset
from explorer.analyses.shattering import (
    DEFAULTS,
    EDIT_METHODS,
    KnowledgeEdit,
    KnowledgeModel,
    edit_embedding,
    edit_fact,
    edited_model,
    fact_accuracy,
    is_stored,
    key_covariance,
    knowledge_model,
    load_knowledge_model,
    stored_edit_sweep,
)

__all__ = ["ShatteringView", "AXES", "QUICK_PARAMS", "SWEEP_EDITS", "SHIPPED_MODEL", "SHIPPED_SWEEP",
           "plot_embedding", "plot_shattering_scatter", "scatter_caption", "save_shipped_sweep",
           "load_shipped_sweep", "EDIT_INPUTS", "model_name"]

hv.extension("bokeh", logo=False)

#: Settings trained by the page when the full model is not in the cache yet (about 20 s of CPU;
#: it recalls most trained facts but does not infer held-out ones yet).
QUICK_PARAMS: dict[str, Any] = {"steps": 1000}
#: Edits in the page's R vs accuracy-drop sweep.
SWEEP_EDITS = 40

_SHIPPED = Path(__file__).resolve().parents[1] / "datasets" / "shattering"
#: The model trained with `DEFAULTS` (seed 0), shipped so the page opens at once
#: (`scripts/ship_shattering.py` regenerates it; datasets/shattering/README.md).
SHIPPED_MODEL = _SHIPPED / "knowledge_model_seed0.safetensors"
#: The page's sweep (`SWEEP_EDITS` ROME edits at block 0, seed 0) of `SHIPPED_MODEL`.
SHIPPED_SWEEP = _SHIPPED / "edit_sweep_seed0.json"
#: About how long retraining the default model takes on one CPU thread (for the button).
RETRAIN_MINUTES = 8

_TOOLS = ZOOM_TOOLS
_CYCLE_CMAP = list(cc.palette["colorwheel"])  # cyclic: the first and last place look alike
_DISTANCE_COLORS = {d: theme.CATEGORICAL[i] for i, d in enumerate(range(1, 9))}
#: Component pairs the page offers (0-based indices into the first three components).
AXES: dict[str, tuple[int, int]] = {"1-2": (0, 1), "1-3": (0, 2), "2-3": (1, 2)}


_font = theme.font_sizes


_placeholder = functools.partial(theme.placeholder, height=420)


#: How the stale note names the inputs of the shown edit (its record's request).
EDIT_INPUTS = {"method": LabInput("the edit method", "{} edit"),
               "entity": LabInput("the entity", "entity {}"),
               "relation": LabInput("the relation", "relation {}"),
               "distance": LabInput("the counterfactual distance", "distance {}"),
               "layer": LabInput("the edited block", "block {}")}


def model_name(km: KnowledgeModel) -> str:
    """The knowledge-graph transformer in a record: its size and seed."""
    return (f"the knowledge-graph transformer ({km.graph.n_entities} entities, "
            f"{km.params['n_layers']} blocks, seed {km.params.get('seed', 0)})")


# -- the shipped result -----------------------------------------------------------------------

def save_shipped_sweep(sweep: xr.Dataset, km: KnowledgeModel, path: str | Path = SHIPPED_SWEEP) -> Path:
    """Write an `edit_sweep` of ``km`` as JSON, keyed by the model's weights."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"weights_sha256": km.weights_sha256(), "sweep": sweep.to_dict(data="list")}
    path.write_text(json.dumps(body, indent=None, default=float) + "\n")
    return path


def load_shipped_sweep(km: KnowledgeModel, path: str | Path = SHIPPED_SWEEP) -> xr.Dataset | None:
    """The sweep written by `save_shipped_sweep` if it is of ``km``'s weights, else None."""
    path = Path(path)
    if not path.is_file():
        return None
    body = json.loads(path.read_text())
    if body.get("weights_sha256") != km.weights_sha256():
        return None
    return xr.Dataset.from_dict(body["sweep"])


# -- plots (pure: Datasets in, HoloViews out) ------------------------------------------------

def plot_embedding(emb: xr.Dataset | None, order: int = 0, axes: tuple[int, int] = (0, 1)) -> hv.Element:
    """Entities before (grey ring) and at the chosen edit strength (coloured ring).

    ``emb`` is an `edit_embedding` with strengths ``[0, s]``; ``axes`` the two components
    drawn (0-based, e.g. ``(0, 2)`` for PC1 and PC3). Entities are joined in the order of cycle
    ``order`` and coloured by their place on it.
    """
    if emb is None:
        return _placeholder("No edit yet.")
    comps = [str(c) for c in emb["component"].values]
    if len(axes) != 2 or not all(0 <= a < len(comps) for a in axes) or axes[0] == axes[1]:
        raise ValueError(f"`axes` must be two different components in [0, {len(comps) - 1}]; got {axes}.")
    xname, yname = comps[axes[0]], comps[axes[1]]
    pos = emb["cycle_position"].sel(order=order).values
    ring = np.argsort(pos)                                                  # entities in cycle order
    names = emb["entity"].values
    cols = list(axes)
    before = emb["projection"].values[0][:, cols]                           # [entity, 2]
    after = emb["projection"].values[-1][:, cols]
    closed = np.append(ring, ring[0])
    ghost = hv.Path([before[closed]], [xname, yname]).opts(color="lightgrey", line_width=1.5)
    ghost_pts = hv.Points(before, [xname, yname]).opts(color="lightgrey", size=5)
    path = hv.Path([after[closed]], [xname, yname]).opts(color="#555", line_width=1, alpha=0.7)
    data = {xname: after[:, 0], yname: after[:, 1], "entity": names, "place": pos}
    pts = hv.Points(data, [xname, yname], ["place", "entity"]).opts(
        color="place", cmap=_CYCLE_CMAP, colorbar=True, clabel=f"place on cycle {'ABCDEFGH'[order]}",
        size=8, line_color="black", line_width=0.4, tools=["hover"])
    edit = emb.attrs["edit"]
    idx = {n: i for i, n in enumerate(names)}
    marks = []
    for role, colour, marker in (("entity", "black", "square"), ("true_object", "#2ca02c", "triangle"),
                                 ("new_object", "#d62728", "star")):
        i = idx[edit[role]]
        marks.append(hv.Points({xname: [after[i, 0]], yname: [after[i, 1]], "role": [role.replace("_", " ")],
                                "name": [edit[role]]}, [xname, yname], ["role", "name"],
                               label=f"{role.replace('_', ' ')} {edit[role]}").opts(
            color=colour, marker=marker, size=16, fill_alpha=0.0, line_width=2.5, tools=["hover"]))
    ratio = emb["explained_variance_ratio"].values[cols]
    if np.isfinite(ratio).all():
        xlabel = f"{xname} of unedited ({ratio[0]:.0%} of variance)"
        ylabel = f"{yname} ({ratio[1]:.0%})"
    else:
        xlabel, ylabel = f"{xname} (fitted on unedited)", yname
    return hv.Overlay([ghost, ghost_pts, path, pts, *marks]).opts(
        responsive=True, height=460, default_tools=_TOOLS, active_tools=["wheel_zoom"], fontsize=_font(),
        legend_position="bottom", legend_cols=3, xlabel=xlabel, ylabel=ylabel,
        title="Entities: edited (colour), unedited (grey)")


def plot_shattering_scatter(sweep: xr.Dataset | None, current: tuple[float, float] | None = None) -> hv.Element:
    """Shattering ratio R against the drop in accuracy on unedited facts, one dot per edit."""
    if sweep is None:
        return _placeholder("Running the edit sweep…", height=380)
    R = sweep["R"].values
    drop = sweep["accuracy_drop"].sel(split="all").values * 100
    dist = sweep["distance"].values
    a = sweep.attrs
    layers = []
    for d in sorted(set(dist.tolist())):
        sel = dist == d
        layers.append(hv.Scatter({"R": R[sel], "drop": drop[sel]}, "R", "drop", label=f"d = {d}").opts(
            color=_DISTANCE_COLORS.get(d, "grey"), size=7, tools=["hover"]))
    xs = np.linspace(0, float(R.max()) * 1.05, 50)
    if np.isfinite(a.get("slope", np.nan)):
        layers.append(hv.Curve((xs, (a["slope"] * xs + a["intercept"]) * 100), "R", "drop",
                               label="least-squares fit").opts(color="black", line_dash="dashed"))
    if current is not None:
        layers.append(hv.Scatter([(current[0], current[1] * 100)], "R", "drop", label="current edit").opts(
            color="black", marker="x", size=14, line_width=3))
    return hv.Overlay(layers).opts(
        responsive=True, height=380, default_tools=_TOOLS, fontsize=_font(), legend_position="right",
        xlabel="shattering ratio R", ylabel="accuracy drop on other facts (points of %)",
        title="R against the accuracy drop, one dot per edit")


def scatter_caption(sweep: xr.Dataset | None) -> str:
    """The line under the scatter: how many edits, which method, the fit's r²."""
    if sweep is None:
        return ""
    a = sweep.attrs
    p = a.get("params", {})
    return (f"{int(sweep.sizes['edit'])} {p.get('edit_method', '?')} edits at block {p.get('layer', 0)}, "
            f"each on the unedited model; least-squares fit r² = {a.get('r2', float('nan')):.2f}; "
            "× = the current edit at the chosen strength.")


# -- the view --------------------------------------------------------------------------------

class ShatteringView(View):
    """One counterfactual edit of the knowledge-graph transformer, and R over many edits.

    Parameters
    ----------
    model : explorer.Model, optional
        Ignored (the gallery passes its language model; this page trains its own transformer).
    km : KnowledgeModel, optional
        A trained model. Default: the stored model with `DEFAULTS`; if it is not in the cache,
        a quicker one (`QUICK_PARAMS`) is loaded or trained, with progress shown.
    sweep : xarray.Dataset, optional
        An `edit_sweep` of ``km``; computed (and stored) when not given.
    background : bool, optional
        Compute in a worker thread (default when served) or inline (tests, notebooks).
    """

    notify_title = "Shattering"
    link_params = ("method", "entity", "relation", "distance", "strength", "projection", "axes",
                   "layer")

    def scope(self) -> Scope:
        """Its own knowledge-graph transformer; edits are the page's own knowledge edits."""
        return Scope(on="its own small transformer trained on random walks over a cyclic "
                        "knowledge graph, not your prompt",
                     edits="not applicable: the page makes its own knowledge edit (ROME / MEMIT"
                           " / fine-tuning) on a separate toy model")

    method = param.Selector(default="rome", objects=sorted(EDIT_METHODS), label="Edit method",
                            doc="How the fact is edited: fine-tuning one MLP, MEMIT (least squares over "
                                "several MLPs) or ROME (a rank-one update of one MLP).")
    entity = param.Selector(default=None, objects=[], label="Entity (subject)",
                            doc="The subject of the edited fact.")
    relation = param.Selector(default=None, objects=[], label="Relation",
                              doc="The relation of the edited fact: a cycle (A, B, C) and a number of "
                                  "steps along it.")
    distance = param.Integer(default=2, bounds=(1, 4), label="Counterfactual distance",
                             doc="The new object lies this many steps past the true one on the cycle.")
    strength = param.Number(default=1.0, bounds=(0.0, 1.5), step=0.05, label="Edit strength",
                            doc="Multiple of the edit's parameter change (0 = unedited).")
    order = param.Selector(default=0, objects=[0], check_on_set=False, label="Cycle drawn",
                           doc="The cycle whose order joins and colours the entities in the plot.")
    projection = param.Selector(default="pca", objects={"PCA": "pca", "Isomap": "isomap"},
                                label="Projection",
                                doc="PCA or Isomap of the unedited representations; the edited ones are "
                                    "placed with the same map.")
    axes = param.Selector(default="1-2", objects=list(AXES), label="Components shown",
                          doc="The pair of components drawn (the page offers three 2-D views of the "
                              "first three components instead of a 3-D plot).")
    layer = param.Integer(default=0, bounds=(0, 1), label="Edited block (MLP)",
                          doc="ROME and fine-tuning edit this block's MLP; MEMIT spreads the edit over "
                              "the MLPs of blocks 0 up to this one (its last critical block).")
    retrain = param.Event(label=f"Retrain the model (about {RETRAIN_MINUTES} min)",
                          doc="Train the knowledge-graph transformer again from scratch with the default "
                              "settings (the page opens on the one shipped with the project), then "
                              "rerun the sweep; progress and the time left show in the status line.")

    km = param.Parameter(default=None, precedence=-1)
    edit = param.Parameter(default=None, precedence=-1)
    edit_record = param.ClassSelector(class_=Provenance, default=None, allow_None=True,
                                      precedence=-1, doc="What the shown edit was computed on.")
    sweep = shown_dataset()

    def __init__(self, model: Any = None, *, km: KnowledgeModel | None = None,
                 sweep: xr.Dataset | None = None, background: bool | None = None, **params: Any):
        # Choices that depend on the model wait for it: set before it, a selector with no
        # options yet would add them to the class's options, shared by every view.
        self._wanted = {k: params.pop(k) for k in ("entity", "relation", "order") if k in params}
        super().__init__(background=background, **params)
        # its caches (`View.cached`): "covariances" (ROME's key covariance, by model and
        # block) and "strengths" (embedding and fact accuracy of the shown edit, by strength)
        self.bound_cache("strengths", max_items=64)   # per session: 64 entries, 256 MB at most
        self._km_file: Path | None = None
        self.runner("load", self._loaded, progress=True, heavy=False)   # the shipped model: quick
        self.runner("retrain", self._retrained, progress=True)
        self.runner("edit", self._edited)
        self.runner("sweep", self._swept)
        self.param.watch(self._request_edit, ["method", "entity", "relation", "distance", "layer"])
        self.param.watch(self._request_retrain, "retrain")
        if km is not None:
            self._use_model(km)
            if sweep is not None:
                self.sweep = sweep
            else:
                self._request_sweep()
        else:
            self.submit("load", self._load)

    # -- computation ---------------------------------------------------------------------
    def _load(self, token: CancelToken) -> KnowledgeModel:
        if is_stored(**DEFAULTS):
            self.post(status="Loading the stored knowledge-graph transformer…")
            return knowledge_model(**DEFAULTS)
        if SHIPPED_MODEL.is_file():
            self.post(status="Loading the knowledge-graph transformer shipped with the project…")
            self._km_file = SHIPPED_MODEL          # for the page's snippet
            return load_knowledge_model(SHIPPED_MODEL)
        params = {**DEFAULTS, **QUICK_PARAMS}
        if is_stored(**params):
            self.post(status="Loading the stored quick knowledge-graph transformer…")
            return knowledge_model(**params)
        return knowledge_model(progress=self._training_progress(token, "No trained model found: "
                                                                       "training a quick one"), **params)

    def _training_progress(self, token: CancelToken, what: str):
        """A training callback: the progress bar, and a status line with the time left."""
        bar = self.progress_fn(token)

        def line(done: int, total: int, seconds: float) -> str:
            left = seconds / max(1, done) * (total - done)
            return f"{what}: step {done}/{total}, {seconds:.0f} s so far, about {left:.0f} s left…"

        status = self.status_reporter(token, line)

        def progress(done: int, total: int) -> bool:
            bar(done, total)
            return status(done, total)
        return progress

    def _request_retrain(self, *events: Any) -> None:
        self.running = True

        def job(token: CancelToken) -> KnowledgeModel:
            return knowledge_model(retrain=True, progress=self._training_progress(
                token, "Retraining the knowledge-graph transformer"), **DEFAULTS)

        self.submit("retrain", job)

    def _use_model(self, km: KnowledgeModel) -> None:
        g = km.graph
        # Options and bounds are set with their events on, so the widgets already on the page
        # (the model arrives from a worker after they are built) get them.
        self.km = km
        self.param.entity.objects = list(g.entity_names)
        self.param.relation.objects = list(g.relation_names)
        cycles = list(range(g.orders.shape[0]))
        # shown by the cycle's letter, as the relations (A+1) and the colour bar name it
        self.param.order.objects = {f"cycle {'ABCDEFGH'[i]}": i for i in cycles}
        self.param.layer.bounds = (0, km.n_layers - 1)
        self.param.distance.bounds = (1, min(8, g.n_entities - 1))
        values: dict[str, Any] = {}
        for name, names in (("entity", g.entity_names), ("relation", g.relation_names),
                            ("order", cycles)):
            wanted = self._wanted.pop(name, getattr(self, name))
            if wanted not in names:
                wanted = names[0]
            if wanted != getattr(self, name):
                values[name] = wanted
        if self.layer > km.n_layers - 1:
            values["layer"] = km.n_layers - 1
        if self.distance > self.param.distance.bounds[1]:
            values["distance"] = self.param.distance.bounds[1]
        self.status = self._describe(km)
        edit_params = {"entity", "relation", "layer", "distance"}
        if values:
            self.param.update(**values)      # one event: `_request_edit` runs once
        if not edit_params & set(values):
            self._request_edit()

    @staticmethod
    def _describe(km: KnowledgeModel) -> str:
        return (f"Model: {km.graph.n_entities} entities on {km.graph.orders.shape[0]} cycles, "
                f"{km.params['n_layers']} blocks, d_model {km.params['d_model']}, "
                f"{km.params['steps']} training steps ({km.train_seconds:.0f} s).")

    def _retrained(self, km: KnowledgeModel) -> None:
        self._km_file = None      # stored, not the shipped file: the snippet builds it
        self._loaded(km)

    def _loaded(self, km: KnowledgeModel) -> None:
        self.running = False
        self.forget("covariances")
        self._use_model(km)
        self._request_sweep()

    # -- what the shown edit was computed on ---------------------------------------------
    def edit_request(self) -> Provenance | None:
        """The record of the edit the page would compute from its controls now."""
        if self.km is None:
            return None
        return lab_record("shattering", model_name(self.km), {
            "method": self.method, "entity": self.entity, "relation": self.relation,
            "distance": int(self.distance), "layer": int(self.layer)})

    def shown_provenance(self) -> Provenance | None:
        """The shown edit's record, with the strength and plane it is drawn at."""
        return drawn_as(self.edit_record, {
            "strength": round(float(self.strength), 4), "projection": self.projection,
            "axes": self.axes, "order": self.order})

    def requested_provenance(self) -> Provenance | None:
        return self.edit_request()

    def stale_note(self, *_: Any) -> str:
        """'' while the shown edit is of the controls; else what it was computed on, what
        changed and that the new edit is on its way (or failed)."""
        return lab_stale_text(self.edit_record, self.edit_request(), EDIT_INPUTS,
                              state=recompute_state(self, "edit"))

    def _request_edit(self, *events: Any) -> None:
        km = self.km
        if km is None or self.entity is None or self.relation is None:
            return
        e, r = km.graph.entity_names.index(self.entity), km.graph.relation_names.index(self.relation)
        method, distance, layer = self.method, self.distance, self.layer
        wanted = self.edit_request()

        def job(token: CancelToken) -> tuple[KnowledgeEdit, Provenance]:
            cov: Any = None
            if method in ("rome", "memit"):
                blocks = [layer] if method == "rome" else list(range(layer + 1))
                # keyed by the model too: a job of the model before a retraining keeps its own
                covs = {b: self.cached("covariances", (id(km), b),
                                       lambda b=b: key_covariance(km, b)) for b in blocks}
                cov = covs[layer] if method == "rome" else covs
            token.check()
            return edit_fact(km, e, r, distance, method=method, layer=layer, cov=cov), wanted

        self.submit("edit", job)

    def _edited(self, out: tuple[KnowledgeEdit, Provenance]) -> None:
        self.forget("strengths")
        edit, wanted = out
        self.param.update(edit=edit, edit_record=stamped(wanted), error="")

    def _request_sweep(self) -> None:
        km = self.km
        if km is None:
            return
        shipped = load_shipped_sweep(km)
        if shipped is not None:
            self._swept(shipped)
            return

        def job(token: CancelToken) -> xr.Dataset:
            self.post(status=f"Model ready (trained in {km.train_seconds:.0f} s). Running {SWEEP_EDITS} "
                              "ROME edits for the R vs accuracy-drop scatter (stored once done)…")
            progress = self.status_reporter(
                token, lambda done, total, s: f"Edit sweep: {done}/{total} edits…", every=0)
            return stored_edit_sweep(km, n_edits=SWEEP_EDITS, progress=progress)

        self.submit("sweep", job)

    def _swept(self, sweep: xr.Dataset) -> None:
        self.param.update(sweep=sweep, status=self._describe(self.km))

    def _at_strength(self) -> tuple[xr.Dataset, xr.Dataset] | None:
        """The embedding and fact accuracy at the current strength (cached per strength and projection)."""
        if self.km is None or self.edit is None:
            return None
        strength, projection = round(float(self.strength), 4), self.projection
        km, edit = self.km, self.edit

        def compute() -> tuple[xr.Dataset, xr.Dataset]:
            skip = [(edit.entity, edit.relation)]
            acc = fact_accuracy(km, edited_model(km, edit, strength), exclude=skip)
            emb = edit_embedding(km, edit, [0.0, strength], projection=projection,
                                 n_components=min(3, km.graph.n_entities - 1, km.params["d_model"]))
            return emb, acc
        return self.cached("strengths", (strength, projection), compute)

    # -- reproducibility -------------------------------------------------------------------
    def export_datasets(self) -> dict[str, xr.Dataset]:
        """The sweep, and the edit's embedding and fact accuracy at the current strength."""
        out = super().export_datasets()
        at = self._at_strength()
        if at is not None:
            out["embedding"], out["accuracy"] = at
        return out

    def code_recipe(self) -> Recipe:
        """The shown edit (its record's fact, method and block), its embedding and accuracy
        at the current strength as records."""
        km, edit, rec = self.km, self.edit, self.edit_record
        if km is None or edit is None or rec is None:
            return Recipe(steps=[Note("The knowledge-graph model is still loading.")])
        shown = dict(rec.request)
        sh, layer, method = "explorer.analyses.shattering", shown["layer"], shown["method"]
        if self._km_file is not None:
            steps: list[Step] = [Call("km", f"{sh}.load_knowledge_model", (str(self._km_file),))]
        else:
            steps = [Call("km", f"{sh}.knowledge_model", (), dict(km.params),
                          "from the cache folder, or trained (seeded) and stored")]
        steps.append(Expr("graph", "km.graph"))
        cov = {}
        if method in ("rome", "memit"):
            covariance = [Call(None, f"{sh}.key_covariance", (Ref("km"), b))
                          for b in range(layer + 1)]
            steps.append(Let("cov", covariance[-1] if method == "rome"
                             else dict(enumerate(covariance))))
            cov = {"cov": Ref("cov")}
        strength = round(float(self.strength), 4)
        steps += [
            Call("edit", f"{sh}.edit_fact", (
                Ref("km"), Call(None, "graph.entity_names.index", (shown["entity"],)),
                Call(None, "graph.relation_names.index", (shown["relation"],)),
                shown["distance"]), {"method": method, "layer": layer, **cov}),
            Call("embedding", f"{sh}.edit_embedding", (Ref("km"), Ref("edit"), [0.0, strength]),
                 {"projection": self.projection,
                  "n_components": min(3, km.graph.n_entities - 1, km.params["d_model"])},
                 "R at the strength: embedding['R'][-1]"),
            Call("accuracy", f"{sh}.fact_accuracy", (Ref("km"), Call(
                None, f"{sh}.edited_model", (Ref("km"), Ref("edit"), strength))),
                {"exclude": [Ref("(edit.entity, edit.relation)")]})]
        return Recipe(steps=steps)

    @param.depends("edit", "strength", "projection")
    def embedding(self) -> xr.Dataset | None:
        """`edit_embedding` of the current edit at strengths 0 and the slider's value."""
        out = self._at_strength()
        return None if out is None else out[0]

    @param.depends("edit", "strength", "order", "projection", "axes")
    def _embedding_plot(self) -> hv.Element:
        return plot_embedding(self.embedding(), self.order, AXES[self.axes])

    @param.depends("sweep", "edit", "strength")
    def _scatter_plot(self) -> hv.Element:
        out = self._at_strength()
        current = None
        if out is not None and self.sweep is not None:
            emb, acc = out
            before = self.sweep["accuracy_before"].sel(split="all").item()
            current = (float(emb["R"].values[-1]), before - float(acc["accuracy"].sel(split="all")))
        return plot_shattering_scatter(self.sweep, current)

    @param.depends("edit", "strength")
    def summary(self) -> str:
        """One line on the edit at the current strength: the facts, R, the accuracy change."""
        out = self._at_strength()
        if out is None:
            return "Waiting for the model and the edit…"
        emb, acc = out
        e = emb.attrs["edit"]
        pred = self.km.graph.entity_names[int(acc["prediction"].values[self.edit.entity, self.edit.relation])]
        base = fact_accuracy(self.km, exclude=[(self.edit.entity, self.edit.relation)])["accuracy"]
        parts = ", ".join(f"{s} {float(base.sel(split=s)):.0%} → {float(acc['accuracy'].sel(split=s)):.0%}"
                          for s in ("direct", "logical", "compositional"))
        return (f"**{e['entity']} {e['relation']}**: {e['true_object']} → {e['new_object']} (distance "
                f"{e['distance']}), {e['method']} at {self._blocks(e)}, strength {float(self.strength):.2f}: "
                f"**R = {float(emb['R'].values[-1]):.3f}**; the model now answers {pred}. Accuracy on the "
                f"other facts: {parts}.")

    @staticmethod
    def _blocks(e: dict[str, Any]) -> str:
        layers = e.get("layers", [e["layer"]])
        return f"block {layers[0]}" if len(layers) == 1 else "blocks " + ", ".join(map(str, layers))

    # -- layout --------------------------------------------------------------------------
    def controls(self) -> pn.Column:
        toggle = {"type": pn.widgets.RadioButtonGroup, "color": "primary", "variant": "outline"}
        widgets = {
            "method": toggle,
            "entity": {"type": pn.widgets.Select},
            "relation": {"type": pn.widgets.Select},
            "distance": {"type": pn.widgets.IntSlider},
            "strength": {"type": pn.widgets.FloatSlider},
            "order": {"type": pn.widgets.Select},
            "projection": toggle,
            "axes": toggle,
            "layer": {"type": pn.widgets.IntSlider},
        }
        retrain = pn.widgets.Button.from_param(self.param.retrain, color="default",
                                               description=self.param.retrain.doc,
                                               sizing_mode="stretch_width", margin=(20, 10, 5, 10))
        bar = self.progress_bar(height=12, margin=(0, 10))
        return pn.Column(*labelled_controls(self, widgets), retrain, bar, width=theme.SIZES["controls_width"],
                         css_classes=["shattering-controls"])

    def __panel__(self) -> pn.viewable.Viewable:
        spinner = self.busy_spinner()
        status = pn.pane.Markdown(self.param.status, styles={"color": "#555"}, margin=(6, 10),
                                  sizing_mode="stretch_width", css_classes=["shattering-status"])
        summary = pn.pane.Markdown(self.summary, css_classes=["shattering-summary"],
                                   sizing_mode="stretch_width")
        p = self.param
        stale = stale_pane(self.stale_note, [p.edit_record, p.error, p.km, *[
            p[n] for n in ("method", "entity", "relation", "distance", "layer")]],
            "shattering-stale")
        embedding = pn.pane.HoloViews(self._embedding_plot, sizing_mode="stretch_width",
                                      css_classes=["shattering-embedding"])
        scatter = pn.pane.HoloViews(self._scatter_plot, sizing_mode="stretch_width",
                                    css_classes=["shattering-scatter"])
        caption = pn.pane.Markdown(pn.bind(scatter_caption, self.param.sweep), styles={"color": "#555"},
                                   sizing_mode="stretch_width", css_classes=["shattering-caption"])
        return pn.Row(self.controls(),
                      pn.Column(pn.Row(spinner, status, sizing_mode="stretch_width"),
                                paper_panel("shattering", self), stale, summary, embedding,
                                scatter, caption, sizing_mode="stretch_width"),
                      sizing_mode="stretch_width")


serve(__name__, ShatteringView, title=f"{theme.TITLE}: representation shattering", model=False, intro="shattering")
