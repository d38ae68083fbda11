"""The example notebooks in one real JupyterLab, offline.

What is checked and how: tests/_notebook_lab.py (every cell run from the Lab's Run menu on
``tiny-llama``, every view cell drawn, titles that fit, no overflow, no request outside the
Lab, the saved notebook's outputs). For the quickstart's lens view and the workspace atlas's
attention view, a slider moved in the browser redraws the plot: the kernel round trip. The
HTML export is checked in test_browser_notebook_export.py.
"""
from __future__ import annotations

import pytest
from _notebook_lab import LAB_NOTEBOOKS, check_in_lab, lab, lab_tab  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.mark.parametrize("name", LAB_NOTEBOOKS)
def test_notebook_draws_every_view_in_jupyterlab(lab_tab, name):  # noqa: F811
    check_in_lab(lab_tab, name)
