"""An example notebook executed and exported to HTML with nbconvert draws its plots offline.

``dynamics.ipynb`` exported with ``jupyter nbconvert --to html --execute``: its four plots
draw in a page that may fetch nothing but the file (tests/_notebook_lab.py,
`check_exported_html`). The notebooks in JupyterLab: test_browser_notebooks.py.
"""
from __future__ import annotations

import pytest
from _notebook_lab import check_exported_html

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_exported_html_draws_without_network(browser, tmp_path):
    """dynamics.ipynb executed and exported with nbconvert: its four plots draw in a page that
    can load nothing but the file."""
    check_exported_html(browser, tmp_path)
