"""Out-of-core analysis of the activation store with Dask.

Store entries open lazily (`ActivationStore.get` returns dask-backed Datasets, one dask
chunk per zarr chunk); `open_entry` re-chunks them to fit a memory budget, `dask_scheduler`
picks where the work runs, and `site_statistics` is a reduction over prompts and positions
that streams through the cache chunk by chunk, so a cache larger than memory never has to
be loaded. ``explorer bench store`` (`explorer.benches.store`) measures that: peak worker
memory against a limit, and throughput against reading the same bytes with plain numpy.

Schedulers (the CLI's ``--scheduler``):

- ``"threads"``: dask's local thread pool (the default; no cluster).
- ``"synchronous"``: one thread, for debugging.
- ``"local"``: a ``dask.distributed.LocalCluster`` on 127.0.0.1 (worker memory limits,
  spilling, a dashboard if asked for).
- ``"tcp://HOST:PORT"`` (or any ``scheme://``): an existing ``dask.distributed`` scheduler.
"""
from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import xarray as xr

from ._checks import InputError, check_choice, check_int

__all__ = [
    "SCHEDULERS",
    "dask_scheduler",
    "open_entry",
    "site_statistics",
]

SCHEDULERS = ("threads", "synchronous", "local")


def check_scheduler(scheduler: Any) -> str:
    """Return ``scheduler`` if it is one of `SCHEDULERS` or a scheduler address."""
    if not isinstance(scheduler, str):
        raise TypeError(f"`scheduler` must be a str; got {type(scheduler).__name__}.")
    if "://" in scheduler:
        return scheduler
    return check_choice("scheduler", scheduler, SCHEDULERS)


@contextlib.contextmanager
def dask_scheduler(scheduler: str = "threads", *, n_workers: int = 1,
                   threads_per_worker: int | None = None, memory_limit: str | int | None = None,
                   processes: bool = True, dashboard: bool = False,
                   timeout_s: float = 10.0) -> Iterator[Any]:
    """Run dask computations inside the block on ``scheduler``.

    Parameters
    ----------
    scheduler : {"threads", "synchronous", "local"} or str, default="threads"
        Or the address of a running ``dask.distributed`` scheduler (``"tcp://host:8786"``).
    n_workers, threads_per_worker, memory_limit, processes, dashboard
        For ``"local"``: the LocalCluster's workers (bound to 127.0.0.1), each with
        ``memory_limit`` (bytes or a string such as ``"1GB"``; None: no limit). A limit
        needs worker processes: an in-process worker (``processes=False``) would measure it
        against everything this process holds and pause, waiting for ever, once the process
        grows past 80 % of it.
    timeout_s : float, default=10
        How long to try connecting to a scheduler address.

    Yields
    ------
    distributed.Client or None
        The client for ``"local"`` and addresses; None for the local pools.
    """
    import dask

    scheduler = check_scheduler(scheduler)
    if scheduler in ("threads", "synchronous"):
        with dask.config.set(scheduler=scheduler):
            yield None
        return
    from distributed import Client, LocalCluster

    if scheduler == "local":
        check_int("n_workers", n_workers, low=1)
        if memory_limit and not processes:
            raise InputError(
                f"`memory_limit` ({memory_limit!r}) needs worker processes: an in-process worker "
                f"(processes=False) counts all of this process's memory against it and stops "
                f"running tasks once the process passes 80 % of the limit. Give "
                f"processes=True, or no memory_limit.")
        with _local_cluster(LocalCluster, n_workers, threads_per_worker, memory_limit,
                            processes, dashboard) as cluster:
            with Client(cluster, set_as_default=True) as client:
                yield client
        return
    try:
        client = Client(scheduler, timeout=f"{timeout_s}s", set_as_default=True)
    except (OSError, TimeoutError) as e:
        raise InputError(f"cannot connect to the dask scheduler at {scheduler!r} ({e}).") from None
    with client:
        yield client


@contextlib.contextmanager
def _local_cluster(cls: Any, n_workers: int, threads_per_worker: int, memory_limit: Any,
                   processes: bool, dashboard: bool) -> Iterator[Any]:
    environ = dict(os.environ)
    cluster = cls(n_workers=n_workers, threads_per_worker=threads_per_worker,
                  memory_limit=memory_limit or 0, processes=processes,
                  # worker processes talk over TCP on loopback only; in-process
                  # workers use dask's inproc transport (no port at all)
                  host="127.0.0.1" if processes else None,
                  dashboard_address="127.0.0.1:0" if dashboard else None)
    # the nanny writes its workers' settings (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1,
    # MALLOC_TRIM_THRESHOLD_, ...) into this process's environment; they are put back on exit,
    # or every subprocess started later (a loopback NDIF server, a CLI run) gets one BLAS thread
    written = {k: v for k, v in os.environ.items() if environ.get(k) != v}
    try:
        yield cluster
    finally:
        cluster.close()
        for k in written:
            if k in environ:
                os.environ[k] = environ[k]
            else:
                os.environ.pop(k, None)


