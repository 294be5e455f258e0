"""Presets as results record them: how parameters stored with an old result differ from today's preset."""
from __future__ import annotations


def params_drift(preset: str | None, recorded: dict | None, **overrides) -> str:
    """'' when ``recorded`` (ObfuscationParams.to_dict() saved with a result) equals ``preset`` with ``overrides``
    today, over the fields both have; else 'field=recorded (now X), ...', so a table never silently shows old
    results under a preset whose meaning changed since."""
    if preset is None or not recorded:
        return ""
    import aloepri

    now = aloepri.resolve_params(preset, **overrides).to_dict()
    return "; ".join(f"{k}={recorded[k]} (now {now[k]})" for k in now if k in recorded and recorded[k] != now[k])


def unrecorded_fields(records: list[dict | None]) -> list[str]:
    """ObfuscationParams fields that some recorded parameter dicts lack (they predate those fields)."""
    import dataclasses

    import aloepri

    names = [f.name for f in dataclasses.fields(aloepri.ObfuscationParams)]
    return [n for n in names if any(r is not None and n not in r for r in records)]


def drift_notes(rows: list[tuple[str, str | None, dict | None, dict]]) -> str:
    """Markdown notes to append to a table of (label, preset, recorded params, overrides) rows: value drift per
    row, then one line on fields older rows did not record; '' when there is nothing to say."""
    notes = [f"- {label}: measured with parameters unlike today's: {d}"
             for label, preset, rec, over in rows if (d := params_drift(preset, rec, **over))]
    missing = unrecorded_fields([rec for _, _, rec, _ in rows])
    if missing:
        notes.append(f"- some rows predate (recorded no value for) {', '.join(missing)}")
    return "\n\n" + "\n".join(notes) if notes else ""
