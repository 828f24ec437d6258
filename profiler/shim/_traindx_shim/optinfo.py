"""What the shim reads of an optimizer as it is made: the parameters it trains (MFU's N) and how
it steps them (its tensors, foreach and fused), without touching the tensors' data."""

from __future__ import annotations

from typing import Any


def trained_params(optimizer: Any) -> int | None:
    """The elements of the parameters an optimizer trains (MFU's N); None if unreadable."""
    try:
        seen: set[int] = set()
        total = 0
        for group in optimizer.param_groups:
            for p in group.get("params", ()):
                if id(p) not in seen and getattr(p, "requires_grad", True):
                    seen.add(id(p))
                    total += int(p.numel())
        return total
    except Exception:
        return None


def implementation(optimizer: Any) -> dict[str, Any]:
    """How the optimizer steps: its parameter tensors and the foreach/fused choices it was
    given (None: torch's default, multi-tensor on CUDA), read without touching the tensors."""
    try:
        defaults = getattr(optimizer, "defaults", {}) or {}
        tensors = sum(len(group.get("params", ())) for group in optimizer.param_groups)
        return {
            "tensors": int(tensors),
            "foreach": defaults.get("foreach"),
            "fused": defaults.get("fused"),
        }
    except Exception:
        return {}
