"""The first share of the example notebooks in a real JupyterLab, offline, and the HTML export.

What is checked and how: tests/_notebook_lab.py. Here: the quickstart's lens view and the
workspace atlas's attention view (a slider moved in the browser redraws the plot: the kernel
round trip), the training-dynamics and editing notebooks, and ``dynamics.ipynb`` exported with
nbconvert drawing its plots in a page that may fetch nothing but the file.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from _notebook_lab import NOTEBOOK_FILES, check_exported_html, check_in_lab, lab  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.mark.parametrize("name", NOTEBOOK_FILES[Path(__file__).name])
def test_notebook_draws_every_view_in_jupyterlab(browser, lab, name):  # noqa: F811
    check_in_lab(browser, lab, name)


def test_exported_html_draws_without_network(browser, tmp_path):
    """dynamics.ipynb executed and exported with nbconvert: its four plots draw in a page that
    can load nothing but the file."""
    check_exported_html(browser, tmp_path)
