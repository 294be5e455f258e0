"""Obfuscation variants named on a command line or in a config: ``default`` (a preset) or
``LABEL=PRESET:field=value,field=value`` (a preset with overrides, e.g. ``exact_out0=exact:outlier_dims=0``), or
``PRESET+field=value+...`` where ':' already means something else (llamacpp_quantized's ``PRESET:TYPE`` specs).

Override values are parsed by ObfuscationParams' own field types (``noise_shape=fisher`` is a string)."""
from __future__ import annotations

from .fields import parse_assignments


def parse_variant(text: str):
    """-> (label, ObfuscationParams); ValueError with the reason for a bad preset, field or value."""
    import aloepri

    head = text.split(":", 1)[0]
    if "=" in head:
        label, _, spec = text.partition("=")
    else:
        label, spec = text, text
    preset, _, over = spec.partition(":")
    overrides = parse_assignments(aloepri.ObfuscationParams, [i for i in over.split(",") if i]) if over else {}
    return label, aloepri.resolve_params(preset, **overrides)


def preset_params(text: str):
    """``PRESET`` or ``PRESET+field=value+...`` -> ObfuscationParams; UsageError with the reason otherwise."""
    import aloepri

    from .store import UsageError

    preset, *items = text.split("+")
    try:
        return aloepri.resolve_params(preset, **parse_assignments(aloepri.ObfuscationParams, items))
    except ValueError as e:
        raise UsageError(f"{text!r}: {e}") from None
