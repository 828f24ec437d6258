"""Step times and losses from the job's own log lines, for steps the shim cannot see and for the
loss curve: Megatron, torchtitan, DeepSpeed, nanoGPT, pytorch/examples, Lightning's progress
bar, HF Trainer / ms-swift dicts, slime, a generic `step N ... loss X` line, or the user's own
regex (`diagnose --log-regex`).

Every line is parsed with ANSI colour codes removed (torchtitan colours each field). A parsed
line is {'step', 'loss', 'step_time_s', 'format', 'tokens'}; `step` is None where the line does
not carry one (HF Trainer's dicts): RunRecord.log_steps gives those the shim's step count.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import regex as bounded_re  # the user's --log-regex: the `regex` package's matches take a timeout

# CSI sequences (colours, cursor moves) and the OSC / lone-escape leftovers of progress bars
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf)"

_MEGATRON = re.compile(
    r"iteration\s+(?P<step>\d+)/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*(?P<ms>[\d.]+)"
    rf"(?:.*?lm loss:\s*(?P<loss>{_NUM}))?"
)
# torchtitan/components/metrics.py: "step: {step:2}  loss: {loss:8.5f}  grad_norm: ..."
_TORCHTITAN = re.compile(rf"\bstep:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{_NUM})")
# DeepSpeed engine (steps_per_print): "steps: 10 loss: 0.1234 iter time (s): 0.050 samples/sec"
_DEEPSPEED = re.compile(
    rf"\bsteps:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{_NUM})"
    r"(?:\s+iter time \(s\):\s*(?P<s>[\d.]+))?"
)
# DeepSpeed's pipeline engine and timers: "[Rank 0] step=10, skipped=0, lr=[...], mom=[...]"
_DEEPSPEED_RANK = re.compile(r"\[Rank \d+\] step=(?P<step>\d+), skipped=\d+")
# nanoGPT train.py: "iter 10: loss 6.9312, time 35.12ms, mfu 0.01%"
_NANOGPT = re.compile(rf"\biter (?P<step>\d+): loss (?P<loss>{_NUM}), time (?P<ms>[\d.]+)ms")
# pytorch/examples: "| epoch   1 |   200/ 2983 batches | lr 20.00 | ms/batch 36.80 | loss  7.51 |"
_EXAMPLES = re.compile(
    r"\|\s*epoch\s+(?P<epoch>\d+)\s*\|\s*(?P<batch>\d+)\s*/\s*(?P<of>\d+) batches"
    rf".*?ms/batch\s+(?P<ms>[\d.]+).*?\|\s*loss\s+(?P<loss>{_NUM})"
)
_SLIME = re.compile(rf"step (?P<step>\d+): \{{'train/loss': (?P<loss>{_NUM})")
_DICT = re.compile(r"(\{'loss': .*\})")
# Lightning's progress bars. tqdm: "Epoch 0:  40%|####  | 4/10 [00:01<00:02, 3.1it/s, train_loss=2.31]";
# rich (non-interactive output prints the final state only): "Epoch 0/-2 ━━ 10/10 0:00:00 • ... train_loss: 42.2"
_LIGHTNING = re.compile(
    r"^Epoch (?P<epoch>\d+)(?:/-?\d+)?\b.*?\b(?P<batch>\d+)/(?P<of>\d+)\b"
    rf"(?:.*?\b\w*loss\w*[:=]\s*(?P<loss>{_NUM}))?"
)
# any line that names a step and a loss: "step 10/100 | train_loss 2.31", "Step 10: loss=2.31"
_GENERIC = re.compile(
    r"\b(?:global[_ ])?step[\s:=#]+(?P<step>\d+)\b(?:\s*/\s*\d+)?"
    rf".*?\b\w*loss\w*[\s:=]+(?P<loss>{_NUM})\b",
    re.IGNORECASE,
)
# an evaluation's loss is not a training step's (nanoGPT: "step 0: train loss 4.2, val loss 4.3")
_EVAL_LOSS = re.compile(r"\b(?:val|eval|valid|validation|test)\w*[ _/]loss", re.IGNORECASE)
# not a Megatron field: traindx's examples add it to their Megatron-format line
_TOKENS = re.compile(r"tokens per step:\s*(?P<tokens>\d+)")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _row(
    step: Any, loss: Any, step_time_s: float | None, fmt: str, tokens: float | None = None
) -> dict[str, Any]:
    return {
        "step": step,
        "loss": _float(loss) if loss is not None else None,
        "step_time_s": step_time_s,
        "format": fmt,
        "tokens": tokens,
    }


# Python's re has no timeout: a pattern that backtracks (`(a+)+$` on a long line of a's) would
# hang the recorder's roller and every later `report`. One search may take this long; a pattern
# that needs more is given up for the rest of the log (CustomRegexTimeout, said once by callers).
CUSTOM_TIMEOUT_S = 1.0


class CustomRegexTimeout(ValueError):
    """The user's --log-regex ran past CUSTOM_TIMEOUT_S on one line."""


