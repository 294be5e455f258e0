"""Models by one name everywhere: the bundled names of ``aloepri models`` (``smollm2``, ``qwen-coder``)."""
from __future__ import annotations

from pathlib import Path

from .store import UsageError


def model_names() -> list[str]:
    from aloepri.models import BUNDLED_MODELS

    return list(BUNDLED_MODELS)


def model_path(name: str) -> Path:
    """The bundled model's file (built on first use); UsageError naming the install command if it is absent."""
    from aloepri.models import BUNDLED_MODELS, ModelNotInstalledError, resolve_model

    if name not in BUNDLED_MODELS:
        raise UsageError(f"unknown model {name!r}; models: {', '.join(BUNDLED_MODELS)}")
    try:
        return resolve_model(name)
    except ModelNotInstalledError as e:
        raise UsageError(str(e)) from None
