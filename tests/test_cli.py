"""Tests for explorer.cli: every command in-process through `main`, one real subprocess."""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from explorer import cli
from explorer._checks import InputError
from explorer.lens import logit_lens
from explorer.models import known_models
from explorer.store import ActivationStore
from explorer.trace import trace

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The cat sat on the mat", "Hello there"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Every test gets its own empty cache folder."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("EXPLORER_CACHE", str(folder))
    return folder


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n\n", encoding="utf-8")  # trailing blank line skipped
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def assert_one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("explorer: error: ")
    assert "Traceback" not in err
    return lines[0]


# -- models ------------------------------------------------------------------------------

def test_models_lists_every_known_name_and_the_cache_folder(capsys, cache):
    code, out, err = run(capsys, "models")
    assert code == 0 and err == ""
    for name in known_models():
        assert name in out
    assert str(cache) in out

    data = run_json(capsys, "models")
    assert [m["name"] for m in data["models"]] == list(known_models())
    assert data["cache_dir"] == str(cache)
    smol = next(m for m in data["models"] if m["name"] == "smollm2-135m")
    assert smol["default"] is True and smol["cached"] is False and smol["path"] is None
    assert all(m["cached"] is None for m in data["models"] if m["name"].startswith("tiny-"))


def test_models_reports_a_converted_smollm2(capsys, cache):
    folder = cache / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "explorer-source.json").write_text("{}")
    smol = next(m for m in run_json(capsys, "models")["models"] if m["name"] == "smollm2-135m")
    assert smol["cached"] is True and smol["path"] == str(folder)


def test_global_cache_flag_sets_the_folder_for_one_run_only(capsys, tmp_path, cache):
    other = tmp_path / "other"
    data = run_json(capsys, "--cache", str(other), "models")
    assert data["cache_dir"] == str(other)
    assert os.environ["EXPLORER_CACHE"] == str(cache)  # restored after the run
    # also accepted after the subcommand
    data = run_json(capsys, "models", "--cache", str(other))
    assert data["cache_dir"] == str(other)


def test_version(capsys):
    from explorer import __version__

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"explorer {__version__}"


# -- trace -------------------------------------------------------------------------------

