"""Step times and losses from the job's own log lines (Megatron, torchtitan, HF Trainer, ms-swift,
slime), for steps the shim cannot see and for the loss curve."""
import ast
import re

_MEGATRON = re.compile(
    r"iteration\s+(?P<step>\d+)/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*(?P<ms>[\d.]+)"
    r"(?:.*?lm loss:\s*(?P<loss>[-+\d.eE]+|nan|inf))?")
_TORCHTITAN = re.compile(r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+\d.eE]+)")
_SLIME = re.compile(r"step (?P<step>\d+): \{'train/loss': (?P<loss>[-+\d.eE]+)")
_DICT = re.compile(r"(\{'loss': .*\})")
# not a Megatron field: traindx's examples add it to their Megatron-format line
_TOKENS = re.compile(r"tokens per step:\s*(?P<tokens>\d+)")


def parse_line(text):
    """{'step', 'loss', 'step_time_s'} for a line that reports a step, else None."""
    m = _MEGATRON.search(text)
    if m:
        tokens = _TOKENS.search(text)
        return {"step": int(m["step"]), "step_time_s": float(m["ms"]) / 1000.0,
                "loss": float(m["loss"]) if m["loss"] else None, "format": "megatron",
                "tokens": int(tokens["tokens"]) if tokens else None}
    m = _TORCHTITAN.search(text)
    if m:
        return {"step": int(m["step"]), "loss": float(m["loss"]), "step_time_s": None,
                "format": "torchtitan"}
    m = _SLIME.search(text)
    if m:
        return {"step": int(m["step"]), "loss": float(m["loss"]), "step_time_s": None,
                "format": "slime"}
    m = _DICT.search(text)
    if m:  # HF Trainer and ms-swift print a Python dict per log
        try:
            record = ast.literal_eval(m[1])
        except (ValueError, SyntaxError):
            return None
        step = record.get("iteration") or record.get("step")
        if isinstance(step, str) and "/" in step:
            step = step.split("/")[0]
        try:
            step = int(step) if step is not None else None
        except ValueError:
            step = None
        return {"step": step, "loss": float(record["loss"]), "step_time_s": None,
                "format": "dict"}
    return None
