"""Scratch copies of bench/corpus.py's scripts with one cause inserted: a line after a pattern, an
argument of the framework's constructor, a setting of the environment, or an edit of
bench/corpus_model.py / bench/corpus_more.py."""

import json
import os
import re
import shutil
import tempfile

from corpus_model import MODEL_CAUSES, apply_edits
from corpus_more import MORE_CAUSES, has_edits
from corpus_scripts import FLAG_CAUSES, SWITCH_ARGUMENTS, SWITCH_CAUSES

# defines the helpers the inserted lines call; one line, so the script's lines move by one only
PRELUDE = "import time as _tdx_time, gc as _tdx_gc; _tdx_n = [0]; _tdx_kept = []; _tdx_total = 0.0\n"
# every 2nd step: a sample-image grid of the model's weights written as a PNG (torch ops and
# Pillow's encoder), repeated for about `s` seconds so its size follows the healthy step
GRID = (
    "import torch as _tdx_torch, PIL.Image as _tdx_img\n"
    "_tdx_t0 = _tdx_time.perf_counter()\n"
    "while _tdx_time.perf_counter() - _tdx_t0 < {s:.4f}:\n"
    "    with _tdx_torch.no_grad():\n"
    "        _tdx_w = _tdx_torch.cat([p.detach().flatten()[:32768] for p in {model}.parameters()])\n"
    "        _tdx_w = ((_tdx_w - _tdx_w.min()) / (_tdx_w.max() - _tdx_w.min() + 1e-8) * 255).to(_tdx_torch.uint8)\n"
    "        _tdx_w = _tdx_torch.nn.functional.pad(_tdx_w, (0, (-len(_tdx_w)) % 256)).reshape(-1, 256)\n"
    "        _tdx_img.fromarray(_tdx_w.repeat_interleave(2, 0).repeat_interleave(2, 1).numpy()).save('samples.png')"
)
BUSY = "_tdx_t0 = _tdx_time.perf_counter()\nwhile _tdx_time.perf_counter() - _tdx_t0 < {s:.4f}: pass"


def _nest(text, by="    "):
    return "\n".join(by + line for line in text.split("\n"))


def _insert_after(path, pattern, lines_of_indent, first_only=True):
    """Insert lines after the first line matching `pattern`; `lines_of_indent(indent)` gives
    the text (indent: the matched line's leading whitespace; for a `def` line one level more).
    Returns "first-last": the 1-based line numbers of the inserted lines."""
    with open(path) as f:
        src = f.read().splitlines(keepends=True)
    rx = re.compile(pattern)
    for i, line in enumerate(src):
        if rx.search(line):
            indent = line[: len(line) - len(line.lstrip())]
            if line.lstrip().startswith("def "):
                indent += "    "
            text = lines_of_indent(indent)
            block = "".join(indent + t + "\n" for t in text.split("\n"))
            src.insert(i + 1, block)
            with open(path, "w") as f:
                f.write("".join(src))
            return f"{i + 2}-{i + 1 + len(text.split(chr(10)))}"
    raise SystemExit(f"pattern {pattern!r} not found in {path}")


def _add_argument(path, call, argument):
    """Pass `argument` first to the first call matching `call` (a regex ending at its "("); returns
    the line's number as "n-n"."""
    with open(path) as f:
        src = f.read().splitlines(keepends=True)
    rx = re.compile(call)
    for i, line in enumerate(src):
        m = rx.search(line)
        if m:
            src[i] = line[: m.end()] + argument + ", " + line[m.end() :]
            with open(path, "w") as f:
                f.write("".join(src))
            return f"{i + 1}-{i + 1}"
    raise SystemExit(f"pattern {call!r} not found in {path}")


def _prelude(path):
    with open(path) as f:
        src = f.read()
    with open(path, "w") as f:
        f.write(PRELUDE + src)