def test_trace_writes_zarr_equal_to_a_direct_trace(capsys, tmp_path, prompts_file, tiny_model):
    out = tmp_path / "acts.zarr"
    code, stdout, err = run(capsys, "trace", "--model", "tiny-llama", "--prompts", str(prompts_file),
                            "--sites", "resid_post,attn_z", "--layers", "0-1",
                            "--positions", "-2,-1", "--batch-size", "1", "--out", str(out))
    assert code == 0, err
    assert stdout.count("\n") == 1 and str(out) in stdout and "resid_post" in stdout

    back = xr.open_zarr(out).load()
    direct = trace(tiny_model, PROMPTS, sites=["resid_post", "attn_z"], layers=[0, 1],
                   positions=[-2, -1], progress=False)
    assert back["resid_post"].dims == ("prompt", "pos", "layer", "d_model")
    assert back["attn_z"].dims == ("prompt", "pos", "layer", "head", "d_head")
    assert dict(back.sizes) == {"prompt": 2, "pos": 2, "layer": 2, "d_model": 64, "head": 4,
                                "d_head": 16}
    for name in ("resid_post", "attn_z"):
        np.testing.assert_allclose(back[name].values, direct[name].values, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(back["layer"].values, [0, 1])
    np.testing.assert_array_equal(back["pos"].values, [-2, -1])
    np.testing.assert_array_equal(back["token"].values, direct["token"].values)
    assert back.attrs["model"] == "tiny-llama"
    assert back.attrs["params"]["prompts"] == PROMPTS
    assert back.attrs["model_spec"]["n_layers"] == 3


def test_trace_json_summary_and_stdin(capsys, tmp_path, monkeypatch, tiny_model):
    monkeypatch.setattr(sys, "stdin", io.StringIO("A lone prompt\n"))
    out = tmp_path / "stdin.zarr"
    summary = run_json(capsys, "trace", "--model", "tiny-llama", "--prompts", "-",
                       "--sites", "mlp_out", "--out", str(out))
    n_tokens = tiny_model.tokenize(["A lone prompt"]).lengths[0]
    assert summary["dims"] == {"prompt": 1, "pos": n_tokens, "layer": 3, "d_model": 64}
    assert summary["variables"]["mlp_out"] == ["prompt", "pos", "layer", "d_model"]
    assert summary["n_prompts"] == 1 and summary["path"] == str(out)
    assert summary["bytes"] > 0
    direct = trace(tiny_model, ["A lone prompt"], sites="mlp_out", progress=False)
    np.testing.assert_allclose(xr.open_zarr(out)["mlp_out"].values, direct["mlp_out"].values,
                               rtol=1e-6, atol=1e-7)


def test_trace_refuses_to_overwrite_unless_forced(capsys, tmp_path, prompts_file):
    out = tmp_path / "acts.zarr"
    args = ("trace", "--model", "tiny-llama", "--prompts", str(prompts_file), "--out", str(out))
    assert run(capsys, *args)[0] == 0
    before = xr.open_zarr(out)
    assert before.sizes["layer"] == 3

    code, _, err = run(capsys, *args, "--layers", "1")
    assert code == 2
    assert "already exists" in assert_one_error_line(err) and "--force" in err
    assert xr.open_zarr(out).sizes["layer"] == 3  # untouched

    assert run(capsys, *args, "--layers", "1", "--force")[0] == 0
    assert xr.open_zarr(out).sizes["layer"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_trace_force_never_deletes_a_folder_that_is_not_zarr(capsys, tmp_path, prompts_file):
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    code, _, err = run(capsys, "trace", "--model", "tiny-llama", "--prompts", str(prompts_file),
                       "--out", str(folder), "--force")
    assert code == 2 and "not a zarr store" in assert_one_error_line(err)
    assert (folder / "notes.txt").read_text() == "keep me"


def test_trace_applies_edits_from_a_json_file(capsys, tmp_path, prompts_file, tiny_model):
    from explorer.interventions import Ablate, edits_to_json

    edits = [Ablate(layer=0, head=1)]
    edits_file = tmp_path / "edits.json"
    edits_file.write_text(edits_to_json(edits))
    out = tmp_path / "edited.zarr"
    assert run(capsys, "trace", "--model", "tiny-llama", "--prompts", str(prompts_file),
               "--edits", str(edits_file), "--out", str(out))[0] == 0
    direct = trace(tiny_model, PROMPTS, edits=edits, progress=False)
    plain = trace(tiny_model, PROMPTS, progress=False)
    back = xr.open_zarr(out)["resid_post"].values
    np.testing.assert_allclose(back, direct["resid_post"].values, rtol=1e-6, atol=1e-7)
    assert not np.allclose(back[:, :, 1:], plain["resid_post"].values[:, :, 1:], equal_nan=True)


# -- user errors: one line on stderr, exit 2 -----------------------------------------------

@pytest.mark.parametrize("content, message", [
    (None, r"edits file '.*edits.json' does not exist\."),
    ("[{\"kind\": \"ablate\", \"layer\": 0,", r"edits JSON does not parse: Expecting property name"),
    ('[{"kind": "shift", "layer": 0}]', r"`kind` must be one of 'ablate', .*; got 'shift'"),
    ('[{"kind": "steer", "layer": 0, "vector": [1.0, NaN, Infinity]}]',
     r"`vector` must hold finite numbers; 2 of its 3 entries are not \(nan at 1, inf at 2\)"),
])
def test_bad_edits_file_is_one_line_and_writes_nothing(capsys, tmp_path, prompts_file,
                                                       content, message):
    import re

    edits_file = tmp_path / "edits.json"
    if content is not None:
        edits_file.write_text(content)
    out = tmp_path / "edited.zarr"
    code, _, err = run(capsys, "trace", "--model", "tiny-llama", "--prompts", str(prompts_file),
                       "--edits", str(edits_file), "--out", str(out))
    assert code == 2 and re.search(message, assert_one_error_line(err)), err
    assert not out.exists()


def test_unknown_model_is_one_line_listing_the_known_names(capsys, tmp_path, prompts_file):
    code, out, err = run(capsys, "trace", "--model", "tiny-lama", "--prompts", str(prompts_file),
                         "--out", str(tmp_path / "x.zarr"))
    assert code == 2 and out == ""
    line = assert_one_error_line(err)
    for name in known_models():
        assert name in line
    assert "Did you mean 'tiny-llama'?" in line
    assert not (tmp_path / "x.zarr").exists()


def test_out_of_range_layer_names_the_range(capsys, tmp_path, prompts_file):
    code, _, err = run(capsys, "trace", "--model", "tiny-llama", "--prompts", str(prompts_file),
                       "--layers", "0,7", "--out", str(tmp_path / "x.zarr"))
    assert code == 2
    line = assert_one_error_line(err)
    assert "[0, 2]" in line and "7" in line
    code, _, err = run(capsys, "lens", "--model", "tiny-llama", "--prompt", "Hi", "--layers", "3")
    assert code == 2 and "[0, 2]" in assert_one_error_line(err)


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_empty_prompts_file(capsys, tmp_path, text):
    path = tmp_path / "empty.txt"
    path.write_text(text)
    code, _, err = run(capsys, "trace", "--model", "tiny-llama", "--prompts", str(path),
                       "--out", str(tmp_path / "x.zarr"))
    assert code == 2 and "no prompts" in assert_one_error_line(err)


def test_missing_prompts_file(capsys, tmp_path):
    code, _, err = run(capsys, "trace", "--model", "tiny-llama", "--prompts",
                       str(tmp_path / "nope.txt"), "--out", str(tmp_path / "x.zarr"))
    assert code == 2 and "does not exist" in assert_one_error_line(err)


@pytest.mark.parametrize("argv, message", [
    (["trace", "--model", "tiny-llama", "--prompts", "{p}", "--sites", "resid_pots", "--out", "{o}"],
     "Did you mean 'resid_post'?"),
    (["trace", "--model", "tiny-llama", "--prompts", "{p}", "--layers", "2-0", "--out", "{o}"],
     "runs backwards"),
    (["trace", "--model", "tiny-llama", "--prompts", "{p}", "--layers", "a", "--out", "{o}"],
     "`--layers` must be comma-separated ints or ranges"),
    (["trace", "--model", "tiny-llama", "--prompts", "{p}", "--batch-size", "0", "--out", "{o}"],
     "`batch_size` must be an int in [1, inf]"),
    (["trace", "--model", "tiny-llama", "--prompts", "{p}", "--positions", "-40", "--out", "{o}"],
     "position -40 is out of range"),
    (["trace", "--prompts", "{p}"], "the following arguments are required: --out"),
    (["lens", "--model", "tiny-llama", "--prompt", "Hi", "--k", "0"], "`k` must be an int in [1, 512]"),
    (["lens", "--model", "tiny-llama", "--prompt", "Hi", "--k", "two"], "invalid int value: 'two'"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_user_errors_are_one_line_with_exit_2(capsys, tmp_path, prompts_file, argv, message):
    argv = [a.format(p=prompts_file, o=tmp_path / "x.zarr") for a in argv]
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in assert_one_error_line(err)


def test_unexpected_errors_exit_1_and_suggest_debug(capsys, monkeypatch):
    import explorer.models

    def broken():
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(explorer.models, "known_models", broken)
    code, _, err = run(capsys, "models")
    assert code == 1
    line = assert_one_error_line(err)
    assert "unexpected RuntimeError: disk on fire second line" in line and "--debug" in line
    with pytest.raises(RuntimeError, match="disk on fire"):
        cli.main(["models", "--debug"])
    with pytest.raises(RuntimeError, match="disk on fire"):
        cli.main(["--debug", "models"])


def test_keyboard_interrupt_exits_130_quietly(capsys, monkeypatch):
    import explorer.models

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(explorer.models, "known_models", interrupted)
    code, out, err = run(capsys, "models")
    assert (code, out, err) == (130, "", "")


# -- lens --------------------------------------------------------------------------------

def test_lens_json_schema_and_values_match_logit_lens(capsys, tiny_model):
    prompt = "The cat sat on the mat"
    data = run_json(capsys, "lens", "--model", "tiny-llama", "--prompt", prompt, "--k", "3",
                    "--positions", "0,-1")
    direct = logit_lens(tiny_model, [prompt], k=3, positions=[0, -1])
    n_tokens = tiny_model.tokenize([prompt]).lengths[0]

    assert set(data) == {"model", "prompt", "k", "layers", "positions"}
    assert (data["model"], data["prompt"], data["k"], data["layers"]) == ("tiny-llama", prompt, 3, [0, 1, 2])
    assert [p["pos"] for p in data["positions"]] == [0, -1]
    assert [p["index"] for p in data["positions"]] == [0, n_tokens - 1]
    for j, entry in enumerate(data["positions"]):
        assert set(entry) == {"pos", "index", "token", "token_id", "output", "layers"}
        assert entry["token"] == str(direct["token"].values[0, j])
        assert entry["token_id"] == int(direct["token_id"].values[0, j])
        assert [t["token_id"] for t in entry["output"]] == direct["final_token_id"].values[0, j].tolist()
        assert [t["token"] for t in entry["output"]] == direct["final_token"].values[0, j].tolist()
        assert [layer["layer"] for layer in entry["layers"]] == [0, 1, 2]
        for li, layer in enumerate(entry["layers"]):
            assert [set(t) for t in layer["top"]] == [{"token", "token_id", "prob"}] * 3
            assert [t["token_id"] for t in layer["top"]] == direct["top_token_id"].values[0, j, li].tolist()
            assert [t["token"] for t in layer["top"]] == direct["top_token"].values[0, j, li].tolist()
            np.testing.assert_allclose([t["prob"] for t in layer["top"]],
                                       direct["top_prob"].values[0, j, li], rtol=1e-6)


def test_lens_every_position_by_default_and_a_plain_table(capsys, tiny_model):
    prompt = "Hello there"
    n_tokens = tiny_model.tokenize([prompt]).lengths[0]
    data = run_json(capsys, "lens", "--model", "tiny-llama", "--prompt", prompt, "--layers", "1-2")
    assert [p["index"] for p in data["positions"]] == list(range(n_tokens))
    assert data["k"] == 5 and data["layers"] == [1, 2]

    code, out, err = run(capsys, "lens", "--model", "tiny-llama", "--prompt", prompt)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[1].split() == ["layer", "top-1", "prob"]
    last = data["positions"][-1]
    assert len(lines) == 2 + 3 + 1  # header, title, 3 layers, output
    assert lines[-1].startswith("output")
    direct = logit_lens(tiny_model, [prompt], k=1, positions=[-1])
    for li, line in enumerate(lines[2:5]):
        assert line.startswith(str(li))
        assert line.split()[-1] == f"{float(direct['top_prob'].values[0, 0, li, 0]):.4f}"
    assert repr(last["token"]) in lines[0]


# -- cache -------------------------------------------------------------------------------

def small_dataset(seed: int) -> xr.Dataset:
    values = np.random.default_rng(seed).standard_normal((2, 3)).astype("float32")
    return xr.Dataset({"resid_post": (("prompt", "d_model"), values)}, attrs={"model": "tiny-llama"})


@pytest.mark.slow
def test_cache_stats_reduces_an_entry_on_each_scheduler(capsys, cache):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 5, 2, 4)).astype("float32")   # [prompt, pos, layer, d_model]
    x[1, 3:] = np.nan                                          # padding
    ds = xr.Dataset({"resid_post": (("prompt", "pos", "layer", "d_model"), x)},
                    coords={"layer": [3, 7]})
    store = ActivationStore(cache)
    key = store.put(store.key({"stats": 1}), ds, parts={"model": "tiny-llama"})
    real = ~np.isnan(x[..., 0])                                # [prompt, pos, layer]
    expect = [np.linalg.norm(x[:, :, i][real[:, :, i]], axis=-1).mean() for i in range(2)]
    for scheduler in ("synchronous", "threads", "local"):
        out = run_json(capsys, "cache", "stats", key, "--scheduler", scheduler,
                       "--memory-limit-mb", "512")
        assert out["dims"] == ["layer"] and out["tokens"] == int(real[..., 0].sum())
        np.testing.assert_allclose(out["norm_mean"], expect, rtol=1e-6)
    code, out, _ = run(capsys, "cache", "stats", key)
    assert code == 0 and "layer   7" in out
    code, _, err = run(capsys, "cache", "stats", key, "--scheduler", "thread")
    assert code == 2 and "Did you mean 'threads'" in assert_one_error_line(err)
    code, _, err = run(capsys, "cache", "stats", key, "--memory-limit-mb", "64")
    assert code == 2 and "--memory-limit-mb" in assert_one_error_line(err)
    code, _, err = run(capsys, "cache", "stats", key, "--site", "attn_z")
    assert code == 2 and "'attn_z' is not in the Dataset" in assert_one_error_line(err)


def test_cache_ls_du_rm_clean(capsys, cache):
    store = ActivationStore(cache)
    keys = [store.put(store.key({"n": i}), small_dataset(i),
                      parts={"model": "tiny-llama", "method": "trace", "sites": ["resid_post"],
                             "prompts": ["a", "b"]})
            for i in range(3)]

    listing = run_json(capsys, "cache", "ls")
    assert listing["path"] == str(store.activations_path)
    assert sorted(e["key"] for e in listing["entries"]) == sorted(keys)
    assert all(e["parts"]["n_prompts"] == 2 and e["problem"] is None for e in listing["entries"])
    code, out, _ = run(capsys, "cache", "ls")
    assert code == 0 and all(k in out for k in keys) and "3 entries" in out

    du = run_json(capsys, "cache", "du")
    assert du["activations"] == store.du() > 0
    assert du["total"] == du["activations"] + du["models"]

    assert run_json(capsys, "cache", "rm", keys[0]) == {"removed": 1}
    assert {e["key"] for e in store.ls()} == set(keys[1:])
    code, _, err = run(capsys, "cache", "rm", keys[0])
    assert code == 2 and f"no cache entry {keys[0]!r}" in assert_one_error_line(err)
    code, _, err = run(capsys, "cache", "rm")
    assert code == 2 and "KEY or --all" in assert_one_error_line(err)
    code, _, err = run(capsys, "cache", "rm", keys[1], "--all")
    assert code == 2 and "KEY or --all" in assert_one_error_line(err)

    leftover = store.activations_path / ".trash-deadbeef"  # an interrupted removal
    leftover.mkdir()
    (leftover / "x").write_bytes(b"123")
    assert run_json(capsys, "cache", "clean") == {"removed": 1}
    assert not leftover.exists()

    code, out, _ = run(capsys, "cache", "rm", "--all")
    assert code == 0 and "removed 2" in out
    assert store.ls() == [] and run_json(capsys, "cache", "ls")["entries"] == []


# -- serve and bench (their modules monkeypatched) ------------------------------------------

@pytest.fixture
def fake_gallery(monkeypatch):
    calls = []
    module = types.ModuleType("apps.gallery")
    module.serve = lambda **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "apps.gallery", module)
    return calls


def test_serve_binds_localhost_by_default_and_prints_the_url(capsys, fake_gallery):
    code, out, err = run(capsys, "serve", "--model", "tiny-llama")
    assert code == 0, err
    assert fake_gallery == [{"model": "tiny-llama", "port": 5006, "address": "127.0.0.1",
                             "show": False, "allow_websocket_origin": None, "remote": False,
                             "heavy_jobs": None, "warm_cache": True}]
    assert "http://127.0.0.1:5006/" in out and err == ""
    code, _, err = run(capsys, "serve", "--model", "tiny-llama", "--remote")
    assert code == 0, err
    assert fake_gallery[-1]["remote"] is True and fake_gallery[-1]["address"] == "127.0.0.1"
    code, _, err = run(capsys, "serve", "--model", "tiny-llama", "--no-warm-cache")
    assert code == 0, err
    assert fake_gallery[-1]["warm_cache"] is False


def test_serve_passes_address_port_and_origins_through(capsys, fake_gallery, monkeypatch):
    monkeypatch.delenv("EXPLORER_PASSWORD", raising=False)
    code, out, err = run(capsys, "serve", "--address", "0.0.0.0", "--port", "8000", "--show",
                         "--allow-websocket-origin", "lab.example:8000",
                         "--allow-websocket-origin", "localhost:8000")
    assert code == 2 and "needs a sign-in" in assert_one_error_line(err)   # off loopback
    assert fake_gallery == []
    code, out, err = run(capsys, "serve", "--address", "0.0.0.0", "--port", "8000", "--show",
                         "--allow-websocket-origin", "lab.example:8000",
                         "--allow-websocket-origin", "localhost:8000", "--no-auth")
    assert code == 0
    assert fake_gallery == [{"model": "smollm2-135m", "port": 8000, "address": "0.0.0.0",
                             "show": True, "remote": False, "heavy_jobs": None,
                             "warm_cache": True,
                             "allow_websocket_origin": ["lab.example:8000", "localhost:8000"]}]
    assert "http://0.0.0.0:8000/" in out and "anyone who can reach the port" in err
    monkeypatch.setenv("EXPLORER_PASSWORD", "pw-not-printed")
    code, out, err = run(capsys, "serve", "--address", "0.0.0.0", "--heavy-jobs", "2")
    assert code == 0 and "pw-not-printed" not in out + err
    assert fake_gallery[-1]["basic_auth"] == "pw-not-printed" and fake_gallery[-1]["heavy_jobs"] == 2
    code, _, err = run(capsys, "serve", "--heavy-jobs", "0")
    assert code == 2 and "`--heavy-jobs` must be an int in [1, 256]" in assert_one_error_line(err)
    code, _, err = run(capsys, "serve", "--port", "70000")
    assert code == 2 and "`--port` must be an int in [1, 65535]" in assert_one_error_line(err)
    assert len(fake_gallery) == 2


@pytest.fixture
def fake_bench(monkeypatch):
    calls = []
    module = types.ModuleType("explorer.bench")

    def run_bench(name, *, model=None, **options):
        if name not in module.BENCHES:
            raise InputError(f"`name` must be one of 'trace'; got {name!r}.")
        calls.append((name, model, options))
        return {"bench": name, "model": model, "ratio": 1.25, "options": options}

    module.run_bench = run_bench
    module.BENCHES = {"trace": None}
    monkeypatch.setitem(sys.modules, "explorer.bench", module)
    return calls


def test_bench_passes_name_model_and_options_through(capsys, fake_bench):
    data = run_json(capsys, "bench", "trace", "--model", "tiny-llama", "--option", "n=3",
                    "--option", "dtype=bfloat16", "--option", "sizes=[1, 2]", "--option", "fast=true")
    options = {"n": 3, "dtype": "bfloat16", "sizes": [1, 2], "fast": True}
    assert fake_bench == [("trace", "tiny-llama", options)]
    assert data == {"bench": "trace", "model": "tiny-llama", "ratio": 1.25, "options": options}

    code, out, _ = run(capsys, "bench", "trace")
    assert code == 0 and fake_bench[-1] == ("trace", None, {})
    assert "ratio" in out and "1.25" in out

    code, _, err = run(capsys, "bench", "nope")
    assert code == 2 and "got 'nope'" in assert_one_error_line(err)
    code, _, err = run(capsys, "bench", "trace", "--option", "n")
    assert code == 2 and "key=value" in assert_one_error_line(err)


# -- analysis subcommands ----------------------------------------------------------------

def fake_analysis(monkeypatch, name: str, register) -> None:
    module = types.ModuleType(name)
    if register is not None:
        module.register_cli = register
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(cli, "COMMAND_MODULES", (name,))


def test_analysis_module_adds_its_own_subcommand(capsys, monkeypatch, prompts_file):
    def handler(args):
        cli.print_json({"prompts": cli.read_prompts(args.prompts), "k": args.k, "model": args.model})

    def register_cli(subparsers):
        p = subparsers.add_parser("toy", help="a toy analysis")
        cli.add_model_option(p)
        p.add_argument("--prompts", required=True)
        p.add_argument("--k", type=int, default=2)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=handler)

    fake_analysis(monkeypatch, "fake_toy_analysis", register_cli)
    assert "toy" in cli.build_parser().format_help()
    code, out, _ = run(capsys, "toy", "--prompts", str(prompts_file), "--k", "4", "--json")
    assert code == 0
    assert json.loads(out) == {"prompts": PROMPTS, "k": 4, "model": "smollm2-135m"}


def test_threads_flag_sets_the_count_for_the_command_and_restores_it(capsys, monkeypatch):
    import torch

    seen = []

    def handler(args):
        seen.append(torch.get_num_threads())
        if args.fail:
            raise RuntimeError("boom")

    def register_cli(subparsers):
        p = subparsers.add_parser("toy", help="a toy analysis")
        p.add_argument("--fail", action="store_true")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=handler, default_threads=1)

    fake_analysis(monkeypatch, "fake_threads_analysis", register_cli)
    before = torch.get_num_threads()
    target = 2 if before != 2 else 3
    assert run(capsys, "toy")[0] == 0                      # the command's own default
    assert run(capsys, "toy", "--threads", str(target))[0] == 0
    assert run(capsys, "--threads", str(target), "toy", "--fail")[0] == 1   # even on error
    assert seen == [1, target, target]
    assert torch.get_num_threads() == before
    code, _, err = run(capsys, "toy", "--threads", "0")
    assert code == 2 and "--threads" in assert_one_error_line(err)
    assert torch.get_num_threads() == before


