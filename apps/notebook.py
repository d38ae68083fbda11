"""Turn the views on in a Jupyter notebook, offline: `extension` is every notebook's one call.

Panel's and HoloViews' notebook extensions load BokehJS, Panel's JavaScript and their styles
from a CDN unless told otherwise; a lab with no network (or behind a firewall) then shows
nothing where a plot or a view should be, and reports no error. `extension` loads them
inline from the installed packages and gives every plot the pages' Bokeh theme
(`theme.bokeh_theme`: the same fonts, ticks that never collide), so a view in a notebook
draws as it does in the gallery.

    from apps import notebook
    notebook.extension()

Then display a view (``LensView(model)``) or a HoloViews element as the last expression of
a cell. Widgets in the output talk to the kernel through Panel's JupyterLab extension
(installed with Panel). A notebook exported to HTML (``jupyter nbconvert --to html``) keeps
its plots, drawn from the embedded data, with no network either.

Two things the served pages have stay off here, because Panel loads them from its CDN even
in inline mode: the Fast design's web components (ES modules; the widgets keep Panel's own
look) and the notification toasts (`theme.notify` then only logs).
"""
from __future__ import annotations

from typing import Any

__all__ = ["extension"]


def extension(**panel_options: Any) -> None:
    """Load everything the views and plots need into this notebook, from the installed packages.

    HoloViews with its Bokeh backend and Panel, both with their JavaScript and styles inlined
    (nothing is fetched from outside the notebook server), views stretched to the output
    area's width, and the pages' Bokeh theme. Call it once, before the first view or plot.

    Parameters
    ----------
    **panel_options
        Passed on to `panel.extension`, over the defaults here (``inline=True``,
        ``notifications=False``, ``sizing_mode="stretch_width"``).
    """
    import holoviews as hv
    import panel as pn
    from holoviews.core.dimension import LabelledData

    from apps import theme

    options = {"inline": True, "notifications": False, "sizing_mode": "stretch_width",
               **panel_options}
    # HoloViews first: its notebook hooks (a displayed element renders as a plot) and its
    # Bokeh renderer; inline=False there would publish CDN script tags.
    hv.extension("bokeh", inline=True, logo=False)
    # pages call hv.extension("bokeh") when imported; in this notebook that loads inline too
    hv.extension.inline = True
    pn.extension(**options)
    hv.renderer("bokeh").theme = theme.bokeh_theme()
    # HoloViews' own notebook output links Panel's style sheets on the CDN; shown through
    # Panel they are inlined, as every view's are.
    hv.Store.set_display_hook("html+js", LabelledData, _shown_by_panel)
    # and so are those of the models a widget's change sends later (a view's new plot), once
    # every hook (the design's among them) has set them
    viewable = pn.viewable.Viewable
    if not getattr(viewable._preprocess, "_inlines_style_sheets", False):
        preprocess = viewable._preprocess

        def _preprocess(self: Any, root: Any, changed: Any = None, old_models: Any = None) -> None:
            preprocess(self, root, changed, old_models)
            _inline_style_sheets(self, root)

        _preprocess._inlines_style_sheets = True
        viewable._preprocess = _preprocess


def _inline_style_sheets(viewable: Any, root: Any) -> None:
    """Replace every style sheet linked on Panel's CDN under ``root`` by its installed copy."""
    from bokeh.models import UIElement
    from panel.io.notebook import patch_inline_stylesheets

    for model in root.select({"type": UIElement}):
        patch_inline_stylesheets(model)


def _shown_by_panel(obj: Any) -> tuple[dict, dict] | None:
    """A HoloViews object's notebook output, rendered as a Panel pane (inline resources)."""
    import holoviews as hv
    import panel as pn

    if "html" not in hv.Store.display_formats:
        return None
    return pn.panel(obj)._repr_mimebundle_()
