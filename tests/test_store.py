"""Tests for explorer.store: exact round trips, caching, corruption, killed writes, housekeeping."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import xarray as xr

from explorer import store as store_module
from explorer._checks import InputError, StoreError
from explorer.store import ActivationStore, CacheWarning

REPO_ROOT = Path(__file__).resolve().parents[1]
PARTS = {"model": "tiny-random", "revision": "abc123", "method": "trace",
         "prompts": ["The cat", "A dog"], "sites": ["resid_post"], "dtype": "float32"}


def make_dataset(seed: int = 0) -> xr.Dataset:
    """A small activation-like Dataset with token strings, NaN masks and rich attrs."""
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal((2, 3, 4, 5)).astype("float32")  # [prompt, pos, layer, d_model]
    acts[1, 2] = np.nan  # padding position masked with NaN
    return xr.Dataset(
        {
            "resid_post": (("prompt", "pos", "layer", "d_model"), acts,
                           {"units": "days since 2000-01-01", "scale_factor": 2.0, "site": "resid_post"}),
            "logit_lens": (("prompt", "pos"), rng.standard_normal((2, 3)).astype("float16")),
            "token_id": (("prompt", "pos"), np.array([[5, 0, 7], [9, 2, 0]], dtype="int64")),
            "is_pad": (("prompt", "pos"), np.array([[False, False, False], [False, False, True]])),
        },
        coords={
            "prompt": ["The cat", "A dog"],
            "layer": np.arange(4),
            "token": (("prompt", "pos"), np.array([["The", " cat", "\n"], ["A", " dög", ""]]),
                      {"note": "as the model sees them"}),
        },
        attrs={
            "model": "tiny-random", "n_layers": 4, "temperature": 0.7, "greedy": True,
            "edits": [{"kind": "ablate", "layer": 1, "heads": (0, 2)}],
            "params": {"k": 5, "nested": {"a": [1, 2.5, None]}},
            "shape": (2, 3), "missing": None, "eps": float("nan"), "huge": 2**62,
            "np_scalar": np.float32(0.25), "np_array": np.arange(6, dtype="int16").reshape(2, 3),
            "_private": "kept", "__explorer_type__": "user attr with the tag's name",
        },
    )


@pytest.fixture
def store(tmp_path: Path) -> ActivationStore:
    return ActivationStore(tmp_path / "cache")


def entry_folder(store: ActivationStore, key: str) -> Path:
    return store.activations_path / key


def leftovers(store: ActivationStore) -> list[str]:
    return sorted(p.name for p in store.activations_path.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------ round trip


def test_round_trip_is_exact_including_attrs_strings_and_nan(store):
    ds = make_dataset()
    store.put("entry", ds, parts=PARTS)
    back = store.get("entry")
    assert back is not None
    assert isinstance(back["resid_post"].data, da.Array)
    loaded = back.load()
    xr.testing.assert_identical(loaded, ds)
    assert list(loaded.attrs) == list(ds.attrs)  # order kept too
    assert loaded["token"].dtype == ds["token"].dtype
    assert loaded["logit_lens"].dtype == np.float16
    assert np.isnan(loaded["resid_post"].values[1, 2]).all()
    assert type(loaded.attrs["edits"][0]["heads"]) is tuple
    assert type(loaded.attrs["np_scalar"]) is np.float32


def test_put_leaves_the_input_dataset_unchanged(store):
    ds = make_dataset()
    expected = ds.copy(deep=True)
    ds["resid_post"].encoding["chunks"] = (1, 1, 1, 1)
    store.put("entry", ds)
    xr.testing.assert_identical(ds, expected)
    assert ds["resid_post"].encoding["chunks"] == (1, 1, 1, 1)


def test_dask_input_is_rechunked_along_first_dim(store, monkeypatch):
    monkeypatch.setattr(store_module, "_TARGET_CHUNK_BYTES", 1024)
    values = np.arange(100 * 8, dtype="float32").reshape(100, 8)
    ds = xr.Dataset({"x": (("prompt", "d_model"), da.from_array(values, chunks=(7, 3)))})
    store.put("entry", ds)
    back = store.get("entry")
    # 1024 bytes / (8 values * 4 bytes a row) = 32 rows per chunk; other dims whole.
    assert back["x"].data.chunks == ((32, 32, 32, 4), (8,))
    np.testing.assert_array_equal(back["x"].values, values)


def test_reading_back_a_stored_dataset_and_storing_it_again(store):
    store.put("first", make_dataset())
    again = store.get("first")  # carries zarr encoding (chunks, codecs) from the first store
    store.put("second", again)
    xr.testing.assert_identical(store.get("second").load(), make_dataset())


def test_put_replaces_an_existing_entry(store):
    store.put("entry", make_dataset(seed=0))
    store.put("entry", make_dataset(seed=1))
    xr.testing.assert_identical(store.get("entry").load(), make_dataset(seed=1))
    assert [row["key"] for row in store.ls()] == ["entry"]
    assert leftovers(store) == []


def test_get_absent_key_returns_none(store):
    assert store.get("0" * 32) is None


def test_object_arrays_are_rejected(store):
    ds = xr.Dataset({"token": ("pos", np.array(["a", "bc"], dtype=object))})
    with pytest.raises(TypeError, match=r"'token' has dtype object.*astype\(str\)"):
        store.put("entry", ds)
    assert store.ls() == [] and leftovers(store) == []


def test_unstorable_attrs_are_rejected(store):
    ds = xr.Dataset({"x": ("pos", np.zeros(2))}, attrs={"sites": {"resid_post", "mlp_out"}})
    with pytest.raises(TypeError, match=r"ds.attrs\['sites'\].*set"):
        store.put("entry", ds)


@pytest.mark.parametrize("bad", ["../escape", "", ".tmp-x", "a/b"])
def test_malformed_keys_are_rejected(store, bad):
    with pytest.raises(InputError, match="`key` must be"):
        store.get(bad)


def test_put_rejects_non_datasets(store):
    with pytest.raises(TypeError, match="`ds` must be an xarray.Dataset; got DataArray"):
        store.put("entry", xr.DataArray([1.0]))


# ------------------------------------------------------------------------ keys


def test_key_is_sha256_of_canonical_json():
    parts = {"sites": ["resid_post"], "model": "m"}
    canonical = '{"model":"m","sites":["resid_post"]}'  # written by hand
    assert ActivationStore.key(parts) == hashlib.sha256(canonical.encode()).hexdigest()[:32]


def test_key_is_stable_and_differs_for_different_parts():
    same = dict(reversed(list(PARTS.items())))
    assert ActivationStore.key(PARTS) == ActivationStore.key(same)
    assert ActivationStore.key(PARTS) == ActivationStore.key(json.loads(json.dumps(PARTS)))
    other = {**PARTS, "prompts": ["The cat", "A bird"]}
    assert ActivationStore.key(PARTS) != ActivationStore.key(other)
    assert ActivationStore.key({**PARTS, "edits": []}) != ActivationStore.key(PARTS)


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"layer": np.int64(3)}, r"parts\['layer'\].*int64"),
        ({"edits": [{"scale": object()}]}, r"parts\['edits'\]\[0\]\['scale'\].*object"),
        ({"map": {1: "a"}}, r"parts\['map'\].*str keys"),
        (["not", "a", "dict"], "`parts` must be a dict"),
    ],
)
def test_key_rejects_non_json_parts(parts, message):
    with pytest.raises(TypeError, match=message):
        ActivationStore.key(parts)


# ------------------------------------------------------------- get_or_compute


def test_get_or_compute_computes_once_then_serves_lazily(store):
    calls = []

    def compute():
        calls.append(1)
        return make_dataset()

    first = store.get_or_compute(PARTS, compute)
    second = store.get_or_compute(PARTS, compute)
    assert len(calls) == 1
    for result in (first, second):
        assert isinstance(result["resid_post"].data, da.Array)
        xr.testing.assert_identical(result.load(), make_dataset())
    manifest = json.loads((entry_folder(store, ActivationStore.key(PARTS)) / "manifest.json").read_text())
    assert manifest["parts"] == PARTS
    assert set(manifest["versions"]) >= {"explorer", "xarray", "zarr"}


def test_get_or_compute_rejects_a_non_dataset_result(store):
    with pytest.raises(TypeError, match="`compute` must return an xarray.Dataset; got dict"):
        store.get_or_compute(PARTS, lambda: {"x": 1})
    assert store.ls() == []


# ----------------------------------------------------------------- corruption


def _chunk_file(entry: Path) -> Path:
    return entry / "data.zarr" / "resid_post" / "0.0.0.0"


def truncate_chunk(entry):
    path = _chunk_file(entry)
    path.write_bytes(path.read_bytes()[:10])


def overwrite_chunk_same_size(entry):
    path = _chunk_file(entry)
    path.write_bytes(bytes(len(path.read_bytes())))


def delete_chunk(entry):
    _chunk_file(entry).unlink()


def delete_manifest(entry):
    (entry / "manifest.json").unlink()


def garbage_manifest(entry):
    (entry / "manifest.json").write_text("{not json")


def garbage_zarr_metadata(entry):
    (entry / "data.zarr" / "resid_post" / ".zarray").write_text("garbage")


def extra_file(entry):
    (entry / "data.zarr" / "resid_post" / "9.9.9.9").write_bytes(b"junk")


CORRUPTIONS = {
    "truncated chunk": (truncate_chunk, "has 10 bytes"),
    "overwritten chunk": (overwrite_chunk_same_size, "does not match its hash"),
    "deleted chunk": (delete_chunk, "is missing"),
    "deleted manifest": (delete_manifest, "manifest.json is missing"),
    "garbage manifest": (garbage_manifest, "manifest.json is not valid JSON"),
    "garbage zarr metadata": (garbage_zarr_metadata, r"\.zarray"),
    "extra file": (extra_file, "not in the manifest"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_get_raises_for_a_corrupt_entry_and_removes_it(store, name):
    damage, reason = CORRUPTIONS[name]
    key = store.put(ActivationStore.key(PARTS), make_dataset(), parts=PARTS)
    damage(entry_folder(store, key))
    with pytest.raises(StoreError, match=rf"cache entry {key} is corrupt \(.*{reason}.*\); it was removed"):
        store.get(key)
    assert not entry_folder(store, key).exists()
    assert store.get(key) is None
    assert leftovers(store) == []


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_get_or_compute_warns_and_recomputes_a_corrupt_entry(store, name):
    damage, reason = CORRUPTIONS[name]
    calls = []

    def compute():
        calls.append(1)
        return make_dataset()

    store.get_or_compute(PARTS, compute)
    damage(entry_folder(store, ActivationStore.key(PARTS)))
    expected = rf"was corrupt \(.*{reason}.*\); it was removed and is being recomputed"
    with pytest.warns(CacheWarning, match=expected):
        result = store.get_or_compute(PARTS, compute)
    assert len(calls) == 2
    xr.testing.assert_identical(result.load(), make_dataset())
    assert store.get(ActivationStore.key(PARTS)) is not None  # the fresh entry verifies


def test_unverified_get_still_detects_unreadable_zarr_metadata(store):
    store.put("entry", make_dataset())
    # Same size as the real metadata, so only opening the zarr can tell.
    attrs_file = entry_folder(store, "entry") / "data.zarr" / ".zgroup"
    attrs_file.write_bytes(b"x" * attrs_file.stat().st_size)
    with pytest.raises(StoreError, match=r"cache entry entry is corrupt \(unreadable zarr"):
        store.get("entry", verify=False)
    assert not entry_folder(store, "entry").exists()


# ----------------------------------------------------------------- killed writes


def test_compute_raising_leaves_no_entry(store):
    def compute():
        raise RuntimeError("trace cancelled")

    with pytest.raises(RuntimeError, match="trace cancelled"):
        store.get_or_compute(PARTS, compute)
    assert store.get(ActivationStore.key(PARTS)) is None
    assert store.ls() == [] and leftovers(store) == []


def test_write_failing_before_the_manifest_leaves_no_entry(store, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk went away")

    monkeypatch.setattr(store_module, "_write_manifest", fail)
    with pytest.raises(RuntimeError, match="disk went away"):
        store.put("entry", make_dataset())
    assert store.get("entry") is None
    assert store.ls() == [] and leftovers(store) == []


@pytest.mark.slow
def test_write_killed_mid_way_leaves_no_valid_entry_and_clean_removes_it(store):
    # A real process dies (os._exit: no cleanup, no finally) after the data but before the manifest.
    script = textwrap.dedent(
        """
        import os, sys
        import numpy as np, xarray as xr
        import explorer.store as store_module
        store_module._write_manifest = lambda *args, **kwargs: os._exit(3)
        store = store_module.ActivationStore(sys.argv[1])
        store.put("entry", xr.Dataset({"x": ("pos", np.arange(10.0))}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", script, str(store.path)], env=env, timeout=120)
    assert done.returncode == 3
    assert any(name.startswith(".tmp-entry-") for name in leftovers(store))
    assert store.get("entry") is None
    assert store.ls() == []
    assert store.clean() == 1
    assert leftovers(store) == []


def test_clean_leaves_a_write_in_progress_alone(store):
    with store._temp_entry("entry") as tmp:
        (tmp / "partial").write_bytes(b"half")
        assert store.clean() == 0
        assert tmp.exists()
    assert leftovers(store) == []


# ----------------------------------------------------------------- housekeeping


def test_ls_du_and_rm(store):
    other_parts = {**PARTS, "method": "saturation", "sites": ["mlp_out"]}
    key_a = store.put(ActivationStore.key(PARTS), make_dataset(), parts=PARTS)
    key_b = store.put(ActivationStore.key(other_parts), make_dataset(1), parts=other_parts)
    (store.activations_path / ".tmp-killed-write").mkdir()  # leftover: not listed

    rows = {row["key"]: row for row in store.ls()}
    assert set(rows) == {key_a, key_b}
    assert rows[key_b]["parts"] == {"model": "tiny-random", "revision": "abc123", "method": "saturation",
                                    "sites": ["mlp_out"], "dtype": "float32", "n_prompts": 2}
    assert all(row["problem"] is None and row["created"] for row in rows.values())
    on_disk = sum(f.stat().st_size for f in entry_folder(store, key_a).rglob("*") if f.is_file())
    assert rows[key_a]["size"] == on_disk > 0
    assert store.du() == rows[key_a]["size"] + rows[key_b]["size"]

    assert store.rm(key_a) == 1
    assert [row["key"] for row in store.ls()] == [key_b]
    assert store.get(key_a) is None
    assert store.rm() == 1
    assert store.ls() == [] and store.du() == 0 and leftovers(store) == []


def test_ls_reports_a_damaged_entry(store):
    store.put("entry", make_dataset())
    delete_manifest(entry_folder(store, "entry"))
    (row,) = store.ls()
    assert row["key"] == "entry" and row["problem"] == "manifest.json is missing" and row["created"] is None


def test_rm_unknown_key_suggests_a_close_one(store):
    key = store.put(ActivationStore.key(PARTS), make_dataset())
    typo = key[:-1] + ("0" if key[-1] != "0" else "1")
    with pytest.raises(StoreError, match=rf"no cache entry '{typo}' in .* Did you mean '{key}'\?"):
        store.rm(typo)
    with pytest.raises(StoreError, match=rf"Did you mean '{key}'\?"):
        store.rm(key[:8])  # a unique prefix, as with git hashes
    assert store.rm(key) == 1


def test_rm_all_on_an_empty_store(store):
    assert store.rm() == 0


# ---------------------------------------------------------------------- folder


def test_explorer_cache_env_var_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "from-env"))
    store = ActivationStore()
    assert store.path == tmp_path / "from-env"
    assert store.activations_path == tmp_path / "from-env" / "activations"
    assert store.activations_path.is_dir()
    assert ActivationStore(tmp_path / "explicit").path == tmp_path / "explicit"  # path= wins


def test_default_folder_is_under_home(tmp_path, monkeypatch):
    monkeypatch.delenv("EXPLORER_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ActivationStore().path == tmp_path / ".cache" / "explorer"


def test_unwritable_folder_raises_store_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("a regular file, so nothing can be created below it")
    bad = tmp_path / "file" / "sub"
    with pytest.raises(StoreError, match=rf"'{bad}/activations'.*not writable.*EXPLORER_CACHE"):
        ActivationStore(bad)
    monkeypatch.setenv("EXPLORER_CACHE", str(bad))
    with pytest.raises(StoreError, match=r"from \$EXPLORER_CACHE.*not writable"):
        ActivationStore()
