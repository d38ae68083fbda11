"""Out-of-core reductions over the activation store with Dask (explorer.distributed).

The reference is the in-memory traced Dataset reduced with plain numpy (nanmean, nanvar,
norms), independent of `site_statistics`.
"""
from __future__ import annotations

import numpy as np
import pytest

from explorer import ActivationStore, trace
from explorer._checks import InputError
from explorer.benches.store import bench_store
from explorer.distributed import dask_scheduler, open_entry, site_statistics

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is", "One two three four",
           "Water boils at one hundred degrees", "She said", "In 1905 the physicist wrote"]


@pytest.fixture(scope="module")
def cached(tiny_model, tmp_path_factory):
    """A traced resid_post (in memory) and the same result stored and reopened lazily."""
    ds = trace(tiny_model, PROMPTS, sites=["resid_post"], progress=False)
    store = ActivationStore(tmp_path_factory.mktemp("cache"))
    key = store.put(store.key({"test": "distributed"}), ds)
    return ds, store, key


def _reference(values):
    x = values.astype(np.float64)  # [prompt, pos, layer, d_model], NaN padding
    return {"mean": np.nanmean(x, axis=(0, 1)), "var": np.nanvar(x, axis=(0, 1)),
            "norm_mean": np.nanmean(np.linalg.norm(x, axis=-1), axis=(0, 1)),
            "count": np.sum(~np.isnan(x), axis=(0, 1))}


def test_local_cluster_matches_in_memory(cached):
    from distributed import get_task_stream

    ds, store, key = cached
    # row bytes: pos * layer * d_model * 4; a budget of two rows per thread-slot
    row = int(np.prod(ds.resid_post.shape[1:])) * 4
    lazy = open_entry(store, key, memory_limit=4 * 2 * row * 2, threads=2)
    assert lazy.resid_post.chunks is not None and max(lazy.resid_post.chunks[0]) == 2
    with dask_scheduler("local", n_workers=1, threads_per_worker=2, processes=False) as client:
        with get_task_stream(client) as stream:
            stats = site_statistics(lazy)
    assert len(stream.data) > 0  # the work ran on the cluster
    expect = _reference(ds.resid_post.values)
    assert np.isnan(ds.resid_post.values).any()  # padding is there and skipped
    for name, value in expect.items():
        np.testing.assert_allclose(stats[name].values, value, rtol=1e-9, atol=1e-12)
    assert stats["mean"].dims == ("layer", "d_model") and stats["norm_mean"].dims == ("layer",)
    # the same call on the in-memory Dataset agrees too (threads scheduler)
    with dask_scheduler("threads"):
        direct = site_statistics(ds)
    for name in expect:
        np.testing.assert_allclose(direct[name].values, stats[name].values, rtol=1e-9,
                                   atol=1e-12)


def test_lazy_result_stays_lazy(cached):
    import dask.array as da

    ds, store, key = cached
    out = site_statistics(store.get(key), compute=False)
    assert all(isinstance(out[name].data, da.Array) for name in out.data_vars)  # nothing ran yet
    expect = _reference(ds.resid_post.values)
    for name, value in expect.items():
        np.testing.assert_allclose(out[name].values, value, rtol=1e-9, atol=1e-12)


def test_bad_arguments_raise_clear_errors(cached):
    ds, _, _ = cached
    with pytest.raises(InputError, match=r"`scheduler` must be one of .* Did you mean 'threads'"):
        with dask_scheduler("thread"):
            pass
    with pytest.raises(TypeError, match=r"`scheduler` must be a str"):
        with dask_scheduler(3):
            pass
    with pytest.raises(InputError, match=r"`site` 'attn_z' is not in the Dataset"):
        site_statistics(ds, "attn_z")
    with pytest.raises(InputError, match=r"'head' is not one of them"):
        site_statistics(ds, over=("prompt", "head"))


def test_unreachable_scheduler_address():
    from explorer.ndif_server import _free_port

    with pytest.raises(InputError, match=r"cannot connect to the dask scheduler at "
                                         r"'tcp://127\.0\.0\.1:\d+'"):
        with dask_scheduler(f"tcp://127.0.0.1:{_free_port()}", timeout_s=1):
            pass


@pytest.mark.slow
def test_bench_store_scaled_down_stays_under_limit(tmp_path):
    result = bench_store(size_mb=64, memory_limit_mb=32, chunk_mb=1, processes=False, repeats=1,
                         n_pos=32, n_layers=4, d_model=64, folder=str(tmp_path))
    figures = result["figures"]
    assert result["accuracy"]["results_match"]
    assert figures["cache_over_limit_ratio"] >= 2
    assert figures["peak_memory_over_limit_ratio"] < 1
    assert all(value > 0 for value in figures.values())
    assert all(key.endswith(("_ratio", "_ms", "_mb", "_mb_per_s")) for key in figures)
    assert list(tmp_path.iterdir()) == []  # the cache was removed


def test_local_cluster_leaves_the_environment_as_it_was(monkeypatch):
    """dask's nanny writes OMP_NUM_THREADS=1 (and more) into the parent's environment; inside
    the block the workers have them, after it the environment is the one before, so a process
    started later (a loopback NDIF server) does not run on one BLAS thread."""
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    before = dict(os.environ)
    with dask_scheduler("local", n_workers=1, memory_limit="512MB") as client:
        worker_env = client.run(lambda: os.environ.get("OMP_NUM_THREADS"))
        assert list(worker_env.values()) == ["1"]  # the workers keep their setting
    assert dict(os.environ) == before


def test_memory_limit_on_an_in_process_worker_is_refused():
    """An in-process worker measures its limit against this whole process (a test session
    holding SmolLM2 passes 3 GB): past 80 % it pauses and a computation waits for ever. The
    limit is refused up front, with the way out."""
    with pytest.raises(InputError, match=r"`memory_limit` \('4GB'\) needs worker processes.*"
                                         r"processes=True, or no memory_limit"):
        with dask_scheduler("local", n_workers=1, processes=False, memory_limit="4GB"):
            pass
