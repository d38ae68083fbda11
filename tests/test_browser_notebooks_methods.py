"""The second share of the example notebooks in a real JupyterLab, offline: the method notebooks.

What is checked and how: tests/_notebook_lab.py (every cell run from the Lab's Run menu on
``tiny-llama``, every view cell drawn, titles that fit, no overflow, no request outside the Lab).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from _notebook_lab import NOTEBOOK_FILES, check_in_lab, lab  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.mark.parametrize("name", NOTEBOOK_FILES[Path(__file__).name])
def test_notebook_draws_every_view_in_jupyterlab(browser, lab, name):  # noqa: F811
    check_in_lab(browser, lab, name)
