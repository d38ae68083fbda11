"""Evidence for docs/circuit_lora.md: circuits through LoRA fine-tuning, CircuitLoRA vs LoRA.

Circuits through LoRA fine-tuning and CircuitLoRA vs uniform LoRA at the same
trainable-parameter count, on the packaged SmolLM2-135M.

Stages (``--threads 1`` by default, fastest on a busy machine)::

    python benchmarks/circuit_lora_evidence.py                    # train, then report
    python benchmarks/circuit_lora_evidence.py --stages train &   # more workers on the
    python benchmarks/circuit_lora_evidence.py --stages train &   # same --folder share
    python benchmarks/circuit_lora_evidence.py --stages report    # the jobs, then report
    python benchmarks/circuit_lora_evidence.py --stages screenshot

``train`` works through the jobs of the study, each saved as ``{folder}/jobs/{name}.json``
as soon as it is done (a rerun skips finished jobs; several ``train`` processes on the same
folder share the jobs out, each claiming one at a time):

1. ``probe``: a cheap rank-2 LoRA on every layer (the paper's step 1), adapter checkpoints;
   the circuit (``--method``: EAP-IG on KL by default, or EAP; top 5 % of edges,
   ``--n-circuit`` problem pairs) of each checkpoint;
   node / edge Jaccard against step 0; the prompt-sampling noise floor (circuits of the same
   model on other samples of pairs: three at step 0, two at the last step); the per-layer
   edge change D_l of each checkpoint against step 0 and between two prompt samples; the
   top ``--k`` layers of D_l (step 0 -> last) are the critical layers.
2. the learning-rate sweep: uniform LoRA (rank ``--rank``) and CircuitLoRA (``--r-other``
   outside the critical layers, the rest of uniform LoRA's parameter count on them), each
   trained with the first seed at every ``--lrs`` value and scored on the validation split;
   `circuit_lora.select_lr` picks each variant's rate (highest validation accuracy).
3. the other seeds at each variant's chosen rate.

Every job scores the held-out test split too; the report uses test accuracy only at the
chosen rate. ``report`` writes ``docs/figures/circuit_lora_summary.json`` and the figures
``circuit_lora_similarity.png``, ``circuit_lora_edge_change.png`` and
``circuit_lora_accuracy.png``. ``screenshot`` photographs the Circuits page on the probe run
(``docs/figures/circuit_lora_page.png``).

Problems: ``circuits.make_task("add", n_train + n_val + n_test, seed=0)`` split in that
order (distinct problems); circuit pairs are ``make_task("add", n_circuit, seed=1)`` (noise
samples seeds 2 and 3).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

import _figures  # benchmarks/_figures.py, beside this script
from explorer.defaults import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "circuit_lora_summary.json"
VARIANTS = ("lora", "circuit-lora")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def default_folder() -> Path:
    from explorer.models import cache_dir

    return cache_dir() / "circuit_lora" / "evidence"


def splits(args: argparse.Namespace) -> tuple[tuple, tuple, tuple]:
    from explorer.analyses import circuits as ca

    data = ca.make_task(args.task, args.n_train + args.n_val + args.n_test, seed=0)
    p, a = list(data.clean), list(data.answer)
    i, j = args.n_train, args.n_train + args.n_val
    return (p[:i], a[:i]), (p[i:j], a[i:j]), (p[j:], a[j:])


# -- jobs --------------------------------------------------------------------------------------

def job_name(variant: str, lr: float, seed: int) -> str:
    return f"{variant}_lr{lr:g}_seed{seed}"


def job_list(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(name, spec) in the order one worker runs them; spec["needs"] lists job names or
    "sweep:{variant}" (all of that variant's sweep jobs)."""
    seeds, lrs = ints(args.seeds), floats(args.lrs)
    jobs = [("probe", {"kind": "probe", "needs": []})]
    for variant in VARIANTS:
        needs = ["probe"] if variant == "circuit-lora" else []
        jobs += [(job_name(variant, lr, seeds[0]),
                  {"kind": "train", "variant": variant, "lr": lr, "seed": seeds[0], "needs": needs})
                 for lr in lrs]
    for seed in seeds[1:]:
        for variant in VARIANTS:
            jobs.append((f"{variant}_chosen_seed{seed}",
                         {"kind": "train", "variant": variant, "lr": None, "seed": seed,
                          "needs": [f"sweep:{variant}"] + (["probe"] if variant == "circuit-lora"
                                                           else [])}))
    jobs.append(("probe_circuits", {"kind": "probe_circuits", "needs": ["probe"]}))
    jobs.append(("base", {"kind": "base", "needs": []}))
    if args.jobs:
        wanted = args.jobs.split(",")
        jobs = [j for j in jobs if j[0] in wanted]
    return jobs


