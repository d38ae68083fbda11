"""Saturation layers, the position filter and tau per position out of core, with dask over
a cached lens pass (`saturation_over_store`): the numbers `saturation_analysis` computes in memory.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses.saturation.stats import (
    CITATION,
    kept_positions,
    saturation_from_ranks,
    tau_per_position,
)

__all__ = ["saturation_over_store"]

def _per_position_block(ranks: np.ndarray, mask: np.ndarray, *, n_layers: int, max_ratio: float,
                        k_orders: Sequence[int], min_ranks: int) -> np.ndarray:
    """One block [p, q, layer, rank] -> [p, q, rank + 1 + len(k_orders)]: s, kept, taus."""
    sat = saturation_from_ranks(ranks)                                 # [p, q, rank]
    kept = kept_positions(sat, n_layers, max_ratio=max_ratio) & mask[:, :, 0, 0]
    taus = [np.where(kept, tau_per_position(sat, n_layers, k=kk, min_ranks=min(min_ranks, kk)),
                     np.nan) for kk in k_orders]
    return np.concatenate([sat.astype(np.float64), kept[..., None].astype(np.float64),
                           np.stack(taus, -1) if taus else np.zeros((*kept.shape, 0))], -1)


def saturation_over_store(lens: xr.Dataset, *, n_layers: int | None = None,
                          max_ratio: float = 0.85, k_orders: Sequence[int] = (3, 4, 5),
                          min_ranks: int = 3, scheduler: str = "threads", pos_chunk: int = 64,
                          scheduler_options: dict[str, Any] | None = None) -> xr.Dataset:
    """Saturation layers, position filter and tau per position, out of core with dask.

    Reads only ``final_rank`` and ``mask`` of a `saturation_layers` result, as dask arrays
    chunked by prompt (as the store writes them) and by ``pos_chunk`` positions; each
    chunk is reduced to s_j, kept and tau by one task, so memory holds a few chunks of the
    lens ranks, never the cache. Open the entry lazily (`explorer.store.ActivationStore.get`,
    `explorer.distributed.open_entry`); an in-memory Dataset works too.

    Parameters
    ----------
    lens : xarray.Dataset
        A `saturation_layers` result, lazy or in memory.
    n_layers : int, optional
        Default: the size of its ``layer`` dim.
    max_ratio : float, default=0.85
    k_orders : sequence of int, default=(3, 4, 5)
        The k of each tau (as the ``k_order`` of `saturation_analysis`).
    min_ranks : int, default=3
    scheduler : str, default="threads"
        ``"threads"``, ``"synchronous"``, ``"local"`` (a LocalCluster) or a scheduler
        address; see `explorer.distributed.dask_scheduler`.
    pos_chunk : int, default=64
    scheduler_options : dict, optional
        Passed to `explorer.distributed.dask_scheduler` (e.g. ``n_workers``, ``processes``).

    Returns
    -------
    xarray.Dataset
        ``sat_layer`` (prompt, pos, rank) int64, ``kept`` (prompt, pos) bool, ``tau``
        (k_order, prompt, pos) float64 (NaN where not counted) - the same numbers as
        `saturation_analysis` computes in memory.
    """
    import dask.array as da

    from explorer.distributed import check_scheduler, dask_scheduler

    for name in ("final_rank", "mask"):
        if name not in lens.variables:
            raise InputError(f"`lens` has no {name!r}; pass a saturation_layers result "
                             f"(it has {', '.join(map(str, lens.data_vars))}).")
    scheduler = check_scheduler(scheduler)
    n_layers = lens.sizes["layer"] if n_layers is None else check_int("n_layers", n_layers, low=1)
    max_ratio = check_float("max_ratio", max_ratio, low=0.0, high=1.0)
    k_rank = lens.sizes["rank"]
    k_orders = [check_int("k_orders", kk, low=2, high=k_rank) for kk in k_orders]
    min_ranks = check_int("min_ranks", min_ranks, low=2)
    pos_chunk = check_int("pos_chunk", pos_chunk, low=1)
    ranks = lens.final_rank.transpose("prompt", "pos", "layer", "rank").data
    mask = lens.mask.transpose("prompt", "pos").data
    if not isinstance(ranks, da.Array):
        ranks = da.from_array(ranks, chunks=(1, pos_chunk, -1, -1))
    if not isinstance(mask, da.Array):
        mask = da.from_array(mask, chunks=(1, pos_chunk))
    ranks = ranks.rechunk({1: pos_chunk, 2: -1, 3: -1})                 # [prompt, pos, L, k]
    mask4 = mask.rechunk((ranks.chunks[0], ranks.chunks[1]))[:, :, None, None]
    width = k_rank + 1 + len(k_orders)
    out = da.map_blocks(_per_position_block, ranks, mask4, n_layers=n_layers,
                        max_ratio=max_ratio, k_orders=tuple(k_orders), min_ranks=min_ranks,
                        drop_axis=[2, 3], new_axis=[2],
                        chunks=(ranks.chunks[0], ranks.chunks[1], (width,)), dtype=np.float64)
    with dask_scheduler(scheduler, **(scheduler_options or {})):
        res = out.compute()                                            # [prompt, pos, width]
    coords = {c: lens[c] for c in ("prompt", "pos", "rank") if c in lens.coords}
    return xr.Dataset(
        {"sat_layer": (("prompt", "pos", "rank"), res[..., :k_rank].astype(np.int64)),
         "kept": (("prompt", "pos"), res[..., k_rank] > 0.5),
         "tau": (("k_order", "prompt", "pos"), np.moveaxis(res[..., k_rank + 1:], -1, 0))},
        coords={**coords, "k_order": np.asarray(k_orders, dtype=np.int64)},
        attrs={"method": "saturation_over_store", "scheduler": scheduler,
               "max_ratio": max_ratio, "min_ranks": min_ranks, "citation": CITATION})
