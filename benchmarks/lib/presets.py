"""Presets as results record them: how parameters stored with an old result differ from today's preset."""
from __future__ import annotations


def params_drift(preset: str | None, recorded: dict | None, **overrides) -> str:
    """'' when ``recorded`` (ObfuscationParams.to_dict() saved with a result) equals ``preset`` with ``overrides``
    today; else 'field=recorded (now X), ...' over the fields both have, so a table never silently shows old
    results under a preset whose meaning changed since."""
    if preset is None or not recorded:
        return ""
    import aloepri

    now = aloepri.resolve_params(preset, **overrides).to_dict()
    changed = [f"{k}={recorded[k]} (now {now[k]})" for k in now if k in recorded and recorded[k] != now[k]]
    missing = [k for k in now if k not in recorded]
    parts = changed + ([f"not recorded: {', '.join(missing)}"] if missing else [])
    return "; ".join(parts)
