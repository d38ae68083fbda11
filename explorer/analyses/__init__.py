"""One module per interpretability method: pure functions from a Model and data to xarray."""