def chosen_lr(folder: Path, variant: str, args: argparse.Namespace) -> tuple[float, list[dict]]:
    from explorer.analyses import circuit_lora as cl

    seed0, lrs = ints(args.seeds)[0], floats(args.lrs)
    rows = [json.loads((folder / "jobs" / f"{job_name(variant, lr, seed0)}.json").read_text())
            for lr in lrs]
    lr = cl.select_lr(lrs, [r["val_accuracy"] for r in rows], [r["val_loss"] for r in rows])
    return lr, rows


def ready(folder: Path, spec: dict, args: argparse.Namespace) -> bool:
    for need in spec["needs"]:
        if need.startswith("sweep:"):
            variant = need.split(":", 1)[1]
            names = [job_name(variant, lr, ints(args.seeds)[0]) for lr in floats(args.lrs)]
        else:
            names = [need]
        if not all((folder / "jobs" / f"{n}.json").exists() for n in names):
            return False
    return True


def plans(model, folder: Path, args: argparse.Namespace) -> dict[str, dict[int, int]]:
    from explorer.analyses import circuit_lora as cl

    uniform = cl.uniform_lora_ranks(model, args.rank)
    out = {"lora": uniform}
    probe_file = folder / "jobs" / "probe.json"
    if probe_file.exists():
        critical = json.loads(probe_file.read_text())["critical"]
        alloc = cl.allocate_lora_ranks(model, cl.lora_parameter_count(model, uniform), critical,
                                       r_other=args.r_other)
        out["circuit-lora"] = {int(l): int(r) for l, r in zip(alloc.layer.values,
                                                              alloc["rank"].values)}
    return out


