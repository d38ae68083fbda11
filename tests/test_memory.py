"""Slider-style repeated runs must not grow the process: no memory kept across traces.

An app slider re-runs the model on every move, hundreds of times a session; nnsight has had
leaks across traces (saved values kept alive by reference cycles). After a warm-up, 500 runs
must grow the resident set (VmRSS) by under 5%, and leave no more live tensors behind.
"""
from __future__ import annotations

import gc

import pytest
import torch

from explorer.interventions import Steer
from explorer.lens import logit_lens
from explorer.trace import clean_run, run_with

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "One two"]
WARM_UP, RUNS = 50, 500




def rss_kib() -> int:
    """Resident set size of this process, from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])  # "VmRSS:  123456 kB"
    raise RuntimeError("no VmRSS line in /proc/self/status")


def live_tensors() -> int:
    gc.collect()
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


def assert_no_growth(run_once):
    for i in range(WARM_UP):
        run_once(i)
    tensors_before = live_tensors()
    rss_before = rss_kib()
    for i in range(RUNS):
        run_once(WARM_UP + i)
    rss_after = rss_kib()
    growth = (rss_after - rss_before) / rss_before
    assert growth < 0.05, f"RSS grew {100 * growth:.1f}% ({rss_before} -> {rss_after} KiB)"
    assert live_tensors() <= tensors_before, "tensors outlive the runs that made them"


def test_steer_slider_with_resume_does_not_grow(tiny_model):
    clean = clean_run(tiny_model, PROMPTS)
    direction = torch.randn(tiny_model.spec.d_model, generator=torch.Generator().manual_seed(0))

    def slider_move(i):
        alpha = (i % 21 - 10) / 2  # the slider sweeps -5..5
        ds = run_with(tiny_model, PROMPTS, [Steer(1, direction, alpha=alpha, positions=(-1,))],
                      resume=clean)
        assert ds.logits.shape[0] == 2

    assert_no_growth(slider_move)


def test_lens_slider_does_not_grow(tiny_model):
    direction = torch.randn(tiny_model.spec.d_model, generator=torch.Generator().manual_seed(1))

    def slider_move(i):
        ds = logit_lens(tiny_model, PROMPTS, k=3,
                        edits=[Steer(0, direction, alpha=(i % 11) / 5)])
        assert ds.top_prob.shape[:2] == (2, 10)

    assert_no_growth(slider_move)
