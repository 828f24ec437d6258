"""A training command's flags, read and rewritten for `--fix` (judge layer, fix planning): which
argument the program's own flags start at, a flag's value, and a command with flags set or
removed. A launcher's own flags (`torchrun --nproc-per-node`) are never rewritten."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from traindx.analyzers.core.findings import FlagValue

# Frameworks whose flags `--fix` may rewrite; all parse `--flag value` / `--flag=value`.
# ms-swift and the HF Trainer (HfArgumentParser) accept `_` and `-` alike in flag names;
# torchtitan's `--section.key`, slime's and Megatron's dashes are matched the same way.
KNOWN_FRAMEWORKS = (
    "megatron",
    "ms-swift",
    "slime",
    "torchtitan",
    "hf",
    "hf-trainer",
    "transformers",
    "example",
    "argparse",
)
# "argparse": the job's own parser, found by reading the script (traindx.fixing.plan.source.argparse_flags)
PYTHON_LAUNCHERS = ("torchrun", "accelerate", "deepspeed")
# a flag that sets how often something periodic runs (a save, an eval, a log)
FREQUENCY_FLAG = re.compile(r"interval|every|freq|period|save|ckpt|checkpoint", re.I)


def flag_name(token: str) -> str | None:
    """'--max_seqlen=3' -> 'max-seqlen' (normalized), None for a token that is no long flag."""
    if not token.startswith("--") or len(token) < 3:
        return None
    return token[2:].split("=", 1)[0].replace("_", "-")


def program_args_start(command: Sequence[str]) -> int:
    """Index of the first argument that belongs to the training program itself (after
    `python [-m module | script.py]`, `torchrun ... script.py`, `bash script.sh`); a launcher's
    own flags are never rewritten."""
    for i, token in enumerate(command):
        if token.endswith((".py", ".sh")) and not token.startswith("-"):
            return i + 1
        if token == "-m" and i + 1 < len(command):
            return i + 2
    return 1


def _set_one(args: list[str], flag: str, value: FlagValue) -> list[str]:
    """`args` with every occurrence of `flag` given `value` (see set_flags), else it appended."""
    name = flag_name(flag)
    out: list[str] = []
    found, i = False, 0
    while i < len(args):
        token = args[i]
        if flag_name(token) != name:
            out.append(token)
            i += 1
            continue
        found = True
        inline = "=" in token
        has_value = inline or (i + 1 < len(args) and not args[i + 1].startswith("--"))
        spelled = token.split("=", 1)[0]  # keep the command's own spelling
        i += 1 if inline or not has_value else 2
        if value is None or value is False:
            continue
        if value is True:
            out.extend([spelled, "True"] if has_value else [spelled])
        else:
            out.append(f"{spelled}={value}" if inline else spelled)
            if not inline:
                out.append(str(value))
    if not found and value is not None and value is not False:
        out.extend([flag] if value is True else [flag, str(value)])
    return out


def set_flags(command: Sequence[str], flags: Mapping[str, FlagValue]) -> list[str]:
    """A new command with each `--flag` set to its value: every occurrence replaced (argparse
    keeps the last), else appended. Value True: a bare switch (or `True` where the command gives
    the switch a value); False/None: the flag (and its value) removed."""
    command = list(command)
    start = program_args_start(command)
    head, args = command[:start], command[start:]
    for flag, value in flags.items():
        args = _set_one(args, flag if flag.startswith("-") else "--" + flag, value)
    return head + args


def flag_value(command: Sequence[str], flag: str) -> str | None:
    """The value the command gives `flag` (the last occurrence), else None."""
    args = command[program_args_start(command) :]
    name, value = flag_name(flag), None
    for i, token in enumerate(args):
        if flag_name(token) == name:
            if "=" in token:
                value = token.split("=", 1)[1]
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
    return value


def frequency_flags(command: Sequence[str]) -> list[tuple[str, str | None]]:
    """(flag as spelled, its value) of every flag of the program whose name says how often."""
    args = command[program_args_start(command) :]
    out = []
    for i, token in enumerate(args):
        name = flag_name(token)
        if name and FREQUENCY_FLAG.search(name):
            value = token.split("=", 1)[1] if "=" in token else (args[i + 1] if i + 1 < len(args) else None)
            out.append((token.split("=", 1)[0], value))
    return out


def is_shell_script(command: Sequence[str]) -> bool:
    return any(t.endswith(".sh") for t in command[:3]) or os.path.basename(command[0]) in (
        "bash",
        "sh",
        "zsh",
    )