def run_train(model, folder: Path, spec: dict, args: argparse.Namespace) -> dict:
    from explorer.analyses import circuit_lora as cl

    variant, seed = spec["variant"], spec["seed"]
    lr = spec["lr"] if spec["lr"] is not None else chosen_lr(folder, variant, args)[0]
    ranks = plans(model, folder, args)[variant]
    train, val, test = splits(args)
    t0, c0 = time.perf_counter(), time.process_time()
    ds, peft_model = cl.finetune_lora(model, *train, ranks=ranks, steps=args.steps,
                                      batch_size=args.batch_size, lr=lr, seed=seed,
                                      warmup=args.warmup, schedule=args.schedule)
    ev_val = cl.answer_accuracy(model, *val, hf=peft_model)
    ev_test = cl.answer_accuracy(model, *test, hf=peft_model)
    return {"variant": variant, "lr": lr, "seed": seed,
            "val_accuracy": ev_val.attrs["accuracy"], "val_loss": ev_val.attrs["loss"],
            "test_accuracy": ev_test.attrs["accuracy"], "test_loss": ev_test.attrs["loss"],
            "test_token_accuracy": ev_test.attrs["token_accuracy"],
            "trainable_params": int(ds.attrs["trainable_params"]),
            "parameter_count_formula": cl.lora_parameter_count(model, ranks),
            "ranks": [int(ranks.get(l, 0)) for l in range(model.n_layers)],
            "train_loss": [round(float(x), 4) for x in ds["loss"].values],
            "cpu_seconds_per_step": float(statistics.median(ds["step_cpu_seconds"].values)),
            "seconds_per_step": float(statistics.median(ds["step_seconds"].values)),
            "wall_seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "load_average": os.getloadavg()}


def circuit_scoring(args: argparse.Namespace) -> dict:
    """The edge method and metric of every circuit of the run (checkpoints and noise floor):
    EAP-IG on KL (Wang et al.'s), or EAP on the logit difference."""
    from explorer.analyses import circuit_lora as cl

    if args.method == "eap-ig":
        return {"method": "eap-ig", "metric": cl.CHECKPOINT_METRIC}
    return {"method": "eap", "metric": "logit_diff"}


def _circuit_tools(model, args: argparse.Namespace, top_n: int):
    from explorer.analyses import circuit_lora as cl
    from explorer.analyses import circuits as ca

    def circuit_on(m, seed):
        # the prompt-resampling noise floor: the checkpoints' own scoring (`--method`)
        s = ca.edge_scores(m, ca.make_task(args.task, args.n_circuit, seed=seed),
                           batch_size=8, **circuit_scoring(args))
        return s.assign(in_circuit=ca.select_circuit(s, top_n=top_n))

    def pair(a, b):
        sa, sb = a["in_circuit"].values, b["in_circuit"].values
        return {"node_jaccard": cl.jaccard(ca.circuit_nodes(a, sa), ca.circuit_nodes(b, sb)),
                "edge_jaccard": cl.jaccard(ca.circuit_edges(a, sa), ca.circuit_edges(b, sb))}

    def change(a, b):
        return cl.layer_edge_change(a, b, n_layers=model.n_layers)["edge_change"].values.tolist()

    return circuit_on, pair, change


def run_probe(model, folder: Path, args: argparse.Namespace) -> dict:
    """The paper's step 1: a cheap rank-2 LoRA with checkpoints; circuits of the first and
    last checkpoint; D_l between them; the top-k critical layers."""
    import numpy as np

    from explorer.analyses import circuit_lora as cl
    from explorer.analyses import circuits as ca

    train = splits(args)[0]
    run = folder / "probe"
    ckpts = ints(args.probe_checkpoints)
    t0, c0 = time.perf_counter(), time.process_time()
    ds, peft_model = cl.finetune_lora(model, *train, ranks=cl.uniform_lora_ranks(model, 2),
                                      steps=args.steps, batch_size=args.batch_size,
                                      lr=args.probe_lr, seed=0, warmup=args.warmup,
                                      schedule=args.schedule, checkpoints=ckpts, folder=run)
    del peft_model
    t_train = time.perf_counter() - t0
    log(f"probe trained: {t_train:.0f} s, {float(np.median(ds.step_cpu_seconds)):.2f} s CPU/step")
    task = ca.make_task(args.task, args.n_circuit, seed=1)
    ends = cl.checkpoint_circuits(model, run, task, steps=[ckpts[0], ckpts[-1]], batch_size=8,
                                  top_percent=5.0, **circuit_scoring(args))
    change = cl.layer_edge_change(ends.isel(checkpoint=0), ends.isel(checkpoint=-1),
                                  n_layers=model.n_layers)["edge_change"].values
    return {"rank": 2, "lr": args.probe_lr, "checkpoints": ckpts,
            "train_loss": [round(float(x), 4) for x in ds["loss"].values],
            "cpu_seconds_per_step": float(np.median(ds.step_cpu_seconds)),
            "seconds_per_step": float(np.median(ds.step_seconds)),
            "edge_change_first_last": change.tolist(),
            "critical": cl.critical_layers(change, k=args.k),
            "seconds": {"train": t_train, "circuits": time.perf_counter() - t0 - t_train},
            "cpu_seconds": time.process_time() - c0, "load_average": os.getloadavg()}


def run_base(model, folder: Path, args: argparse.Namespace) -> dict:
    """The model before fine-tuning on the validation and test splits."""
    from explorer.analyses import circuit_lora as cl

    _, val, test = splits(args)
    ev_val, ev_test = cl.answer_accuracy(model, *val), cl.answer_accuracy(model, *test)
    return {"val_accuracy": ev_val.attrs["accuracy"], "val_loss": ev_val.attrs["loss"],
            "test_accuracy": ev_test.attrs["accuracy"], "test_loss": ev_test.attrs["loss"]}


def run_probe_circuits(model, folder: Path, args: argparse.Namespace) -> dict:
    """Circuits of every probe checkpoint, node / edge Jaccard vs step 0, the prompt-sampling
    noise floor (three samples at step 0, two at the last step), D_l of every checkpoint vs
    step 0 and between two prompt samples, and the probe's accuracy at each checkpoint."""
    from explorer.analyses import circuit_lora as cl
    from explorer.analyses import circuits as ca

    val = splits(args)[1]
    run = folder / "probe"
    ckpts = ints(args.probe_checkpoints)
    t0, c0 = time.perf_counter(), time.process_time()
    acc = []
    for step in ckpts:
        m = cl.load_checkpoint(model, run, step)
        ev = cl.answer_accuracy(m, *val)
        acc.append({"step": step, "val_accuracy": ev.attrs["accuracy"], "val_loss": ev.attrs["loss"]})
        del m
    task = ca.make_task(args.task, args.n_circuit, seed=1)
    circuits = cl.checkpoint_circuits(model, run, task, batch_size=8, top_percent=5.0,
                                      progress=lambda i, n: log(f"circuit {i}/{n}"),
                                      **circuit_scoring(args))
    cl.save_netcdf(circuits, run / "circuits.nc")
    sim = cl.circuit_similarity(circuits)
    top_n = int(round(0.05 * circuits.sizes["edge"]))
    circuit_on, pair, change_of = _circuit_tools(model, args, top_n)
    first, last = circuits.isel(checkpoint=0), circuits.isel(checkpoint=-1)
    base = {1: first, 2: circuit_on(model, 2), 3: circuit_on(model, 3)}  # step 0 = base model
    final_model = cl.load_checkpoint(model, run, ckpts[-1])
    final = {1: last, 2: circuit_on(final_model, 2)}
    del final_model
    return {
        "checkpoints": ckpts, "accuracy": acc, "n_circuit": args.n_circuit, "top_n": top_n,
        "n_graph_edges": int(circuits.sizes["edge"]),
        "node_jaccard": sim.node_jaccard.values.round(4).tolist(),
        "edge_jaccard": sim.edge_jaccard.values.round(4).tolist(),
        "n_nodes": sim.n_nodes.values.tolist(), "n_edges": sim.n_edges.values.tolist(),
        "noise_base": {f"{i}-{j}": pair(base[i], base[j]) for i, j in ((1, 2), (1, 3), (2, 3))},
        "noise_final": {"1-2": pair(final[1], final[2])},
        "edge_change": [change_of(first, circuits.isel(checkpoint=k)) for k in range(len(ckpts))],
        "edge_change_noise": {"base_1_2": change_of(base[1], base[2]),
                              "final_1_2": change_of(final[1], final[2])},
        "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
        "load_average": os.getloadavg()}


def stage_train(args: argparse.Namespace, folder: Path) -> None:
    import torch

    from explorer import load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    jobs_dir = folder / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(json.dumps(settings(args), indent=1))
    while True:
        pending = [(n, s) for n, s in job_list(args) if not (jobs_dir / f"{n}.json").exists()]
        if not pending:
            return
        started = False
        for name, spec in pending:
            if not ready(folder, spec, args):
                continue
            try:  # claim the job: only one worker creates the claim file
                os.close(os.open(jobs_dir / f"{name}.claim", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            log(f"job {name} (load {os.getloadavg()[0]:.1f})")
            run = {"probe": run_probe, "probe_circuits": run_probe_circuits,
                   "base": run_base}.get(spec["kind"])
            result = (run(model, folder, args) if run is not None
                      else run_train(model, folder, spec, args))
            (jobs_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
            log(f"job {name} done: " + (f"test {result['test_accuracy']:.3f}, val "
                                        f"{result['val_accuracy']:.3f}" if "test_accuracy" in result
                                        else f"critical {result.get('critical')}"))
            started = True
            break
        if not started:
            if all((jobs_dir / f"{n}.claim").exists() for n, _ in pending):
                return  # the rest are running in other workers
            time.sleep(20)


def settings(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("stages", "folder", "jobs")}


# -- report ------------------------------------------------------------------------------------

def mean_sd(xs: list[float]) -> tuple[float, float]:
    return float(statistics.mean(xs)), (float(statistics.stdev(xs)) if len(xs) > 1 else 0.0)


def stage_report(args: argparse.Namespace, folder: Path) -> dict:
    import torch

    from explorer import load_model
    from explorer.analyses import circuit_lora as cl

    torch.set_num_threads(args.threads)
    jobs = folder / "jobs"
    probe = json.loads((jobs / "probe.json").read_text())
    circ = json.loads((jobs / "probe_circuits.json").read_text())
    timing = ("seconds", "cpu_seconds", "load_average")
    probe.update({k: v for k, v in circ.items() if k not in timing})
    probe["circuits_job"] = {k: circ[k] for k in timing}
    seeds = ints(args.seeds)
    model = load_model(args.model)
    base = json.loads((jobs / "base.json").read_text())
    comparison = {"seeds_requested": seeds, "base_accuracy": base["test_accuracy"],
                  "base_loss": base["test_loss"], "base_val_accuracy": base["val_accuracy"], "critical": probe["critical"], "variants": {}}
    for variant in VARIANTS:
        lr, sweep = chosen_lr(folder, variant, args)
        runs = [json.loads((jobs / f"{job_name(variant, lr, seeds[0])}.json").read_text())]
        for seed in seeds[1:]:
            f = jobs / f"{variant}_chosen_seed{seed}.json"
            if f.exists():
                runs.append(json.loads(f.read_text()))
        acc, loss = [r["test_accuracy"] for r in runs], [r["test_loss"] for r in runs]
        comparison["variants"][variant] = {
            "lr": lr, "seeds": [r["seed"] for r in runs], "test_accuracy": acc,
            "test_accuracy_mean_sd": mean_sd(acc), "test_loss": loss,
            "test_loss_mean_sd": mean_sd(loss),
            "test_token_accuracy_mean": statistics.mean(r["test_token_accuracy"] for r in runs),
            "trainable_params": runs[0]["trainable_params"], "ranks": runs[0]["ranks"],
            "final_train_loss_mean": statistics.mean(
                statistics.mean(r["train_loss"][-10:]) for r in runs),
            "sweep": [{k: r[k] for k in ("lr", "val_accuracy", "val_loss", "test_accuracy")}
                      for r in sweep],
            "cpu_seconds_per_step": statistics.median(r["cpu_seconds_per_step"] for r in runs),
            "seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs),
            "load_average": [r["load_average"][0] for r in runs]}
    summary = {"model": args.model, "task": args.task, "folder": str(folder),
               "settings": settings(args), "probe": probe, "comparison": comparison,
               "citation": cl.CITATION}
    figures(summary, model.n_layers)
    return summary


def figures(summary: dict, n_layers: int) -> None:
    import holoviews as hv
    import numpy as np

    hv.extension("bokeh", logo=False)
    probe = summary["probe"]
    steps = probe["checkpoints"]
    node = [row[0] for row in probe["node_jaccard"]]
    edge = [row[0] for row in probe["edge_jaccard"]]
    nb = [v["node_jaccard"] for v in probe["noise_base"].values()]
    eb = [v["edge_jaccard"] for v in probe["noise_base"].values()]
    nf = [v["node_jaccard"] for v in probe["noise_final"].values()]
    ef = [v["edge_jaccard"] for v in probe["noise_final"].values()]
    blue, orange = "#1f77b4", "#d95f02"
    opts = dict(width=560, height=380, show_grid=True, tools=["hover"])
    curves = (hv.Curve((steps, node), "step", "Jaccard vs step 0", label="nodes").opts(color=blue, line_width=2)
              * hv.Scatter((steps, node), "step", "Jaccard vs step 0").opts(color=blue, size=7)
              * hv.Curve((steps, edge), "step", "Jaccard vs step 0", label="edges").opts(color=orange, line_width=2)
              * hv.Scatter((steps, edge), "step", "Jaccard vs step 0").opts(color=orange, size=7)
              * hv.HSpan(min(nb), max(nb)).opts(color=blue, alpha=0.18)
              * hv.HSpan(min(eb), max(eb)).opts(color=orange, alpha=0.18)
              * hv.Scatter(([steps[-1]] * len(nf), nf), "step", "Jaccard vs step 0",
                           label="nodes, noise at last step").opts(color=blue, marker="x", size=12)
              * hv.Scatter(([steps[-1]] * len(ef), ef), "step", "Jaccard vs step 0",
                           label="edges, noise at last step").opts(color=orange, marker="x", size=12))
    curves = curves.opts(hv.opts.Overlay(
        title="Circuit overlap with step 0 (bands, x: prompt-sampling noise)",
        legend_position="bottom_left", **opts)).redim.range(**{"Jaccard vs step 0": (0, 1.02)})
    acc = [a["val_accuracy"] for a in probe["accuracy"]]
    acc_plot = (hv.Curve(([a["step"] for a in probe["accuracy"]], acc), "step", "accuracy")
                * hv.Scatter(([a["step"] for a in probe["accuracy"]], acc), "step", "accuracy")
                ).opts(hv.opts.Curve(color="#444", line_width=2), hv.opts.Scatter(color="#444", size=7),
                       hv.opts.Overlay(title="Probe accuracy (validation split)", width=380,
                                       height=380, show_grid=True)).redim.range(accuracy=(0, 1.02))
    _figures.render_png((curves + acc_plot).cols(2), FIGURES / "circuit_lora_similarity.png",
                        width=1000, height=420)
    change = np.array(probe["edge_change"])  # [checkpoint, layer]
    layers = np.arange(n_layers)
    crit = set(probe["critical"])
    bars = hv.Bars([(str(l), v, "critical" if l in crit else "other")
                    for l, v in zip(layers, change[-1])], ["layer"], ["D_l", "kind"]).opts(
        color="kind", cmap={"critical": orange, "other": blue}, width=640, height=360,
        title=f"Edge change D_l, step {steps[0]} -> {steps[-1]} (line: two prompt samples, same model)",
        xrotation=0, show_grid=True, tools=["hover"], show_legend=False)
    noise = (hv.Curve([(str(l), v) for l, v in zip(layers, probe["edge_change_noise"]["base_1_2"])],
                      "layer", "D_l", label="base, prompt noise").opts(color="#222", line_dash="dashed")
             * hv.Curve([(str(l), v) for l, v in zip(layers, probe["edge_change_noise"]["final_1_2"])],
                        "layer", "D_l", label=f"step {steps[-1]}, prompt noise").opts(color="#888"))
    heat = hv.HeatMap([(str(s), l, float(change[i, l])) for i, s in enumerate(steps)
                       for l in layers], ["step", "layer"], "D_l").opts(
        cmap="viridis", colorbar=True, width=420, height=360, tools=["hover"],
        title="D_l of each checkpoint vs step 0")
    _figures.render_png(((bars * noise).opts(legend_position="top_right") + heat).cols(2),
                        FIGURES / "circuit_lora_edge_change.png", width=1100, height=400)
    comp = summary["comparison"]
    pts, sweep = [], []
    for variant, row in comp["variants"].items():
        for s, a in zip(row["seeds"], row["test_accuracy"]):
            pts.append((variant, a, s))
        for r in row["sweep"]:
            sweep.append((variant, r["lr"], r["val_accuracy"]))
    values = [p[1] for p in pts] + [a for _, _, a in sweep]
    low = max(0.0, min(values) - 0.04)
    scatter = hv.Scatter(pts, "variant", ["test accuracy", "seed"]).opts(
        size=11, color="seed", cmap="Category10", width=380, height=360, show_grid=True,
        tools=["hover"], title="Held-out accuracy per seed (chosen lr)", jitter=0.15)
    means = hv.ErrorBars([(v, r["test_accuracy_mean_sd"][0], r["test_accuracy_mean_sd"][1])
                          for v, r in comp["variants"].items()], "variant",
                         ["test accuracy", "sd"]).opts(line_width=2, color="#222")
    sw = hv.Overlay([hv.Curve([(lr, a) for v, lr, a in sweep if v == variant], "lr",
                              "validation accuracy", label=variant).opts(
        color=c, line_width=2) * hv.Scatter([(lr, a) for v, lr, a in sweep if v == variant],
                                            "lr", "validation accuracy").opts(color=c, size=8)
        for variant, c in zip(VARIANTS, (blue, orange))]).opts(
        logx=True, xticks=[(lr, f"{lr:g}") for lr in sorted({lr for _, lr, _ in sweep})],
        xlim=(0.7 * min(lr for _, lr, _ in sweep), 1.4 * max(lr for _, lr, _ in sweep)),
        width=460, height=360, show_grid=True, legend_position="bottom_right",
        title="Learning-rate sweep (seed 0)")
    sw = sw.redim.range(**{"validation accuracy": (low, 1.0)})
    _figures.render_png(((scatter * means).redim.range(**{"test accuracy": (low, 1.0)}) + sw).cols(2),
                        FIGURES / "circuit_lora_accuracy.png", width=900, height=400)


def stage_screenshot(args: argparse.Namespace, folder: Path) -> None:
    from playwright.sync_api import sync_playwright

    run = folder / "probe"
    checkpoint = len(ints(args.probe_checkpoints)) - 1
    code = textwrap.dedent(f"""
        import torch
        torch.set_num_threads(1)
        import panel as pn
        from apps import theme
        from apps.circuits import CircuitsView
        from explorer import load_model

        model = load_model({args.model!r})
        theme.enable_extension()

        def app():
            view = CircuitsView(model, run_folder={str(run)!r}, autostart=False, n_edges=120,
                                checkpoint={checkpoint}, diff=True)
            return theme.page([view], title="Circuits")

        pn.serve({{"circuits": app}}, port=PORT, address="127.0.0.1", threaded=True,
                 show=False).join()
    """)
    with _figures.page_server(code) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_figures.CHROMIUM, headless=True,
                                    args=_figures.CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(f"{url}/circuits", timeout=120_000)
        page.locator(".circuit-state").first.wait_for(state="attached", timeout=300_000)
        page.wait_for_selector("canvas", state="attached", timeout=120_000)
        time.sleep(4)
        FIGURES.mkdir(exist_ok=True)
        page.screenshot(path=str(FIGURES / "circuit_lora_page.png"), full_page=True)
        browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--stages", default="train,report",
                    help="comma-separated: train, report, screenshot")
    ap.add_argument("--folder", default=None,
                    help="run folder (jobs, probe checkpoints); default under the cache")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--task", default="add")
    ap.add_argument("--method", default="eap-ig", choices=("eap", "eap-ig"),
                    help="edge scoring of the checkpoint circuits and of the prompt-resampling "
                         "noise floor (eap-ig: on KL, the paper's; eap: on the logit difference)")
    ap.add_argument("--n-train", type=int, default=800)
    ap.add_argument("--n-val", type=int, default=100, help="learning-rate selection split")
    ap.add_argument("--n-test", type=int, default=300, help="held-out problems")
    ap.add_argument("--n-circuit", type=int, default=24, help="problem pairs per circuit")
    ap.add_argument("--steps", type=int, default=100, help="training steps of every run")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    ap.add_argument("--schedule", default="linear", choices=("constant", "linear"))
    ap.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="learning-rate sweep")
    ap.add_argument("--probe-lr", type=float, default=1e-3)
    ap.add_argument("--probe-checkpoints", default="0,10,25,50,75,100")
    ap.add_argument("--rank", type=int, default=4, help="uniform LoRA rank")
    ap.add_argument("--r-other", type=int, default=2, help="CircuitLoRA rank outside critical layers")
    ap.add_argument("--k", type=int, default=5, help="critical layers")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="the first one runs the sweep")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", default="",
                    help="train: run only these jobs (comma-separated names; default all)")
    args = ap.parse_args()
    folder = Path(args.folder) if args.folder else default_folder()
    stages = args.stages.split(",")
    if "train" in stages:
        stage_train(args, folder)
    if "report" in stages:
        summary = stage_report(args, folder)
        FIGURES.mkdir(exist_ok=True)
        SUMMARY.write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary["comparison"], indent=1))
    if "screenshot" in stages:
        stage_screenshot(args, folder)


if __name__ == "__main__":
    main()