def test_analysis_module_that_fails_to_import_raises(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("explorer.analyses.no_such_module",))
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        cli.main(["models"])


@pytest.mark.parametrize("register, message", [
    (None, "has no register_cli"),
    (lambda sub: None, "added no subcommand"),
    (lambda sub: sub.add_parser("nojson").set_defaults(func=print), "has no --json flag"),
])
def test_analysis_module_that_breaks_the_contract_raises(monkeypatch, register, message):
    fake_analysis(monkeypatch, "fake_broken_analysis", register)
    with pytest.raises(TypeError, match=message):
        cli.main(["models"])


# -- helpers -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("0,5,10", [0, 5, 10]), ("0-3", [0, 1, 2, 3]), ("1, 4-5", [1, 4, 5]), ("7", [7]),
])
def test_parse_int_list_with_ranges(text, expected):
    assert cli.parse_int_list("--layers", text, ranges=True) == expected


def test_parse_int_list_errors():
    assert cli.parse_int_list("--positions", "0,-1") == [0, -1]
    with pytest.raises(InputError, match=r"`--positions` must be comma-separated ints; got '0-2'"):
        cli.parse_int_list("--positions", "0-2")
    with pytest.raises(InputError, match="`--layers` must be"):
        cli.parse_int_list("--layers", ",", ranges=True)


