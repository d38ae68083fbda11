"""The bench layer's benches that measure one method (registered in `explorer.bench`).

Each module holds one bench function shaped for `explorer.bench.run_bench`
(``explorer bench NAME --json``): keyword options in, ``{"params", "figures", "notes"}`` out.
They call the analyses; analyses never import them. A bench that drives a page of ``apps``
reaches it through `explorer.commands._pages` (``importlib``), never by a static import.
`explorer.benches._memory.PeakRSS` is the one peak-memory sampler of every bench.
"""
