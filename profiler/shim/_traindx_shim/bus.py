"""An in-process bus between the shim's modules: one module says that something happened (a step
ended), the others that care subscribe. So `steps` never imports the modules that react to its
boundaries (`compiles` harvests torch.compile's metrics at each step end), and no two shim
modules import each other. Topics are named in `schema`.

A subscriber that raises is recorded as a shim_error; the others and the job run on.
"""

from __future__ import annotations

from . import report_error

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_subscribers: dict[str, list[Callable[..., Any]]] = {}


def subscribe(topic: str, callback: Callable[..., Any]) -> None:
    """Call `callback(*args)` each time `topic` is published (in the order of subscription)."""
    _subscribers.setdefault(topic, []).append(callback)


def publish(topic: str, *args: Any) -> None:
    for callback in tuple(_subscribers.get(topic, ())):
        try:
            callback(*args)
        except Exception as exc:
            report_error(f"{topic} subscriber {getattr(callback, '__name__', callback)}", exc)
