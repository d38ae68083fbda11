"""Why the lens preview runs all its products on one GEMM backend.

Times the sequence of products of 14 SmolLM2-sized blocks at 32 rows (per block: the fused
q/k/v [576 -> 960], the output [576 -> 576], the fused gate/up [576 -> 3072] and the down
[1536 -> 576] projections) three ways: all on torch (``F.linear``), all on numpy
(OpenBLAS), and alternating the two as a per-shape choice does. Random weights: only the
shapes matter. Prints the median milliseconds of each over 10 runs.

    .venv/bin/python benchmarks/gemm_alternation.py [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]   # (d_in, d_out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=14)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(d_out, d_in, generator=g) for d_in, d_out in SHAPES]
    wts = [np.ascontiguousarray(w.numpy().T) for w in ws]
    xs = [torch.randn(args.rows, d_in, generator=g) for d_in, _ in SHAPES]
    xns = [x.numpy() for x in xs]

    def all_torch() -> None:
        for _ in range(args.blocks):
            for w, x in zip(ws, xs):
                F.linear(x, w)

    def all_numpy() -> None:
        for _ in range(args.blocks):
            for w, x in zip(wts, xns):
                x @ w

    def alternating() -> None:
        for _ in range(args.blocks):
            for i, (w, wt, x, xn) in enumerate(zip(ws, wts, xs, xns)):
                F.linear(x, w) if i % 2 == 0 else xn @ wt

    for name, fn in (("all torch", all_torch), ("all numpy", all_numpy),
                     ("alternating", alternating)):
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"{name:12s} {np.median(times) * 1e3:8.1f} ms  ({args.blocks * len(SHAPES)} "
              f"products, {args.rows} rows, {args.threads} threads)")


if __name__ == "__main__":
    main()