def _per_step(script, busy_s):
    """Code inserted after the loop's per-step anchor, for each cause that goes there."""
    return {
        # a read from slow storage: 150 ms blocked per step
        "read150": lambda i: "_tdx_blob = open(__file__, 'rb').read(); _tdx_time.sleep(0.15)",
        # CPU work on every other step (pure Python, +50 % of the healthy step)
        "odd_host": lambda i: "_tdx_n[0] += 1\nif _tdx_n[0] % 2:\n" + _nest(BUSY.format(s=busy_s)),
        "save": lambda i: (
            "_tdx_n[0] += 1\nif _tdx_n[0] % 4 == 0:\n"
            + _nest(f"import torch as _tdx_torch; _tdx_torch.save({script.model}.state_dict(), 'ckpt.pt')")
        ),
        "gc_collect": lambda i: "_tdx_gc.collect()",
        "item": lambda i: f"_tdx_loss_value = {script.loss}.item()",
        # the loss kept with its autograd graph (its graph nodes stay alive, step after step)
        "keep_loss": lambda i: f"_tdx_kept.append({script.loss})",
        # the losses summed as tensors (one tensor whose graph grows by a step's every step)
        "running_sum": lambda i: f"global _tdx_total\n_tdx_total += {script.loss}",
        # a sample-image grid written every 2nd step (+68 % on those steps, +34 % on average)
        "grid2": lambda i: (
            "_tdx_n[0] += 1\nif _tdx_n[0] % 2 == 0:\n"
            + _nest(GRID.format(s=busy_s * 1.36, model=script.model))
        ),
    }


def _copy(corpus, script, work, cause, at):
    if at:
        os.makedirs(at, exist_ok=True)
        d = at
    else:
        d = tempfile.mkdtemp(prefix=f"{script.name}-{cause}-", dir=work)
    for item in script.files:
        src = os.path.join(corpus, item)
        dst = os.path.join(d, os.path.basename(item))
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy(src, dst)
    if script.prepare:
        script.prepare(d)
    return d


def _switch(d, script, cause):
    path = os.path.join(d, script.setup_file)
    if script.framework_call and cause in SWITCH_ARGUMENTS:
        return (script.setup_file, _add_argument(path, script.framework_call, SWITCH_ARGUMENTS[cause]))
    text = SWITCH_CAUSES[cause]
    return (script.setup_file, _insert_after(path, script.setup_anchor, lambda i: text))


def _slow_getitem(d, script, busy_s):
    path = os.path.join(d, script.getitem_file)
    _prelude(path)
    per_item = busy_s / 16  # a batch of 16-20 items: about the healthy step again
    if script.getitem_patch_class:
        obj = script.getitem_patch_class
        text = (
            f"_tdx_get = type({obj}).__getitem__\n"
            "def _tdx_slow_getitem(self, i):\n"
            + _nest(BUSY.format(s=per_item) + "\nreturn _tdx_get(self, i)")
            + "\n"
            f"type({obj}).__getitem__ = _tdx_slow_getitem"
        )
    else:
        text = BUSY.format(s=per_item)
    return (script.getitem_file, _insert_after(path, script.getitem_anchor, lambda i: text))


def prepare(corpus, script, cause, work, busy_s, at=None):
    """Scratch copy of the script with the cause inserted: (dir, env, injected "file:line").
    `at`: the folder to write it in (re-creating a run's sources for --rejudge)."""
    if script.only_causes and cause not in script.only_causes:
        return None  # a cause this script is not run with
    d = _copy(corpus, script, work, cause, at)
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.update(script.env)
    where = None
    if cause in MODEL_CAUSES or (cause in MORE_CAUSES and has_edits(script.name, cause)):
        where = apply_edits(d, script.name, cause)
        if cause in script.flag_causes:  # the edit's own flags (how often the edited code runs)
            env["TRAINDX_CORPUS_ARGS"] = json.dumps(script.flag_causes[cause])
        return None if where is None else (d, env, where)
    if cause in FLAG_CAUSES and cause not in script.flag_causes:
        return None  # another script's own flag
    per_step = _per_step(script, busy_s)
    if cause in script.flag_causes:
        env["TRAINDX_CORPUS_ARGS"] = json.dumps(script.flag_causes[cause])
    elif cause in per_step:
        loop = os.path.join(d, script.loop_file)
        _prelude(loop)
        where = (script.loop_file, _insert_after(loop, script.loop_anchor, per_step[cause]))
    elif cause in SWITCH_CAUSES:
        if not script.setup_file:
            return None
        where = _switch(d, script, cause)
    elif cause == "threads16":
        env.update(OMP_NUM_THREADS="16", MKL_NUM_THREADS="16")
    elif cause == "slow_getitem":
        if not script.getitem_file:
            return None
        where = _slow_getitem(d, script, busy_s)
    return d, env, (f"{where[0]}:{where[1]}" if where else None)