def compile_custom(pattern: str) -> Any:
    """The user's --log-regex, compiled (a `regex` pattern: its searches are bounded); raises
    ValueError with a sentence when it cannot work."""
    try:
        compiled = bounded_re.compile(pattern)
    except (bounded_re.error, re.error) as exc:
        raise ValueError(f"--log-regex {pattern!r} is not a Python regex: {exc}") from None
    names = set(compiled.groupindex)
    if not names & {"step", "loss", "time_ms", "step_time_s"}:
        raise ValueError(
            f"--log-regex {pattern!r} names none of the groups step, loss, time_ms, "
            "step_time_s (write them as (?P<step>\\d+))"
        )
    return compiled


def _custom(regex: Any, text: str) -> dict[str, Any] | None:
    try:
        m = regex.search(text, timeout=CUSTOM_TIMEOUT_S)
    except TimeoutError:
        raise CustomRegexTimeout(
            f"--log-regex {regex.pattern[:80]!r} took over {CUSTOM_TIMEOUT_S:g} s on one line of the "
            "job's output (it backtracks): not run on the rest of the log"
        ) from None
    if not m:
        return None
    groups = m.groupdict()
    step = groups.get("step")
    seconds = _float(groups.get("step_time_s"))
    if seconds is None and groups.get("time_ms") is not None:
        seconds = _float(groups["time_ms"])
        seconds = seconds / 1000.0 if seconds is not None else None
    return _row(int(step) if step and step.isdigit() else None, groups.get("loss"), seconds, "custom")


def _hf_dict(text: str) -> dict[str, Any] | None:
    m = _DICT.search(text)
    if not m:
        return None
    try:
        record = ast.literal_eval(m[1])
    except (ValueError, SyntaxError):
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("iteration") or record.get("step") or record.get("global_step")
    if isinstance(step, str) and "/" in step:
        step = step.split("/")[0]
    try:
        step = int(step) if step is not None else None
    except (TypeError, ValueError):
        step = None
    return _row(step, record.get("loss"), None, "dict")


def _lightning(text: str) -> dict[str, Any] | None:
    """The last progress-bar state of a line (tqdm rewrites its bar with carriage returns)."""
    for part in reversed(text.split("\r")):
        m = _LIGHTNING.search(part.strip())
        if m:
            of = int(m["of"])
            # the bar counts batches of the epoch; max_steps within one epoch keeps them global
            return _row(int(m["epoch"]) * of + int(m["batch"]), m["loss"], None, "lightning")
    return None


def parse_line(text: str, custom: Any = None) -> dict[str, Any] | None:
    """{'step', 'loss', 'step_time_s', 'format', 'tokens'} for a line that reports a step, else
    None. `custom`: a compiled --log-regex (compile_custom), tried first; CustomRegexTimeout when
    it runs past its bound on this line."""
    if not text:
        return None
    text = strip_ansi(text)
    if custom is not None:
        parsed = _custom(custom, text)
        if parsed:
            return parsed
    m = _MEGATRON.search(text)
    if m:
        tokens = _TOKENS.search(text)
        return _row(
            int(m["step"]),
            m["loss"],
            float(m["ms"]) / 1000.0,
            "megatron",
            int(tokens["tokens"]) if tokens else None,
        )
    m = _NANOGPT.search(text)
    if m:
        return _row(int(m["step"]), m["loss"], float(m["ms"]) / 1000.0, "nanogpt")
    m = _EXAMPLES.search(text)
    if m:
        # batches count per epoch: a global step needs the epoch's length
        step = (int(m["epoch"]) - 1) * int(m["of"]) + int(m["batch"])
        return _row(step, m["loss"], float(m["ms"]) / 1000.0, "pytorch-examples")
    m = _DEEPSPEED.search(text)
    if m:
        return _row(int(m["step"]), m["loss"], _float(m["s"]), "deepspeed")
    m = _TORCHTITAN.search(text)
    if m:
        return _row(int(m["step"]), m["loss"], None, "torchtitan")
    m = _DEEPSPEED_RANK.search(text)
    if m:
        return _row(int(m["step"]), None, None, "deepspeed")
    m = _SLIME.search(text)
    if m:
        return _row(int(m["step"]), m["loss"], None, "slime")
    parsed = _hf_dict(text)
    if parsed:
        return parsed
    if text.lstrip("\r").startswith("Epoch ") or "\rEpoch " in text:
        parsed = _lightning(text)
        if parsed:
            return parsed
    m = _GENERIC.search(text)
    if m and not _EVAL_LOSS.search(text):
        tokens = _TOKENS.search(text)
        return _row(int(m["step"]), m["loss"], None, "generic", int(tokens["tokens"]) if tokens else None)
    return None
