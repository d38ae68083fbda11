"""Reading the major ticks that BokehJS drew on the axes of a page's plots."""
from __future__ import annotations

_AXIS_TICKS = """(prefix) => {
  const out = []
  for (const v of Bokeh.index.all_views()) {
    const type = v.model.type || ''
    if (!type.endsWith('Axis') || v.parent == null || v.parent.model.title == null) continue
    const title = String(v.parent.model.title.text || '')
    if (!title.startsWith(prefix)) continue
    const dim = v.dimension
    const ticks = [...v.tick_coords.major[dim]]
    // a power of ten drawn as base and raised exponent (LogTickFormatter): "10^-6"
    const text = box => typeof box.text === 'string' ? box.text
        : box.base != null && box.expo != null ? `${text(box.base)}^${text(box.expo)}` : ''
    const labels = v.compute_labels(ticks).items.map(text)
    out.push({title, type, axis: dim === 0 ? 'x' : 'y', ticks, labels})
  }
  return out
}"""


def axis_ticks(page, title_prefix: str = "") -> list[dict]:
    """Per axis of each plot whose title starts with ``title_prefix``: its model type
    (``LogAxis``...), ``x``/``y``, the major tick values and the labels drawn for them."""
    return page.evaluate(_AXIS_TICKS, title_prefix)


def log_axis_labels(page, title_prefix: str) -> list[list[str]]:
    """The tick labels of every log axis of the plots whose title starts with ``title_prefix``."""
    return [a["labels"] for a in axis_ticks(page, title_prefix) if a["type"] == "LogAxis"]