def test_negative_positions_may_follow_the_flag_with_a_space():
    args = cli.build_parser().parse_args(
        cli._join_negative_values(["lens", "--prompt", "Hi", "--positions", "-2,-1"]))
    assert isinstance(args, argparse.Namespace) and args.positions == "-2,-1"


# -- the installed entry point -------------------------------------------------------------

@pytest.mark.slow
def test_entry_point_runs_in_a_subprocess(cache):
    env = {**os.environ, "EXPLORER_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-m", "explorer.cli", "models"], capture_output=True,
                          text=True, cwd=REPO_ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    for name in known_models():
        assert name in done.stdout
    bad = subprocess.run([sys.executable, "-m", "explorer.cli", "cache", "rm", "no-such-key"],
                         capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]
    assert bad.stderr.startswith("explorer: error: no cache entry 'no-such-key'")


def test_print_summary_prints_json_or_one_line_per_key(capsys):
    from explorer.commands._common import print_summary

    summary = {"model": "m", "layers": [1, 2], "acc": {"a": float("nan")}, "n": np.int64(3)}
    print_summary(summary, as_json=True)
    assert json.loads(capsys.readouterr().out) == {"model": "m", "layers": [1, 2],
                                                   "acc": {"a": None}, "n": 3}
    print_summary(summary, as_json=False)
    assert capsys.readouterr().out.splitlines() == [
        "model: m", 'layers: [1, 2]', 'acc: {"a": null}', "n: 3"]


