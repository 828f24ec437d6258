"""stability's fixes: a periodic slow step's (the checkpoint written every k steps, the log, the
collections in it) and a checkpoint's, in the framework's terms (torchtitan, Megatron, the HF
Trainer's save_steps)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from traindx.analyzers.codefix import code_change, keyword_sources, set_keywords
from traindx.analyzers.codefix.flags import frequency_flags
from traindx.analyzers.core.evidence import is_library_path
from traindx.analyzers.core.findings import ArgChange, Prescription
from traindx.analyzers.core.frameworks import data_sites, knob_owner, runs_megatron, user_site
from traindx.profiler.code_paths import installed_package

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord


LESS_OFTEN = 10  # a periodic cost made this many times rarer (fixplan's flag arms too)


def _megatron_async_save(lost: float | None) -> Prescription:
    return Prescription(
        kind="arg",
        summary="Megatron: --async-save (with --ckpt-format torch_dist) writes checkpoints in the background",
        change={"arg": {"framework": "megatron", "set": {"--async-save": True}}},
        expected_gain_s_per_step=lost,
    )


def periodic_prescriptions(
    run: RunRecord, causes: dict[str, Any], lost: float | None, period: int | None
) -> Any:
    text = " ".join(c["text"] for c in causes.get("log_lines_in_slow_steps", [])).lower()
    out = []
    io = causes.get("io_in_slow_steps")
    saves = causes.get("save_sites") or []
    if io and (io[0].get("caller") or {}).get("file"):
        # the shim timed the write: its caller is the job's own line
        caller = io[0]["caller"]
        saves = [
            {
                "file": caller.get("file"),
                "line": caller.get("line"),
                "call": io[0]["call"],
                "function": caller.get("function") or io[0]["call"],
                "seconds": io[0]["seconds_per_step"],
                "frame": f"{io[0]['call']} ({caller.get('file')}:{caller.get('line')})",
            }
        ] + saves
    if saves:
        out.extend(checkpoint_prescriptions(run, saves, lost, period))
    elif "checkpoint" in text or "saving" in text or "save" in text:
        if runs_megatron(run.command):
            out.append(_megatron_async_save(lost))
        out.append(
            Prescription(
                kind="code",
                summary=f"the job writes a checkpoint every {period} steps on the critical path: save "
                "asynchronously (torch.distributed.checkpoint.async_save, or a background "
                "thread that writes a CPU copy), or less often",
                expected_gain_s_per_step=lost,
            )
        )
    if causes.get("gen2_gc_in_slow_steps"):
        out.append(
            Prescription(
                kind="code",
                summary="the slow steps hold full garbage collections: see gc.gen2_in_step "
                "(gc.freeze() after setup)",
                expected_gain_s_per_step=lost,
            )
        )
    out.append(
        Prescription(
            kind="code",
            summary=f"move the work done every {period} steps (evaluation, logging, checkpointing) off "
            "the training loop's critical path or do it less often",
            expected_gain_s_per_step=lost,
        )
    )
    return out


def checkpoint_prescriptions(
    run: RunRecord, saves: Sequence[dict[str, Any]], lost: float | None, period: int | None
) -> list[Prescription]:
    """A checkpoint every `period` steps, written at the job's own line: save asynchronously,
    in the framework's terms."""
    top = saves[0]
    where = f"{top['file']}:{top['line']}"
    framework = knob_owner(run)
    out = []
    if is_library_path(str(top.get("file") or "")):
        # the write is a framework's own code: the job's argument that drives it is the fix,
        # never a file under site-packages
        flag = _driving_flag(run, period, lost, top)
        where = _library_where(str(top["file"]), top.get("line"), flag)
        if flag is not None:
            out.append(flag)
    if framework == "torchtitan":
        out.append(
            Prescription(
                kind="arg",
                summary='torchtitan: checkpoint.async_mode = "async" (or '
                '"async_with_pinned_mem") writes the checkpoint in the background; '
                "or a larger checkpoint.interval",
                change={"arg": {"framework": "torchtitan", "set": {"--checkpoint.async_mode": "async"}}},
                expected_gain_s_per_step=lost,
            )
        )
    elif framework == "megatron":
        out.append(_megatron_async_save(lost))
    elif framework == "hf_trainer":
        edit = _trainer_save_edit(run, period)
        if edit:
            out.append(
                Prescription(
                    kind="code",
                    summary=(
                        f"save {LESS_OFTEN}x less often: TrainingArguments("
                        f"save_steps={edit['save_steps']}) at {edit['file']}:"
                        f"{edit['line']} (the Trainer saves synchronously)"
                    ),
                    change={"code": {k: v for k, v in edit.items() if k != "save_steps"}},
                    expected_gain_s_per_step=None if lost is None else lost * (1 - 1 / LESS_OFTEN),
                    automatic=True,
                )
            )
        out.append(
            Prescription(
                kind="code",
                summary='TrainingArguments(save_steps=...) larger, or save_strategy="no" '
                "with one save at the end: the Trainer saves synchronously",
                expected_gain_s_per_step=lost,
            )
        )
    how = (
        "save asynchronously (torch.distributed.checkpoint.async_save, or a background thread "
        "that writes a CPU copy), or less often"
    )
    when = f"every {period} steps" if period else "inside the steps"
    if top.get("call"):  # timed by the shim: the call, its line, what it cost each time
        summary = (
            f"{top['call']} at {where} runs {when} on the critical path "
            f"({top['seconds']:.2f} s each time): {how}"
        )
    else:
        summary = f"{top['function']} ({where}) writes a checkpoint {when} on the critical path: {how}"
    out.append(Prescription(kind="code", summary=summary, expected_gain_s_per_step=lost))
    return out


