"""Out-of-core analysis of the activation store with Dask.

Store entries open lazily (`ActivationStore.get` returns dask-backed Datasets, one dask
chunk per zarr chunk); `open_entry` re-chunks them to fit a memory budget, `dask_scheduler`
picks where the work runs, and `site_statistics` is a reduction over prompts and positions
that streams through the cache chunk by chunk, so a cache larger than memory never has to
be loaded. `bench_store` measures that: peak worker memory against a limit, and throughput
against reading the same bytes with plain numpy.

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
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import xarray as xr

from ._checks import InputError, check_choice, check_int

__all__ = [
    "SCHEDULERS",
    "dask_scheduler",
    "open_entry",
    "site_statistics",
    "bench_store",
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
        ``memory_limit`` (bytes or a string such as ``"1GB"``; None: no limit).
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
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                               memory_limit=memory_limit or 0, processes=processes,
                               # worker processes talk over TCP on loopback only; in-process
                               # workers use dask's inproc transport (no port at all)
                               host="127.0.0.1" if processes else None,
                               dashboard_address="127.0.0.1:0" if dashboard else None)
        try:
            with Client(cluster, set_as_default=True) as client:
                yield client
        finally:
            cluster.close()
        return
    try:
        client = Client(scheduler, timeout=f"{timeout_s}s", set_as_default=True)
    except (OSError, TimeoutError) as e:
        raise InputError(f"cannot connect to the dask scheduler at {scheduler!r} ({e}).") from None
    with client:
        yield client


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
        parts = [dask.delayed(_partial_sums)(block, n_over)
                 for block in data.to_delayed().ravel()]
        total = dask.delayed(_add_partial_sums)(parts)
        shapes = [kept, kept, kept, kept[:-1], kept[:-1]]
        dtypes = [np.int64, np.float64, np.float64, np.float64, np.int64]
        sums = [da.from_delayed(total[i], shape, dtype)
                for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    else:
        sums = _partial_sums(np.asarray(x.data), n_over)
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


def _partial_sums(block: np.ndarray, n_over: int) -> tuple[np.ndarray, ...]:
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


def _add_partial_sums(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    return tuple(sum(values) for values in zip(*parts))


# -- bench ---------------------------------------------------------------------------------

class _PeakMemory:
    """Sample a process's resident memory every few milliseconds in a thread; keep the peak."""

    def __init__(self, pid: int, interval_s: float = 0.005):
        import psutil

        self._process = psutil.Process(pid)
        self.interval_s = interval_s
        self.start_rss = self._process.memory_info().rss
        self.peak_rss = self.start_rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> "_PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)


def _evict(paths: Sequence[Path]) -> bool:
    """Drop files from the page cache (flushed first), so the next read comes from disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _files(folder: Path) -> list[Path]:
    return [Path(p, n) for p, _, names in os.walk(folder) for n in names]


def _numpy_blockwise_statistics(path: Path, rows: int) -> dict[str, np.ndarray]:
    """The same statistics from a .npy file read with plain numpy, block by block."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(f)
        row = int(np.prod(shape[1:]))
        parts = []
        for start in range(0, shape[0], rows):
            n = min(rows, shape[0] - start)
            block = np.fromfile(f, dtype=dtype, count=n * row).reshape(n, *shape[1:])
            parts.append(_partial_sums(block, 2))
    count, total, square, norm_sum, norm_count = _add_partial_sums(parts)
    mean = total / count
    return {"mean": mean, "var": square / count - mean * mean, "norm_mean": norm_sum / norm_count,
            "count": count}


