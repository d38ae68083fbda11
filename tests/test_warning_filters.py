"""The suite's warning filters (pyproject.toml) act: a warning attributed to one of the
project's modules (`explorer.*`, `apps.*`) fails the test that meets it, zarr's
`UnstableSpecificationWarning` does wherever it comes from, and other libraries' warnings
are only reported."""
from __future__ import annotations

import warnings

import pytest


def _warn_as(module: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` run as a line of ``module`` (the name Python attributes it to)."""
    code = compile("import warnings\nwarnings.warn('raised in ' + __name__, category)",
                   f"<{module}>", "exec")
    exec(code, {"__name__": module, "category": category})


@pytest.mark.parametrize("module", ["explorer", "explorer.store", "explorer.analyses.lens",
                                    "apps", "apps.gallery"])
@pytest.mark.parametrize("category", [UserWarning, RuntimeWarning, FutureWarning,
                                      DeprecationWarning, PendingDeprecationWarning])
def test_a_warning_from_the_projects_modules_is_an_error(module, category):
    """Deprecation notices too: a library's API that the project still calls fails the test
    that meets it (the filters that ignore the libraries' own notices must not cover it)."""
    with pytest.raises(category, match=f"raised in {module}$"):
        _warn_as(module, category)


@pytest.mark.parametrize("module", ["xarray.core.dataset", "explorers_notebook", "appsmith",
                                    "test_warning_filters"])
@pytest.mark.parametrize("category", [UserWarning, PendingDeprecationWarning])
def test_a_warning_from_elsewhere_is_reported_not_raised(module, category):
    with warnings.catch_warnings(record=True) as seen:      # keeps the suite's filters
        _warn_as(module, category)
    assert [str(w.message) for w in seen] == [f"raised in {module}"]


def test_panels_deprecation_notice_raised_at_a_page_line_is_an_error():
    """Panel attributes its 2.0 notices (``name`` -> ``label``, ``button_type`` -> ``color``)
    to the first caller outside Panel: in a page module, that is an error."""
    code = compile("import panel as pn\npn.widgets.Button(name='Go', button_type='primary')",
                   "<apps.somepage>", "exec")
    with pytest.raises(PendingDeprecationWarning, match="deprecated"):
        exec(code, {"__name__": "apps.somepage"})


def test_zarrs_unstable_specification_warning_is_an_error_anywhere():
    from zarr.errors import UnstableSpecificationWarning

    with pytest.raises(UnstableSpecificationWarning, match="raised in zarr.core.dtype"):
        _warn_as("zarr.core.dtype", UnstableSpecificationWarning)
