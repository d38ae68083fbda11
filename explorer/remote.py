"""Remote models on NDIF through nnsight's remote backend.

The model is built on the meta device from its Hugging Face config (no weights are
downloaded); traces are sent to the NDIF host and only saved values come back.
Configuration comes from the environment (``NDIF_API_KEY``, ``NDIF_HOST``) or nnsight's
own config file. The key is never put in a message, a log line, an export or the UI:
`redact` scrubs it from any text that leaves this module.
"""
from __future__ import annotations

import os
from typing import Any

from ._checks import RemoteError

__all__ = ["remote_config", "load_remote_model", "redact"]


def remote_config() -> dict[str, Any]:
    """Host and whether a key is set (never the key itself)."""
    from nnsight import CONFIG

    key = os.environ.get("NDIF_API_KEY") or CONFIG.API.APIKEY
    host = os.environ.get("NDIF_HOST") or CONFIG.API.HOST
    return {"host": host, "api_key_set": bool(key)}


def redact(text: str) -> str:
    """Replace the API key, wherever it appears in ``text``, with '***'."""
    from nnsight import CONFIG

    for key in {os.environ.get("NDIF_API_KEY"), CONFIG.API.APIKEY}:
        if key:
            text = text.replace(key, "***")
    return text


def load_remote_model(name: str, *, dtype: str = "float32") -> Any:
    """A `Model` whose traces run on NDIF. Needs a hub id NDIF serves and an API key.

    Raises
    ------
    RemoteError
        No API key configured, or the model's config cannot be fetched from the hub.
    """
    from nnsight import CONFIG

    from .models import Model, _MODEL_TYPES, ARCHITECTURES, _spec_from_config  # noqa: PLC2701

    cfg = remote_config()
    if not cfg["api_key_set"]:
        raise RemoteError(
            "remote=True needs an NDIF API key: set the NDIF_API_KEY environment variable "
            f"(host: {cfg['host']}; set NDIF_HOST to use another deployment)."
        )
    CONFIG.API.HOST = cfg["host"]
    from nnsight import TransformersModel
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
        family = _MODEL_TYPES.get(config.model_type)
        if family is None:
            raise RemoteError(f"model type {config.model_type!r} has no entry in the "
                              "architecture table.")
        arch = ARCHITECTURES[family]
        nn_model = TransformersModel(name, task="text-generation", rename=dict(arch.rename))
    except RemoteError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to build the meta model is reported
        raise RemoteError(
            f"could not prepare remote model {name!r}: {redact(str(e).splitlines()[0])[:200]}. "
            "The model's config and tokenizer must be reachable on the Hugging Face hub."
        ) from None
    hf = nn_model._module
    spec = _spec_from_config(hf, name=name, weights=f"remote:{cfg['host']}")
    return Model(nn_model, hf, nn_model.tokenizer, spec, arch, remote=True)
