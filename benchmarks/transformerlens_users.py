"""The everyday calls of a TransformerLens user beside the explorer's, timed in one run.

Each task runs as an explorer call and as the TransformerLens call on a TransformerBridge
over a copy of the same weights (`explorer.benches.peers.transformer_lens_bridge`), in one
interleaved loop (`explorer.benches.timing.interleaved_times`: the order rotates each
round), at one torch thread. Every pair is also checked to give the same numbers; the
largest difference is printed beside the timing. The figures in
docs/transformerlens_users.md come from this script.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/transformerlens_users.py [--model smollm2-135m]
        [--repeats 5] [--patch-repeats 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import explorer  # noqa: E402
from explorer import Ablate, Steer  # noqa: E402
from explorer.benches.peers import transformer_lens_bridge  # noqa: E402
from explorer.benches.timing import interleaved_times, median_ms  # noqa: E402
from explorer.defaults import DEFAULT_MODEL  # noqa: E402

PROMPTS = ["The capital of France is", "The Eiffel Tower is in the city of",
           "When Mary and John went to the store, John gave a drink to"]
CLEAN = "Then, when Mary and John went to the store, John gave a drink to"
CORRUPT = "Then, when Mary and John went to the store, Mary gave a drink to"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--patch-repeats", type=int, default=1,
                    help="rounds of the patching pair (TransformerLens runs one forward per "
                         "cell: minutes per round on a CPU)")
    ap.add_argument("--skip-patch", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = explorer.load_model(args.model)
    bridge, reason = transformer_lens_bridge(model)
    if bridge is None:
        raise SystemExit(reason)
    from transformer_lens import patching

    spec = model.cfg
    L, H, dh = spec.n_layers, spec.n_heads, spec.d_head
    layer, head, steer_layer = min(10, L - 1), min(4, H - 1), min(12, L - 1)
    ids = [torch.tensor([model.tokenizer(p, add_special_tokens=False)["input_ids"]])
           for p in PROMPTS]
    vec = torch.randn(spec.d_model, generator=torch.Generator().manual_seed(0))
    vec = vec / vec.norm() * 4.0
    out: dict[str, dict] = {}

    # 1. cache the residual stream and the heads' z of three prompts
    names = {f"blocks.{x}.{h}" for x in range(L) for h in ("hook_resid_post", "attn.hook_z")}

    def ours_cache():
        out["cache_ours"] = explorer.trace(model, PROMPTS, sites=["resid_post", "attn_z"])

    def tl_cache():
        out["cache_tl"] = [bridge.run_with_cache(t, names_filter=lambda n: n in names)[1]
                           for t in ids]

    # 2. ablate one head (zero its z) and read the answer's probability at the last token
    def ours_ablate():
        ds = explorer.run_with(model, PROMPTS[0], [Ablate(layer, head)], positions=[-1])
        out["ablate_ours"] = torch.softmax(ds.explorer.as_torch()["logits"][0, -1], -1)

    def zero_head(z, hook):
        z[:, :, head] = 0.0
        return z

    def tl_ablate():
        lg = bridge.run_with_hooks(ids[0], fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)])
        out["ablate_tl"] = torch.softmax(lg[0, -1].float(), -1)

    # 3. steer: add 4 x a unit vector to resid_post at one layer, every position
    steer = Steer(steer_layer, vec, alpha=1.0)

    def add_vec(x, hook):
        return x + vec.to(x.dtype)

    def ours_steer():
        out["steer_ours"] = explorer.run_with(model, PROMPTS[0], [steer]).logits.values[0, -1]

    def tl_steer():
        lg = bridge.run_with_hooks(ids[0], fwd_hooks=[(f"blocks.{steer_layer}.hook_resid_post",
                                                       add_vec)])
        out["steer_tl"] = lg[0, -1].float().numpy()

    # 4. activation patching over (layer, position) of resid_pre
    def ours_patch():
        out["patch_ours"] = explorer.activation_patching(model, CLEAN, CORRUPT, kind="resid_pre")

    if not args.skip_patch:
        ours_patch()
        p = out["patch_ours"].attrs["params"]
    else:
        p = {"answer_id": 0, "alternative_id": 0, "corrupt_logit_diff": 0.0,
             "clean_logit_diff": 1.0, "clean_ids": [0], "corrupt_ids": [0]}
    a, b = p["answer_id"], p["alternative_id"]
    lo, hi = p["corrupt_logit_diff"], p["clean_logit_diff"]
    clean_ids, corrupt_ids = torch.tensor([p["clean_ids"]]), torch.tensor([p["corrupt_ids"]])

    def metric(lg):
        return ((lg[0, -1, a] - lg[0, -1, b]) - lo) / (hi - lo)

    def tl_patch():
        _, cache = bridge.run_with_cache(clean_ids)
        out["patch_tl"] = patching.get_act_patch_resid_pre(bridge, corrupt_ids, cache, metric)

    # 5. greedy generation, plain and under the steering edit
    n_new = args.new_tokens

    def ours_generate():
        out["gen_ours"] = explorer.generate(model, PROMPTS[0], max_new_tokens=n_new)

    def tl_generate():
        out["gen_tl"] = bridge.generate(ids[0], max_new_tokens=n_new, do_sample=False,
                                        verbose=False)

    def ours_generate_steered():
        out["sgen_ours"] = explorer.generate(model, PROMPTS[0], edits=[steer],
                                             max_new_tokens=n_new)

    def tl_generate_steered():
        with bridge.hooks(fwd_hooks=[(f"blocks.{steer_layer}.hook_resid_post", add_vec)]):
            out["sgen_tl"] = bridge.generate(ids[0], max_new_tokens=n_new, do_sample=False,
                                             verbose=False, use_past_kv_cache=False)

    tasks = {
        "cache": (ours_cache, tl_cache),
        "ablate": (ours_ablate, tl_ablate),
        "steer": (ours_steer, tl_steer),
        "generate": (ours_generate, tl_generate),
        "generate_steered": (ours_generate_steered, tl_generate_steered),
    }
    fns = {}
    for name, (ours, theirs) in tasks.items():
        fns[f"{name}/explorer"], fns[f"{name}/transformer_lens"] = ours, theirs
    wall, cpu = interleaved_times(fns, repeats=args.repeats, warmup=1)
    if not args.skip_patch:   # the slow pair: its own rounds, in the same process
        tasks["patch"] = (ours_patch, tl_patch)
        w, c = interleaved_times({"patch/explorer": ours_patch,
                                  "patch/transformer_lens": tl_patch},
                                 repeats=args.patch_repeats, warmup=0)
        wall.update(w)
        cpu.update(c)

    # agreement of every pair
    c = out["cache_ours"]
    diff_cache = 0.0
    for i, cache in enumerate(out["cache_tl"]):
        n = int(c.mask[i].sum())
        for x in range(L):
            r = c.resid_post.sel(layer=x).values[i, :n]
            z = c.attn_z.sel(layer=x).values[i, :n]
            diff_cache = max(diff_cache,
                             np.abs(r - cache[f"blocks.{x}.hook_resid_post"][0].numpy()).max(),
                             np.abs(z - cache[f"blocks.{x}.attn.hook_z"][0].numpy()).max())
    with torch.no_grad():                  # the explorer's greedy tokens against HF's own
        hf_ids = model.hf.generate(ids[0], attention_mask=torch.ones_like(ids[0]),
                                   max_new_tokens=n_new, do_sample=False,
                                   pad_token_id=model.tokenizer.eos_token_id)
    tl_no_cache = bridge.generate(ids[0], max_new_tokens=n_new, do_sample=False, verbose=False,
                                  use_past_kv_cache=False)
    agree = {
        "cache": float(diff_cache),
        "ablate": float((out["ablate_ours"] - out["ablate_tl"]).abs().max()),
        "steer": float(np.abs(out["steer_ours"] - out["steer_tl"]).max()),
        "patch": (float(np.abs(out["patch_ours"].effect.values
                               - out["patch_tl"].double().numpy()).max())
                  if "patch_tl" in out else None),
        "generate": int(list(out["gen_ours"].as_torch()[0]) != out["gen_tl"][0].tolist()),
        "generate_steered": int(list(out["sgen_ours"].as_torch()[0])
                                != out["sgen_tl"][0].tolist()),
    }
    rows = []
    for name in tasks:
        ours_ms = median_ms(wall[f"{name}/explorer"])
        tl_ms = median_ms(wall[f"{name}/transformer_lens"])
        rows.append({"task": name, "explorer_ms": round(ours_ms, 1),
                     "transformer_lens_ms": round(tl_ms, 1),
                     "explorer_cpu_ms": round(median_ms(cpu[f"{name}/explorer"]), 1),
                     "transformer_lens_cpu_ms": round(median_ms(cpu[f"{name}/transformer_lens"]), 1),
                     "max_abs_diff" if name not in ("generate", "generate_steered")
                     else "tokens_differ": agree[name]})
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["OMP_NUM_THREADS=1 .venv/bin/python benchmarks/transformerlens_users.py",
                             *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {platform.processor() or platform.system()}, "
                   f"torch threads 1",
        "versions": {"explorer": explorer.__version__, "torch": torch.__version__,
                     "transformer-lens": version("transformer-lens"),
                     "nnsight": version("nnsight")},
        "model": spec.name, "repeats": args.repeats, "new_tokens": n_new,
        "ablate": f"L{layer}.H{head}", "steer_layer": steer_layer,
        "patch_cells": list(out["patch_ours"].effect.shape) if "patch_ours" in out else None,
        "patch_repeats": args.patch_repeats,
        "explorer_generate_equals_hf_generate": out["gen_ours"].as_torch().tolist()
        == hf_ids.tolist(),
        "transformer_lens_generate_equals_hf_generate": out["gen_tl"].tolist() == hf_ids.tolist(),
        "transformer_lens_generate_without_kv_cache_equals_hf_generate":
            tl_no_cache.tolist() == hf_ids.tolist(),
        "generated": {"explorer": out["gen_ours"].text,
                      "explorer_steered": out["sgen_ours"].text},
        "rows": rows,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
