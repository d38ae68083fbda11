"""The pages' heatmaps draw where pandas stores strings in pyarrow (pandas 3 with pyarrow)."""
import numpy as np
import pandas as pd
import pytest


def test_a_heatmap_with_token_hover_columns_renders_with_pyarrow_installed():
    pytest.importorskip("pyarrow")
    import holoviews as hv

    from apps import theme  # noqa: F401 - sets pandas' string storage for the pages

    hv.extension("bokeh")
    # [layer, pos] scores with a token string per cell, as the attention and lens pages build
    df = pd.DataFrame({"pos": np.tile(np.arange(4), 3), "layer": np.repeat(np.arange(3), 4),
                       "score": np.arange(12.0), "token": list("abcd") * 3})
    assert type(df["token"].array).__name__ == "StringArray"   # python-backed, not Arrow
    plot = hv.render(hv.HeatMap(df, ["pos", "layer"], ["score", "token"]))
    assert plot is not None
