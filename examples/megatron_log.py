"""The one log format of every example: Megatron-LM's per-iteration line (FACTS.md §5), which
traindx parses for step times, losses and tokens per step."""
from datetime import datetime


def log_line(step, steps, elapsed_ms, lr, batch, loss, tokens=None):
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    tokens_field = f"tokens per step: {tokens} | " if tokens is not None else ""
    print(f" [{stamp}] iteration {step:8d}/{steps:8d} | consumed samples: {step * batch:12d} | "
          f"elapsed time per iteration (ms): {elapsed_ms:.1f} | learning rate: {lr:.6E} | "
          f"global batch size: {batch:5d} | {tokens_field}lm loss: {loss:.6E} |", flush=True)
