"""Training evidence and the rank, from torch: the hooks that tell `training_evidence` and
`rank_known` (see `roles` for why these and not program names).

- `init_process_group` returning: the rank and world size from the process group itself;
- a torch optimizer built or stepped, a backward run (`torch.autograd.backward`, which
  `Tensor.backward` calls; not `torch.autograd.grad`, which compiled code may call and which
  dynamo would then have to trace through our wrapper): this process trains.
- `destroy_process_group`: the job is done with its ranks, so the queued events are written
  now. Ray Train destroys the process group of every worker and then ends the worker with
  `ray.kill`, a quick exit that runs no atexit: without this the last step (the writer's last
  FLUSH_INTERVAL_S) was lost.
Each hook is a thin wrapper that calls the original first or last and swallows its own errors.
"""

from __future__ import annotations

import functools
import sys

from . import get_writer, guarded, importhooks, is_training, rank_known, report_error, training_evidence

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def _wrap_init_process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            # torch is imported here only once the job has imported it: the shim never imports it first
            import torch.distributed as dist

            training_evidence("init_process_group")
            rank_known(dist.get_rank(), dist.get_world_size())
        except Exception as exc:
            report_error("init_process_group hook", exc)
        return result

    init_process_group.__traindx_wrapped__ = True  # type: ignore[attr-defined]
    return init_process_group


def _wrap_destroy_process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            writer = get_writer()
            if writer is not None:
                writer.flush()
        except Exception as exc:
            report_error("destroy_process_group hook", exc)
        return original(*args, **kwargs)

    destroy_process_group.__traindx_wrapped__ = True  # type: ignore[attr-defined]
    return destroy_process_group


def _wrap_evidence(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_training():
            try:
                training_evidence(kind)
            except Exception as exc:
                report_error(f"{kind} evidence", exc)
        return original(*args, **kwargs)

    wrapper.__traindx_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _patch(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name, None)
    if original is None or getattr(original, "__traindx_wrapped__", False):
        return
    setattr(owner, name, make(original))


@guarded("distributed import hook")
def _on_distributed(c10d: Any) -> None:
    _patch(c10d, "init_process_group", _wrap_init_process_group)
    _patch(c10d, "destroy_process_group", _wrap_destroy_process_group)
    # modules that bound the names before us; what still slips through, the writer's poll finds
    for attr in ("init_process_group", "destroy_process_group"):
        wrapped = getattr(c10d, attr, None)
        for name in ("torch.distributed", "torch.distributed.device_mesh"):
            module = sys.modules.get(name)
            if (
                module is not None
                and getattr(module, attr, None) is not None
                and not getattr(getattr(module, attr), "__traindx_wrapped__", False)
            ):
                setattr(module, attr, wrapped)


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not is_training():
        try:
            training_evidence("optimizer_step")
        except Exception as exc:
            report_error("optimizer_step evidence", exc)


@guarded("torch import hook (training evidence)")
def _on_torch(torch: Any) -> None:
    # torch is imported here only once the job has imported it: the shim never imports it first
    from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

    _patch(Optimizer, "__init__", lambda f: _wrap_evidence(f, "optimizer"))
    _patch(torch.autograd, "backward", lambda f: _wrap_evidence(f, "backward"))
    register_optimizer_step_pre_hook(_on_optimizer_step)
    if torch.distributed.is_available():
        _on_distributed(torch.distributed.distributed_c10d)


def register() -> None:
    importhooks.on_import("torch", _on_torch)