def _numpy_read(path: Path, rows: int) -> int:
    """Read a .npy file's data with plain numpy, block by block; return the bytes read."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(f)
        row = int(np.prod(shape[1:]))
        done = 0
        for start in range(0, shape[0], rows):
            n = min(rows, shape[0] - start)
            done += np.fromfile(f, dtype=dtype, count=n * row).nbytes
    return done


def _synthetic_trace(n_prompts: int, n_pos: int, n_layers: int, d_model: int, seed: int,
                     rows_per_chunk: int) -> xr.Dataset:
    """A lazily generated resid_post-like Dataset with NaN padding past each prompt's length."""
    import dask.array as da

    rng = da.random.default_rng(seed)
    x = rng.standard_normal((n_prompts, n_pos, n_layers, d_model), dtype=np.float32,
                            chunks=(rows_per_chunk, n_pos, n_layers, d_model))
    lengths = np.random.default_rng(seed).integers(n_pos // 2, n_pos + 1, n_prompts)
    mask = np.arange(n_pos)[None, :] < lengths[:, None]  # [prompt, pos]
    mask_d = da.from_array(mask, chunks=(rows_per_chunk, n_pos))
    x = da.where(mask_d[:, :, None, None], x, np.float32(np.nan))
    return xr.Dataset({"resid_post": (("prompt", "pos", "layer", "d_model"), x),
                       "mask": (("prompt", "pos"), mask)},
                      coords={"prompt": np.arange(n_prompts), "pos": np.arange(n_pos),
                              "layer": np.arange(n_layers)},
                      attrs={"model": "synthetic", "method": "bench_store", "seed": seed})


def bench_store(*, size_mb: float = 2048, memory_limit_mb: float = 1024, chunk_mb: float = 32,
                threads: int = 2, processes: bool = True, repeats: int = 3, n_pos: int = 128,
                n_layers: int = 8, d_model: int = 512, folder: str | None = None, seed: int = 0,
                model: Any = None) -> dict[str, Any]:
    """Reduce a cache larger than a worker's memory limit; compare with plain numpy reads.

    Builds an activation-store entry of about ``size_mb`` MiB (a synthetic ``resid_post``,
    float32, NaN padding past each prompt's length, zarr chunks of ``chunk_mb``), then, in
    ``repeats`` rounds whose order rotates: computes `site_statistics` on a one-worker
    ``LocalCluster`` limited to ``memory_limit_mb`` while sampling the worker's resident
    memory; reads the same array with plain numpy from a ``.npy`` file, block by block; and
    computes the same statistics from that file with numpy. The page cache is dropped
    before every timed read (Linux ``posix_fadvise``), so each one reads from disk.

    Parameters
    ----------
    size_mb : float, default=2048
        Size of the array in the cache, MiB.
    memory_limit_mb : float, default=1024
        The dask worker's memory limit, MiB.
    chunk_mb : float, default=32
        Zarr chunk size, MiB (the store's own default is 32).
    threads : int, default=2
        Threads of the worker.
    processes : bool, default=True
        Run the worker in its own process, whose peak RSS is the memory figure. With False
        (fast, for tests) the worker shares this process, has no dask memory limit, and the
        figure is this process's peak RSS increase during the reduction.
    repeats : int, default=3
        Rounds; times are medians, ratios medians of per-round ratios.
    n_pos, n_layers, d_model : int
        Shape of each prompt's block.
    folder : str, optional
        Where to build the cache (default: a temporary folder); removed afterwards.
    seed : int, default=0
    model : ignored
        Accepted so that ``explorer bench store --model`` is harmless; no model is used.

    Returns
    -------
    dict
        ``params``; ``figures``: ``cache_mb``, ``disk_mb``, ``memory_limit_mb``,
        ``peak_memory_mb`` (max over rounds), ``peak_memory_over_limit_ratio`` (< 1: under the
        limit), ``cache_over_limit_ratio``, ``dask_mb_per_s``, ``numpy_read_mb_per_s``,
        ``numpy_reduce_mb_per_s``, ``dask_vs_numpy_read_ratio`` and
        ``dask_vs_numpy_reduce_ratio`` (throughput ratios; > 1: dask faster), and the median
        times (``_ms``); ``accuracy``: ``results_match`` (dask equals numpy to 1e-9
        relative) and ``max_relative_error``; ``notes``.
    """
    from . import store as store_module
    from .store import ActivationStore

    check_int("repeats", repeats, low=1)
    check_int("threads", threads, low=1)
    row_bytes = n_pos * n_layers * d_model * 4
    n_prompts = max(2, int(size_mb * 2**20 // row_bytes))
    cache_bytes = n_prompts * row_bytes
    limit_bytes = int(memory_limit_mb * 2**20)
    rows_per_chunk = max(1, int(chunk_mb * 2**20) // row_bytes)
    times: dict[str, list[float]] = {"dask": [], "numpy_read": [], "numpy_reduce": []}
    peaks: list[int] = []
    tmp = Path(tempfile.mkdtemp(prefix="explorer-bench-store-", dir=folder))
    try:
        store = ActivationStore(tmp / "cache")
        data = _synthetic_trace(n_prompts, n_pos, n_layers, d_model, seed, rows_per_chunk)
        t0 = time.perf_counter()
        # the store sizes its zarr chunks itself; the bench sets them to scale the test down
        with mock.patch.object(store_module, "_TARGET_CHUNK_BYTES", rows_per_chunk * row_bytes):
            store.put("bench", data, parts={"model": "synthetic", "method": "bench_store"})
        build_s = time.perf_counter() - t0
        entry_files = _files(store.activations_path / "bench")
        npy = tmp / "resid_post.npy"
        mm = np.lib.format.open_memmap(npy, mode="w+", dtype=np.float32,
                                       shape=(n_prompts, n_pos, n_layers, d_model))
        store.get("bench", verify=False).resid_post.data.store(mm, lock=False)
        mm.flush()
        del mm

        with dask_scheduler("local", n_workers=1, threads_per_worker=threads,
                            memory_limit=limit_bytes if processes else None,
                            processes=processes) as client:
            pid = next(iter(client.run(os.getpid).values()))
            if processes:  # dask pauses a worker at 80% of its limit: the bench would hang
                import psutil

                idle = psutil.Process(pid).memory_info().rss
                if idle > 0.5 * limit_bytes:
                    raise InputError(
                        f"`memory_limit_mb` must leave room for data: an idle worker process "
                        f"already uses {idle / 2**20:.0f} MiB; got {memory_limit_mb}. Use at "
                        f"least {4 * idle / 2**20:.0f}, or processes=False.")
            site_statistics(store.get("bench", verify=False).isel(prompt=slice(0, 1)))  # warm-up

            def run_dask() -> Any:
                with _PeakMemory(pid) as memory:
                    out = site_statistics(store.get("bench", verify=False))
                peaks.append(memory.peak_rss if processes else
                             memory.peak_rss - memory.start_rss)
                return out

            steps = {"dask": (run_dask, entry_files),
                     "numpy_read": (lambda: _numpy_read(npy, rows_per_chunk), [npy]),
                     "numpy_reduce": (lambda: _numpy_blockwise_statistics(npy, rows_per_chunk),
                                      [npy])}
            cold = True
            results = {}
            names = list(steps)
            for r in range(repeats):
                for name in names[r % 3:] + names[:r % 3]:
                    fn, files = steps[name]
                    cold = _evict(files) and cold
                    t0 = time.perf_counter()
                    results[name] = fn()
                    times[name].append(time.perf_counter() - t0)
        stats, reference = results["dask"], results["numpy_reduce"]
        errors = [np.max(np.abs(stats[k].values - reference[k]) / np.maximum(np.abs(reference[k]),
                                                                               1e-12))
                  for k in ("mean", "var", "norm_mean", "count")]
        disk_bytes = sum(p.stat().st_size for p in entry_files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    import statistics

    mb = cache_bytes / 2**20
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = max(peaks)
    return {
        "params": {"size_mb": size_mb, "memory_limit_mb": memory_limit_mb, "chunk_mb": chunk_mb,
                   "threads": threads, "processes": processes, "repeats": repeats,
                   "shape": [n_prompts, n_pos, n_layers, d_model], "seed": seed},
        "figures": {
            "cache_mb": mb,
            "disk_mb": disk_bytes / 2**20,
            "memory_limit_mb": limit_bytes / 2**20,
            "cache_over_limit_ratio": cache_bytes / limit_bytes,
            "peak_memory_mb": peak / 2**20,
            "peak_memory_over_limit_ratio": peak / limit_bytes,
            "dask_ms": med["dask"] * 1e3,
            "numpy_read_ms": med["numpy_read"] * 1e3,
            "numpy_reduce_ms": med["numpy_reduce"] * 1e3,
            "dask_mb_per_s": mb / med["dask"],
            "numpy_read_mb_per_s": mb / med["numpy_read"],
            "numpy_reduce_mb_per_s": mb / med["numpy_reduce"],
            "dask_vs_numpy_read_ratio": statistics.median(
                n / d for n, d in zip(times["numpy_read"], times["dask"])),
            "dask_vs_numpy_reduce_ratio": statistics.median(
                n / d for n, d in zip(times["numpy_reduce"], times["dask"])),
            "build_ms": build_s * 1e3,
        },
        "accuracy": {"results_match": bool(max(errors) < 1e-9),
                     "max_relative_error": float(max(errors))},
        "notes": {
            "peak_memory": ("peak RSS of the worker process" if processes else
                            "peak RSS increase of this process (in-process worker)"),
            "cache": ("page cache dropped before each timed read (posix_fadvise)" if cold else
                      "page cache could not be dropped: reads may come from memory"),
            "numpy": "numpy reads an uncompressed .npy copy of the same array, block by block",
        },
    }