def open_entry(store: Any, key: str, *, memory_limit: int | None = None, threads: int = 1,
               verify: bool = True) -> xr.Dataset:
    """Open a store entry lazily, with dask chunks sized for ``memory_limit`` bytes.

    Chunks split the first dimension (prompt), as the store writes them. With a limit, each
    chunk is at most ``memory_limit / (4 * threads)`` bytes, leaving room for the
    decompression buffer and the temporaries of a reduction in every thread.

    Raises
    ------
    StoreError
        No entry under ``key`` or a corrupt one (see `ActivationStore.get`).
    """
    from ._checks import StoreError

    ds = store.get(key, verify=verify)
    if ds is None:
        raise StoreError(f"no cache entry {key!r} in '{store.activations_path}'.")
    if memory_limit is None:
        return ds
    check_int("memory_limit", memory_limit, low=1)
    budget = memory_limit / (4 * check_int("threads", threads, low=1))
    chunks = {}
    for var in ds.data_vars.values():
        if var.ndim == 0 or var.chunks is None:
            continue
        row_bytes = var.dtype.itemsize * math.prod(var.shape[1:])
        rows = max(1, int(budget // max(row_bytes, 1)))
        current = max(var.chunks[0])
        if rows < current:
            dim = var.dims[0]
            chunks[dim] = min(rows, chunks.get(dim, rows))
    return ds.chunk(chunks) if chunks else ds


def site_statistics(ds: xr.Dataset, site: str = "resid_post", *,
                    over: Sequence[str] = ("prompt", "pos"), vector_dim: str = "d_model",
                    compute: bool = True) -> xr.Dataset:
    """Mean, variance and mean vector norm of a site over real tokens, in one pass.

    Padding is NaN in traced Datasets, so every sum skips NaN. On a dask-backed Dataset
    (an entry opened from the store) each chunk is read once and reduced to small partial
    sums by one task; the partial sums are added up at the end, so memory holds a few
    chunks, never the cache.

    Parameters
    ----------
    ds : xarray.Dataset
        A traced Dataset, in memory or lazy from the store.
    site : str, default="resid_post"
    over : sequence of str, default=("prompt", "pos")
        Dims reduced.
    vector_dim : str, default="d_model"
        The dim the vector norm is taken over.
    compute : bool, default=True
        Compute now (on the active dask scheduler), or return a lazy Dataset.

    Returns
    -------
    xarray.Dataset
        ``mean`` and ``var`` (the remaining dims, e.g. layer, d_model), ``norm_mean`` (the
        remaining dims less ``vector_dim``: mean L2 norm of the site's vectors) and
        ``count`` (real tokens per element); float64 (count int64).
    """
    import dask
    import dask.array as da

    if site not in ds.data_vars:
        raise InputError(f"`site` {site!r} is not in the Dataset; it has "
                         f"{', '.join(map(str, ds.data_vars))}.")
    x = ds[site]
    over = list(over)
    for dim in [*over, vector_dim]:
        if dim not in x.dims:
            raise InputError(f"`{site}` has dims {x.dims}; {dim!r} is not one of them.")
    if vector_dim in over:
        raise InputError(f"`vector_dim` {vector_dim!r} cannot also be reduced over.")
    rest = [d for d in x.dims if d not in over and d != vector_dim]
    x = x.transpose(*over, *rest, vector_dim)  # [*over, *rest, vector]
    n_over = len(over)
    kept = x.shape[n_over:]
    if isinstance(x.data, da.Array):
        # chunks split only the reduced dims (the store splits prompt); partials per chunk
        data = x.data.rechunk({i: -1 for i in range(n_over, x.ndim)})
        parts = [dask.delayed(partial_sums)(block, n_over)
                 for block in data.to_delayed().ravel()]
        total = dask.delayed(add_partial_sums)(parts)
        shapes = [kept, kept, kept, kept[:-1], kept[:-1]]
        dtypes = [np.int64, np.float64, np.float64, np.float64, np.int64]
        sums = [da.from_delayed(total[i], shape, dtype)
                for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    else:
        sums = partial_sums(np.asarray(x.data), n_over)
    count, total_sum, square_sum, norm_sum, norm_count = sums
    mean = total_sum / count
    dims, norm_dims = (*rest, vector_dim), tuple(rest)
    coords = {d: x.coords[d] for d in dims if d in x.coords}
    out = xr.Dataset(
        {"mean": (dims, mean), "var": (dims, square_sum / count - mean * mean),
         "norm_mean": (norm_dims, norm_sum / norm_count), "count": (dims, count)},
        coords=coords, attrs={"method": "site_statistics", "site": site, "over": over})
    return out.compute() if compute else out


_SUB_BLOCK_ELEMENTS = 2**21  # float64 temporaries of 16 MiB, whatever the chunk size


def partial_sums(block: np.ndarray, n_over: int) -> tuple[np.ndarray, ...]:
    """Count, sum and sum of squares over the first ``n_over`` axes, skipping NaN; and the
    sum and count of the (last-axis) vector norms. Works through the block in slices of
    the first axis, so its float64 temporaries stay small next to the chunk itself."""
    block = np.asarray(block)
    axes = tuple(range(n_over))
    step = max(1, _SUB_BLOCK_ELEMENTS // max(1, math.prod(block.shape[1:])))
    sums = None
    for start in range(0, max(1, block.shape[0]), step):
        x = np.array(block[start:start + step], dtype=np.float64)  # a copy, zeroed in place
        valid = ~np.isnan(x)
        x[~valid] = 0.0
        square = x * x
        norm_valid = valid.all(-1)  # a vector with any padding has no norm
        norms = np.sqrt(square.sum(-1)) * norm_valid
        part = (valid.sum(axes), x.sum(axes), square.sum(axes), norms.sum(axes),
                norm_valid.sum(axes))
        sums = part if sums is None else tuple(a + b for a, b in zip(sums, part))
    return sums


def add_partial_sums(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """The element-wise sums of several `partial_sums` results (blocks combined)."""
    return tuple(sum(values) for values in zip(*parts))