def _library_where(path: str, line: Any, flag: Prescription | None) -> str:
    """'timm (checkpoint_saver.py:103), driven by --recovery-interval 2': a framework's line named
    by its package, and the job's flag that drives it."""
    package = installed_package(path) or "a library"
    text = f"{package}'s code ({path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line})"
    if flag is not None and isinstance(flag.change, ArgChange):
        text += f", driven by the job's {next(iter(flag.change.flags), '')}"
    return text


def _driving_flag(
    run: RunRecord, period: int | None, lost: float | None, top: dict[str, Any]
) -> Prescription | None:
    """The job's own frequency flag on the command line whose value is the measured period: the
    argument that drives a framework's periodic write, raised tenfold."""
    if not period:
        return None
    for flag, value in frequency_flags(run.command):
        if value is not None and value.strip() == str(period):
            new = period * LESS_OFTEN
            return Prescription(
                kind="arg",
                summary=f"do it {LESS_OFTEN}x less often: {flag} {new} (was {value}: the job's own flag "
                f"drives {top.get('call') or 'the write'} inside {installed_package(str(top['file'])) or 'a library'}"
                f" every {period} steps)",
                change=ArgChange(framework="argparse", flags={flag: str(new)}),
                expected_gain_s_per_step=None if lost is None else lost * (1 - 1 / LESS_OFTEN),
                automatic=True,
            )
    return None


def _trainer_save_edit(run: RunRecord, period: int | None) -> dict[str, Any] | None:
    """The job's own `TrainingArguments(...)` call (the shim's data_site event: never a file
    under site-packages) with `save_steps` ten times the measured period (or its literal value),
    as a code change; None without such a call or a period to scale."""
    sites = [s for s in data_sites(run) if s.get("kind") == "TrainingArguments" and user_site(s)]
    if not sites:
        return None
    where = user_site(sites[-1]) or {}
    before = where.get("call_source") or (where.get("source") or "").strip()
    if not before:
        return None
    current = keyword_sources(before).get("save_steps")
    base = period
    if base is None and current is not None and current.strip().isdigit():
        base = int(current)
    if not base:
        return None
    after = set_keywords(before, {"save_steps": str(base * LESS_OFTEN)})
    first = where.get("call_first_line") or where.get("line")
    if not where.get("file") or not first or after is None:
        return None
    change = code_change(
        where["file"],
        int(first),
        before,
        after,
        last_line=where.get("call_last_line") if where.get("call_source") else None,
    )
    return dict(change, op="replace", save_steps=base * LESS_OFTEN) if change else None
