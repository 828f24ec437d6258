"""Values as the report shows them: every string clipped and redacted, numbers that may be NaN
read as None, step numbers as ranges, frames as file:line (function)."""

import math

from traindx.common import redact

MAX_TEXT = 2000

redact_text = redact.redact_text  # every string shown goes through clip: log lines included


def clip(text, limit=MAX_TEXT):
    text = redact_text(str(text))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def num(value):
    """A float, or None for missing/NaN (pandas hands both)."""
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) or math.isinf(f) else f


def text_of(value):
    """A string column's value: '' for None and pandas' NaN."""
    return value if isinstance(value, str) else ("" if value is None or num(value) is None else str(value))


def median(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def ranges(numbers):
    """[0, 1, 2, 5, 7, 8] -> '0–2, 5, 7–8' (short for long runs)."""
    numbers = sorted({int(n) for n in numbers})
    if not numbers:
        return ""
    parts, start, prev = [], numbers[0], numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(str(start) if start == prev else f"{start}–{prev}")
        if n is not None:
            start = prev = n
    if len(parts) > 12:
        parts = parts[:10] + [f"… ({len(numbers)} steps)"]
    return ", ".join(parts)


def frame_label(frame):
    if not isinstance(frame, dict):
        return clip(frame, 300) if frame else ""
    where = frame.get("file") or frame.get("filename") or ""
    line = frame.get("line")
    func = frame.get("function") or frame.get("name") or ""
    loc = f"{where}:{line}" if where and line else where
    return clip(f"{loc} ({func})" if func and loc else (loc or func), 400)
