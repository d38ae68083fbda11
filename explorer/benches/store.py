"""``explorer bench store``: reduce a cache larger than a dask worker's memory limit.

The bench of `explorer.distributed` (`site_statistics` out of core on a one-worker
``LocalCluster``), against plain numpy reads of the same array.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.benches._memory import PeakRSS
from explorer.distributed import add_partial_sums, dask_scheduler, partial_sums, site_statistics

__all__ = ["bench_store"]


# -- bench ---------------------------------------------------------------------------------

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


def _npy_blocks(path: Path, rows: int) -> Iterator[np.ndarray]:
    """A .npy file's array read with plain numpy, ``rows`` rows of the first axis at a time."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(f)
        row = int(np.prod(shape[1:]))
        for start in range(0, shape[0], rows):
            n = min(rows, shape[0] - start)
            yield np.fromfile(f, dtype=dtype, count=n * row).reshape(n, *shape[1:])


def _numpy_blockwise_statistics(path: Path, rows: int) -> dict[str, np.ndarray]:
    """The same statistics from a .npy file read with plain numpy, block by block."""
    parts = [partial_sums(block, 2) for block in _npy_blocks(path, rows)]
    count, total, square, norm_sum, norm_count = add_partial_sums(parts)
    mean = total / count
    return {"mean": mean, "var": square / count - mean * mean, "norm_mean": norm_sum / norm_count,
            "count": count}


def _numpy_read(path: Path, rows: int) -> int:
    """Read a .npy file's data with plain numpy, block by block; return the bytes read."""
    return sum(block.nbytes for block in _npy_blocks(path, rows))


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
    from explorer import store as store_module
    from explorer.store import ActivationStore

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
                with PeakRSS(pid) as memory:
                    out = site_statistics(store.get("bench", verify=False))
                peaks.append(memory.peak if processes else memory.peak - memory.base)
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
