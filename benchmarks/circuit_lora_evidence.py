"""Evidence for the "Fine-tuning" section of docs/circuits.md: circuits through LoRA
fine-tuning and CircuitLoRA vs uniform LoRA at the same trainable-parameter count.

Stages (each one process; ``--threads 1`` by default, fastest on a busy machine)::

    python benchmarks/circuit_lora_evidence.py --stages run        # SmolLM2, the study
    python benchmarks/circuit_lora_evidence.py --stages noise --n-circuit 24  # noise floor
    python benchmarks/circuit_lora_evidence.py --stages screenshot # the Circuits page

``run`` calls `explorer.analyses.circuit_lora.run_summary` on the packaged SmolLM2 (the
add task of Wang et al.'s prompt): a rank-2 LoRA probe with adapter checkpoints, the EAP
circuit (top 5 % of edges) of each checkpoint, node / edge Jaccard, the per-layer edge
change and its top-k critical layers, then uniform LoRA (rank 4) vs CircuitLoRA
(r_other 2, the rest on the critical layers, same parameter count) over several seeds.
It writes ``docs/figures/circuit_lora_summary.json``; the run folder (checkpoints,
``circuits.nc``, ``comparison.nc``) stays in the cache. ``noise`` re-scores the saved
checkpoints on more pairs and measures the Jaccard between two prompt samples of the base
model (how much of the edge turnover sampling alone gives). ``screenshot`` serves the Circuits
page on that run and saves ``docs/figures/circuit_lora_page.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

import _figures  # benchmarks/_figures.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "circuit_lora_summary.json"


def stage_run(args: argparse.Namespace) -> dict:
    import torch

    from explorer import load_model
    from explorer.analyses import circuit_lora as cl

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    t0 = time.perf_counter()
    summary = cl.run_summary(
        model, task=args.task, n_train=args.n_train, n_test=args.n_test,
        n_circuit=args.n_circuit, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        probe_rank=2, rank=args.rank, r_other=args.r_other, k=args.k, top_percent=5.0,
        method="eap", seeds=[int(s) for s in args.seeds.split(",")],
        n_checkpoints=args.checkpoints, folder=args.folder,
        log=lambda s: print(s, file=sys.stderr, flush=True))
    summary["wall_seconds"] = time.perf_counter() - t0
    summary["settings"] = {k: v for k, v in vars(args).items() if k != "stages"}
    return summary


def stage_noise(args: argparse.Namespace, summary: dict) -> dict:
    """Circuits of the saved checkpoints on ``--n-circuit`` pairs, and the noise floor: the
    node / edge Jaccard between circuits of the base model on two other prompt samples."""
    import torch

    from explorer import load_model
    from explorer.analyses import circuit_lora as cl
    from explorer.analyses import circuits as ca

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    folder = summary["folder"]
    t0 = time.perf_counter()
    circuits = cl.checkpoint_circuits(model, folder, ca.make_task(args.task, args.n_circuit, seed=1),
                                      batch_size=8, top_percent=5.0)
    sim = cl.circuit_similarity(circuits)
    sets = []
    for seed in (2, 3):
        s = ca.edge_scores(model, ca.make_task(args.task, args.n_circuit, seed=seed), batch_size=8)
        c = ca.select_circuit(s, top_n=int(round(0.05 * s.sizes["edge"])))
        sets.append((ca.circuit_nodes(s, c), ca.circuit_edges(s, c)))
    summary[f"similarity_{args.n_circuit}_pairs"] = {
        "checkpoints": circuits["checkpoint"].values.tolist(),
        "node_jaccard": sim.node_jaccard.values.round(4).tolist(),
        "edge_jaccard": sim.edge_jaccard.values.round(4).tolist(),
        "noise_floor_node_jaccard": cl.jaccard(sets[0][0], sets[1][0]),
        "noise_floor_edge_jaccard": cl.jaccard(sets[0][1], sets[1][1]),
        "seconds": time.perf_counter() - t0}
    return summary


def stage_resummarize(summary: dict) -> dict:
    """Rebuild the comparison table from the run folder's ``comparison.nc``."""
    import xarray as xr

    from explorer.analyses import circuit_lora as cl

    comp = xr.load_dataset(Path(summary["folder"]) / "comparison.nc")
    if "method" in comp.dims:  # files written before the dim was named "variant"
        comp = comp.rename({"method": "variant"})
    summary["comparison"] = cl.comparison_summary(comp)
    return summary


def stage_screenshot(args: argparse.Namespace, summary: dict) -> None:
    from playwright.sync_api import sync_playwright

    folder = summary["folder"]
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
            view = CircuitsView(model, run_folder={folder!r}, autostart=False, n_edges=120,
                                checkpoint=3, diff=True)
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="run,screenshot")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="add")
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-test", type=int, default=48)
    ap.add_argument("--n-circuit", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--r-other", type=int, default=2)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--folder", default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    stages = args.stages.split(",")
    summary = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
    if "run" in stages:
        summary = stage_run(args)
        FIGURES.mkdir(exist_ok=True)
        SUMMARY.write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
    if "noise" in stages:
        summary = stage_noise(args, summary)
        SUMMARY.write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary[f"similarity_{args.n_circuit}_pairs"], indent=1))
    if "resummarize" in stages:
        summary = stage_resummarize(summary)
        SUMMARY.write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary["comparison"], indent=1))
    if "screenshot" in stages:
        stage_screenshot(args, summary)


if __name__ == "__main__":
    main()
