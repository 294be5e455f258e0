"""Obfuscation variants named on a benchmark's command line: ``exact`` (a preset) or
``LABEL=PRESET:key=value,key=value`` (a preset with overrides, e.g. ``exact_out0=exact:outlier_dims=0``)."""
from __future__ import annotations


def parse_variant(text: str):
    """-> (label, ObfuscationParams)."""
    import aloepri

    label, _, spec = text.partition("=") if "=" in text.split(":")[0] else (text, "", text)
    preset, _, over = spec.partition(":")
    overrides = {}
    for item in filter(None, over.split(",")):
        k, _, v = item.partition("=")
        overrides[k] = float(v) if "." in v or "e" in v else int(v)
    return label, aloepri.resolve_params(preset, **overrides)