def test_number_options_take_their_type_and_default_from_the_keyword():
    from explorer.commands._common import add_number_options

    parser = argparse.ArgumentParser()
    add_number_options(parser, n_prompts=12, lr=1e-3)
    args = parser.parse_args([])
    assert (args.n_prompts, args.lr) == (12, 1e-3)
    assert type(args.n_prompts) is int and type(args.lr) is float
    args = parser.parse_args(["--n-prompts", "3", "--lr", "0.5"])
    assert (args.n_prompts, args.lr) == (3, 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--n-prompts", "2.5"])        # an int option refuses a float


def test_add_command_gives_the_shared_flags_and_applies_paper_before_the_handler(capsys):
    from explorer.commands._common import add_command
    from explorer.defaults import DEFAULT_MODEL
    from explorer.paper_settings import flag_values

    seen = []
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    p = add_command(sub, "toy", lambda args: seen.append(args.n_shots) or 0, paper="icl-heads",
                    threads=1, help="a toy", description="a toy command")
    p.add_argument("--n-shots", type=int, default=99)
    q = add_command(sub, "tiny", lambda args: 0, model=False, help="no model", description="")
    args = parser.parse_args(["toy", "--paper"])
    assert (args.model, args.remote, args.json, args.default_threads) == (
        DEFAULT_MODEL, False, False, 1)
    assert args.func(args) == 0 and seen == [flag_values("icl-heads")["n_shots"]] != [99]
    assert "--paper (" in capsys.readouterr().err              # said on stderr, not stdout
    args = parser.parse_args(["toy"])                          # without --paper: untouched
    assert args.func(args) == 0 and seen[-1] == 99
    assert "--model" not in q._option_string_actions and "--json" in q._option_string_actions
    assert q.get_default("default_threads") is None
