"""The global switches of `--fix`'s ladder (fixing/plan/ladder.py), applied in a candidate run only
when it asks for them (TRAINDX_RUNTIME_PATCHES, like runtime_patches.py); never in a plain run.
Each is a switch a user could flip in their own code; the arm measures whether flipping it pays.

- `checkpoint_off`: torch.utils.checkpoint's `checkpoint` calls the function directly (the
  activations are kept, the forward is not run again in backward); `checkpoint_sequential` goes
  through it too.
- `channels_last`: every 2-D convolution runs in NHWC: its weight is made channels_last once, its
  4-D input when it is not (the layout then propagates through the layers that follow).
- `cudnn_benchmark_on`: `torch.backends.cudnn.benchmark = True` as torch is imported.
- `bf16_autocast`: the outermost module call of each forward runs under
  `torch.autocast(<its parameters' device>, torch.bfloat16)` unless autocast is already on.
- `optimizer_foreach` / `optimizer_fused`: an optimizer built with neither asks for the
  multi-tensor (`foreach=True`) or the fused (`fused=True`) implementation.
- `compile_default_mode`: `torch.compile(..., mode=...)` compiles with the default mode.

Each is noted once in the events (`runtime_patch_installed`), so the arm proves it ran.
"""

from __future__ import annotations

from . import emit, importhooks, runtime_patches, schema

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

CHECKPOINT_OFF = "checkpoint_off"
CHANNELS_LAST = "channels_last"
CUDNN_BENCHMARK_ON = "cudnn_benchmark_on"
BF16_AUTOCAST = "bf16_autocast"
OPTIMIZER_FOREACH = "optimizer_foreach"
OPTIMIZER_FUSED = "optimizer_fused"
COMPILE_DEFAULT_MODE = "compile_default_mode"


def _installed(name: str, **fields: Any) -> None:
    emit(schema.RUNTIME_PATCH_INSTALLED, patch=name, **fields)


def _checkpoint_off(module: Any) -> None:
    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        for key in ("use_reentrant", "context_fn", "determinism_check", "debug", "preserve_rng_state"):
            kwargs.pop(key, None)
        return function(*args, **kwargs)

    module.checkpoint = checkpoint
    _installed(CHECKPOINT_OFF)


def _channels_last(torch: Any) -> None:
    conv = torch.nn.Conv2d
    original = conv._conv_forward
    nhwc = torch.channels_last

    def _conv_forward(self: Any, x: Any, weight: Any, bias: Any) -> Any:
        if weight is self.weight and not weight.is_contiguous(memory_format=nhwc):
            with torch.no_grad():  # once per layer: the parameter object stays the optimizer's
                self.weight.data = self.weight.data.contiguous(memory_format=nhwc)
            weight = self.weight
        if x.dim() == 4 and not x.is_contiguous(memory_format=nhwc):
            x = x.contiguous(memory_format=nhwc)
        return original(self, x, weight, bias)

    conv._conv_forward = _conv_forward
    _installed(CHANNELS_LAST)


def _benchmark_on(torch: Any) -> None:
    torch.backends.cudnn.benchmark = True
    _installed(CUDNN_BENCHMARK_ON)


def _bf16_autocast(torch: Any) -> None:
    modules = torch.nn.modules.module
    entered: dict[int, Any] = {}  # id(module) -> the autocast context it entered

    def pre(module: Any, args: Any) -> None:
        if entered or not module.training:
            return
        param = next(module.parameters(), None)
        device = param.device.type if param is not None else "cpu"
        if torch.is_autocast_enabled(device):
            return
        ctx = torch.autocast(device, dtype=torch.bfloat16)
        ctx.__enter__()
        entered[id(module)] = ctx

    def post(module: Any, args: Any, output: Any) -> None:
        ctx = entered.pop(id(module), None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    modules.register_module_forward_pre_hook(pre)
    modules.register_module_forward_hook(post, always_call=True)
    _installed(BF16_AUTOCAST)


def _optimizer(key: str, name: str) -> Any:
    def install(optim: Any) -> None:
        base = optim.Optimizer
        original = base.__init__

        def __init__(self: Any, params: Any, defaults: Any) -> None:
            if isinstance(defaults, dict) and key in defaults and not defaults.get(key):
                other = "foreach" if key == "fused" else "fused"
                if not defaults.get(other):
                    defaults = dict(defaults, **{key: True})
                    if other in defaults:
                        defaults[other] = None if other == "foreach" else False
            original(self, params, defaults)

        base.__init__ = __init__
        _installed(name)

    return install


def _compile_default(torch: Any) -> None:
    original = torch.compile

    def compile(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("mode", None)
        return original(*args, **kwargs)

    torch.compile = compile
    _installed(COMPILE_DEFAULT_MODE)


def register() -> None:
    asked = runtime_patches.requested()
    if CHECKPOINT_OFF in asked:
        importhooks.on_import("torch.utils.checkpoint", _checkpoint_off)
    if CHANNELS_LAST in asked:
        importhooks.on_import("torch", _channels_last)
    if CUDNN_BENCHMARK_ON in asked:
        importhooks.on_import("torch", _benchmark_on)
    if BF16_AUTOCAST in asked:
        importhooks.on_import("torch", _bf16_autocast)
    if OPTIMIZER_FOREACH in asked:
        importhooks.on_import("torch.optim", _optimizer("foreach", OPTIMIZER_FOREACH))
    if OPTIMIZER_FUSED in asked:
        importhooks.on_import("torch.optim", _optimizer("fused", OPTIMIZER_FUSED))
    if COMPILE_DEFAULT_MODE in asked:
        importhooks.on_import("torch", _compile_default)
