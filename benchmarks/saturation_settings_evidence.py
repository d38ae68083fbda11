"""Evidence for docs/saturation.md: the task probe against depth alone on plain
language-modelling text and on task prompts, and the paper's language-modelling comparison
(rank-2 accuracy where the top-1 is wrong, early vs last-layer s_2).

Two settings of about the same size, each one `saturation_analysis` (no intervention pairs):

* ``text``: the first ``--max-tokens`` tokens of the shipped corpus (`corpus_chunks`), as in
  the depth-baseline run of the doc;
* ``task``: few-shot prompts of the shipped ICL tasks (``--shots`` demonstrations and the
  query with its answer, ``Q: x\\nA: y`` blocks), the same number of tokens.

Writes ``docs/figures/saturation_settings.json``. Usage::

    python benchmarks/saturation_settings_evidence.py --max-tokens 4096 --threads 1
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from explorer.commands._common import add_number_options
from explorer.defaults import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "figures" / "saturation_settings.json"
TASKS = ["antonym", "capitalize", "country-capital", "english-french", "present-past",
         "singular-plural", "person-sport", "uppercase"]


def task_texts(model, *, max_tokens: int, shots: int, seed: int) -> list[str]:
    """Few-shot texts of the ICL tasks, round robin over tasks, until ``max_tokens``."""
    from explorer.analyses.icl_heads import icl_prompts

    texts, total, i = [], 0, 0
    per_task = {t: icl_prompts(t, n_prompts=200, n_shots=shots, seed=seed) for t in TASKS}
    while total < max_tokens:
        t = TASKS[i % len(TASKS)]
        prompt, answer = per_task[t][0][i // len(TASKS)], per_task[t][1][i // len(TASKS)]
        text = f"{prompt} {answer}"
        total += len(model.tokenizer(text, add_special_tokens=False)["input_ids"])
        texts.append(text)
        i += 1
    return texts


def main() -> None:
    ap = argparse.ArgumentParser()
    add_number_options(ap, max_tokens=4096, shots=8)
    ap.add_argument("--settings", default="text,task")
    add_number_options(ap, seed=0, threads=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from explorer import load_model
    from explorer.analyses import saturation as sat
    from explorer.analyses.saturation.language_modelling import rank2_accuracy_by_saturation

    model = load_model(DEFAULT_MODEL)
    out = json.loads(OUT.read_text()) if OUT.exists() else {}
    for setting in args.settings.split(","):
        t0 = time.perf_counter()
        if setting == "text":
            texts = sat.corpus_chunks(model, sat.load_corpus(), max_tokens=args.max_tokens)
        else:
            texts = task_texts(model, max_tokens=args.max_tokens, shots=args.shots,
                               seed=args.seed)
        ds = sat.saturation_analysis(model, texts, n_pairs=0, seed=args.seed)
        summary = sat.saturation_summary(ds)
        lm = rank2_accuracy_by_saturation(ds.sat_layer.values, ds.final_token_id.values,
                                          ds.next_token_id.values, model.n_layers,
                                          seed=args.seed)
        top1 = ds.final_token_id.values[..., 0]
        nxt = ds.next_token_id.values
        valid = nxt >= 0
        out[setting] = {
            "n_texts": len(texts), "n_tokens": summary["n_tokens"],
            "kept_fraction": summary["kept_fraction"], "mean_tau": summary.get("mean_tau"),
            "p_value": summary.get("p_value"), "probe": summary.get("probe"),
            "top1_accuracy": float((top1[valid] == nxt[valid]).mean()),
            "rank2_when_top1_wrong": lm, "seconds": round(time.perf_counter() - t0, 1),
            "params": {"max_tokens": args.max_tokens, "shots": args.shots, "seed": args.seed,
                       **({"tasks": TASKS} if setting == "task" else {})}}
        OUT.write_text(json.dumps(out, indent=1, default=float))
        print(setting, json.dumps(out[setting], indent=1, default=float)[:3000], flush=True)


if __name__ == "__main__":
    main()
