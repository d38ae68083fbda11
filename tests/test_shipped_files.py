"""The safetensors files that ship under datasets/: whole as shipped, and a damaged copy is
refused with one clear error naming the file and what is wrong (nothing is half-read)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from explorer._checks import StoreError, safetensors_problem
from explorer.analyses._training import datasets_from_safetensors
from explorer.analyses.parity import load_parity_run_safetensors

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "datasets").rglob("*.safetensors"))


def test_there_are_shipped_files_and_each_is_whole():
    assert {p.name for p in SHIPPED} >= {"parity_seed0.safetensors",
                                         "task_emergence_seed0_analysis.safetensors"}
    for path in SHIPPED:
        assert safetensors_problem(path) is None, path


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[: len(b) // 2], r"is \d+ bytes; its header says \d+"),
    (lambda b: b[:5], r"too short for a safetensors header"),
    (lambda b: b[:8] + b"{not json" + b[17:], r"cannot be read as safetensors"),
    (lambda b: (2**40).to_bytes(8, "little") + b[8:], r"header length of \d+ bytes"),
    (lambda b: b + b"\0" * 16, r"its header says"),
])
def test_a_damaged_shipped_file_is_refused_with_one_clear_error(tmp_path, damage, message):
    source = ROOT / "datasets" / "dynamics" / "parity_seed0.safetensors"
    whole = source.read_bytes()
    path = tmp_path / source.name
    path.write_bytes(damage(whole))
    for read in (datasets_from_safetensors, load_parity_run_safetensors):
        with pytest.raises(StoreError, match=rf"parity_seed0.safetensors' is damaged \(.*{message}"
                                             r".*\); restore it \(`git checkout -- "):
            read(path)
    shutil.copyfile(source, path)                      # the intact copy reads as before
    run, analysis = load_parity_run_safetensors(path)
    assert run.sizes["step"] == 101 and analysis.sizes["step"] == 101
