"""The gallery's pages by slug, with their navigation titles, in navigation order.

Plain data, free of the pages themselves: the gallery pairs each slug with its view class
(`apps.gallery.VIEWS`) and the home page links to them without importing the gallery.
"""
from __future__ import annotations

__all__ = ["PAGE_TITLES"]

PAGE_TITLES: dict[str, str] = {
    "lens": "Logit lens",
    "saturation": "Saturation events",
    "conflicts": "Knowledge conflicts",
    "icl-heads": "ICL heads",
    "itda": "ITDA dictionaries",
    "neuron-eval": "Neuron explanations",
    "parity": "Streaming parity",
    "linear-icl": "Linear ICL",
    "task-emergence": "Task-vector emergence",
    "circuits": "Circuits",
    "shattering": "Representation shattering",
    "unlearning": "Unlearning",
    "attention": "Attention",
    "atlas": "Head atlas",
    "dla": "Logit attribution",
    "features": "Feature dashboards",
    "patching": "Activation patching",
    "compare": "Two prompts",
    "study": "User study",
}
