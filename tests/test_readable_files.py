"""The files the explorer writes open in other tools: a page export (NetCDF and zarr) and an
activation-store entry, read back with readers that are not the project's (Unidata's
netCDF4 library, plain zarr, plain xarray without the store's decoding), strings included.

Token and component labels are fixed-width unicode arrays. Zarr format 3 has no stable data
type for them (zarr-python warns `UnstableSpecificationWarning`: other zarr libraries may
not read them), so the zarr writers use format 2, whose specification covers them; the NetCDF
export is NetCDF 3 (64-bit offset), where they are character arrays.
"""
from __future__ import annotations

import io
import warnings
import zipfile

import numpy as np
import param
import xarray as xr

TOKENS = ["The", " capital", " of", " Fran", "ce", " é"]   # one non-ASCII label


def _scores() -> xr.Dataset:
    """A page's Dataset: numbers, string coordinates, a string variable."""
    rng = np.random.default_rng(0)
    return xr.Dataset(
        {"score": (("layer", "head"), rng.standard_normal((2, 3)).astype(np.float32)),
         "label": ("head", np.array(["L0.H0", "L0.H1", "L0.H2"]))},
        coords={"layer": [0, 1], "head": [0, 1, 2],
                "component": ("head", ["L0.H0", "L0.H1", "L0.H2"])},
        attrs={"model": "tiny-llama", "method": "test"})


def _export(fmt: str) -> tuple[bytes, list[warnings.WarningMessage]]:
    from apps._view import View

    class Page(View):
        scores = param.Parameter(default=None, precedence=-1)

    ds = _scores()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        data = Page(scores=ds).export_bytes(fmt)
    return data, seen


def _zarr_warnings(seen: list[warnings.WarningMessage]) -> list[str]:
    """The warnings zarr raised while writing (data types or metadata outside its spec)."""
    return [f"{w.category.__name__}: {str(w.message)[:120]}" for w in seen
            if w.category.__module__.startswith("zarr")]


def test_a_netcdf_export_opens_with_the_netcdf4_library():
    import netCDF4   # in the test extra: the reference C library, not the scipy writer

    ds = _scores()
    data, seen = _export("netcdf")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        raw = zf.read("scores.nc")
    with netCDF4.Dataset("scores.nc", mode="r", memory=raw) as nc:
        assert nc.file_format == "NETCDF3_64BIT_OFFSET"
        np.testing.assert_array_equal(nc["score"][:], ds["score"].values)
        assert nc["layer"][:].tolist() == [0, 1]
        # character arrays with their encoding attribute come back as strings
        assert [str(s) for s in nc["component"][:]] == ["L0.H0", "L0.H1", "L0.H2"]
        assert [str(s) for s in nc["label"][:]] == ["L0.H0", "L0.H1", "L0.H2"]
        assert nc.getncattr("model") == "tiny-llama"
    assert not _zarr_warnings(seen)


def test_a_zarr_export_is_format_2_and_opens_with_plain_zarr_and_xarray(tmp_path):
    import zarr

    ds = _scores()
    data, seen = _export("zarr")
    assert not _zarr_warnings(seen), _zarr_warnings(seen)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        zf.extractall(tmp_path)
    path = tmp_path / "scores.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # reading raises no warning either
        group = zarr.open_group(str(path), mode="r")
        assert group.metadata.zarr_format == 2
        np.testing.assert_array_equal(group["score"][:], ds["score"].values)
        assert group["component"][:].tolist() == ["L0.H0", "L0.H1", "L0.H2"]
        assert group["label"][:].tolist() == ["L0.H0", "L0.H1", "L0.H2"]
        assert group["component"].dtype.kind == "U"
        assert group.attrs["model"] == "tiny-llama"
        back = xr.open_zarr(path).load()
    xr.testing.assert_equal(back[["score", "label"]], ds[["score", "label"]])


def test_a_store_entry_opens_with_plain_zarr_and_xarray(tmp_path):
    import zarr

    from explorer.store import ActivationStore

    tokens = np.array(TOKENS)
    ds = xr.Dataset({"resid": (("pos", "d_model"), np.arange(24, dtype=np.float32).reshape(6, 4))},
                    coords={"pos": np.arange(6), "token": ("pos", tokens)},
                    attrs={"model": "tiny-llama", "sites": ["resid_post"]})
    store = ActivationStore(tmp_path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        key = store.put(ActivationStore.key({"test": "readable"}), ds)
    assert not _zarr_warnings(seen), _zarr_warnings(seen)
    path = tmp_path / "activations" / key / "data.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(str(path), mode="r")
        assert group.metadata.zarr_format == 2
        np.testing.assert_array_equal(group["resid"][:], ds["resid"].values)
        assert group["token"][:].tolist() == TOKENS
        back = xr.open_zarr(path, consolidated=False).load()
    np.testing.assert_array_equal(back["resid"].values, ds["resid"].values)
    assert back["token"].values.tolist() == TOKENS
    assert back.attrs["model"] == "tiny-llama"
