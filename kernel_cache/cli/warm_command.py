"""`kernel-cache warm`: what to compile (--spec, --model, --from-run), for which GPU, then the
compile in worker processes (kernel_cache.cli.warm) with a progress bar, and the summary table
(kernel_cache.cli.warm_summary). --from-run also warms the run's Triton/FLA kernels
(kernel_cache.cli.triton_warm)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from traindx.common.console import Console
from traindx.common.errors import UserError
from traindx.kernel_cache.cli import spec as specs
from traindx.kernel_cache.cli import triton_warm, warm
from traindx.kernel_cache.cli.output import PROG, console
from traindx.kernel_cache.cli.warm_summary import summarize
from traindx.kernel_cache.store import cache as store

Item = dict[str, Any]
Result = dict[str, Any]

UNCACHEABLE = (
    "cannot be cached: its key holds a tensor ({fields}; compiled {times}x in the run): a max_seqlen "
    "tensor leaking into FA4's key (FA4 <= 4.0.0b21) makes a new key every call. Pass max_seqlen "
    "as a Python int, or upgrade flash-attn-4 (>= 4.0.0b26)"
)


@dataclass(frozen=True)
class Target:
    """The GPU the cache is for and how the workers compile for it."""

    arch_vars: dict[str, str]  # environment of the workers that selects the arch
    fake: bool  # compile under FakeTensorMode (no GPU of that arch here)
    arch: int
    num_sms: int
    note: str


def plan(args: argparse.Namespace) -> tuple[list[Item], list[str], dict[str, Any] | None]:
    """Work items plus a description of where they came from (and what the run recorded)."""
    items: list[Item] = []
    sources: list[str] = []
    run_info = None
    specs.parse_seqlens(args.seqlens)  # a bad --seqlens fails before anything else
    if args.spec:
        parsed = [specs.parse_spec(s) for s in args.spec]
        items += specs.shape_items(parsed, args.seqlens)
        sources.append(f"{len(parsed)} --spec")
    if args.model:
        model_specs, notes = specs.model_specs(
            args.model,
            varlen=args.varlen,
            causal=not args.no_causal,
            dtype=args.dtype,
            deterministic=args.deterministic,
            batch=args.batch,
            tp=args.tp,
            fwd_only=args.fwd_only,
        )
        items += [
            i
            for i in specs.shape_items(model_specs, args.seqlens)
            if i["label"] not in {x["label"] for x in items}
        ]
        sources.append(f"{args.model}: " + "; ".join(notes))
    if args.from_run:
        replay, run_info = specs.run_items(args.from_run)
        items += replay
        sources.append(f"{len(replay)} distinct FA4 compiles recorded in {run_info['run']}")
    if not items:
        raise UserError("nothing to compile: give --spec, --model or --from-run")
    return items, sources, run_info


def _arch(args: argparse.Namespace, run_info: dict[str, Any] | None) -> int | None:
    """The arch asked for, else the run's; None when neither says."""
    if args.arch:
        return specs.arch_number(args.arch)
    run_env = (run_info or {}).get("env") or {}
    if run_info and run_info["archs"]:
        if len(run_info["archs"]) > 1:
            raise UserError(f"the run compiled for several archs {run_info['archs']}: pick one with --arch")
        arch: int = run_info["archs"][0]
        return arch
    if run_env.get("FLASH_ATTENTION_ARCH"):
        return specs.arch_number(run_env["FLASH_ATTENTION_ARCH"])
    return None


def target(args: argparse.Namespace, run_info: dict[str, Any] | None) -> Target:
    arch = _arch(args, run_info)
    run_env = (run_info or {}).get("env") or {}
    gpu = None if args.device == "cpu" else warm.gpu_arch()
    if arch is None:
        if gpu is None:
            raise UserError(
                "no GPU here: say which GPU the cache is for with --arch "
                "(sm_90: H100/H200, sm_100: B200, sm_103: B300)"
            )
        arch = gpu[0]
    real = gpu is not None and gpu[0] == arch
    if args.device == "cuda" and not real:
        raise UserError(
            "--device cuda: "
            + ("no GPU visible" if gpu is None else f"the GPU here is sm_{gpu[0]}, not sm_{arch}")
        )
    run_sms = run_env.get("FLASH_ATTENTION_NUM_SMS")
    num_sms = (
        args.num_sms
        or (int(str(run_sms)) if str(run_sms or "").isdigit() else None)
        or (run_info or {}).get("num_sms")
        or (gpu[1] if real and gpu else None)
        or specs.NUM_SMS_BY_ARCH.get(arch, 132)
    )
    if real:
        arch_vars = {"FLASH_ATTENTION_NUM_SMS": str(num_sms)} if args.num_sms else {}
        note = f"on this GPU (sm_{arch}, {num_sms} SMs), real tensors"
    else:
        arch_vars = specs.arch_env(arch, num_sms)
        note = f"for sm_{arch} with {num_sms} SMs, under FakeTensorMode (no kernel runs)"
    return Target(arch_vars=arch_vars, fake=not real, arch=arch, num_sms=num_sms, note=note)


def _warm_triton(args: argparse.Namespace) -> tuple[int | None, bool]:
    """--from-run: warm the Triton/FLA kernels the run compiled and tuned (kernel_cache.triton_warm).
    Returns (exit code or None when the run has no Triton kernels, whether FA4 work remains)."""
    if not args.from_run:
        return None, True
    from traindx.derive.run import load_run  # lazy: pandas, only for --from-run

    code = triton_warm.warm_from_run(args)
    if code is None:
        return None, True
    fa4_left = bool(args.spec or args.model) or triton_warm.has_fa4_compiles(load_run(args.from_run))
    return code, fa4_left


def run_warm_all(args: argparse.Namespace) -> int | None:
    """FA4 kernels (run_warm) and, for --from-run, the Triton/FLA kernels the run compiled."""
    triton_code, fa4_left = _warm_triton(args)
    if not fa4_left:
        return triton_code
    return run_warm(args) or (triton_code or 0)


def run_warm(args: argparse.Namespace) -> int:
    items, sources, run_info = plan(args)
    the_target = target(args, run_info)
    env = store.require_fa4()
    fingerprint = env.fingerprint or ""
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    extra_env = dict((run_info or {}).get("env") or {})
    err = console(stderr=True)
    if run_info:
        _forget_other_versions_keys(items, run_info, env, err)
    for item in items:
        if item["kind"] == "replay" and args.int_max_seqlen:
            item["int_max_seqlen"] = True
            item["tensor_fields"] = []
    if os.environ.get("FA_LOG_LEVEL") and "FA_LOG_LEVEL" not in extra_env:
        err.print("note: FA_LOG_LEVEL is part of FA4's compile key: warm with the value the job uses")
    jobs = args.jobs or warm.default_jobs(len(items))
    for line in sources:
        err.print(f"[bold]kernel-cache[/] warm: {line}")
    err.print(
        f"  {len(items)} work items {the_target.note}; {min(jobs, len(items))} processes; "
        f"cache {cache_dir}/{fingerprint[:12]}…"
    )
    if args.dry_run:
        _print_dry_run(items)
        return 0
    _check_writable(cache_dir, fingerprint)
    started = time.perf_counter()
    compile_ = _Compile(cache_dir, the_target, jobs, extra_env)
    results, logs = compile_.run(items, err)
    order = {item["label"]: i for i, item in enumerate(items)}
    results.sort(key=lambda r: order.get(r["label"], 0))
    if any(k["status"] == "written" for r in results for k in r["kernels"]):
        store.write_metadata(
            cache_dir / fingerprint,
            arch=f"sm_{the_target.arch}",
            num_sms=the_target.num_sms,
            source="; ".join(sources),
        )
    try:
        code = summarize(results, cache_dir, env, time.perf_counter() - started)
    except UserError:  # FA4 rejected every item: the one-line reason is all there is to say
        for log in logs:
            shutil.rmtree(os.path.dirname(log), ignore_errors=True)
        raise
    if logs:
        print(f"{PROG}: compiler output and tracebacks: {', '.join(logs)}", file=sys.stderr)
    return code


def _forget_other_versions_keys(
    items: list[Item], run_info: dict[str, Any], env: store.Environment, err: Console
) -> None:
    ran = run_info.get("versions") or {}
    other = [
        f"{name} {ran[name]} (here {here})"
        for name, here in (("flash-attn-4", env.fa4), ("nvidia-cutlass-dsl", env.cutlass))
        if ran.get(name) and here and ran[name] != here
    ]
    if not other:
        return
    # e.g. the run showed FA4 <= b21 recompiling; the fix upgrades FA4, then precompiles
    # the same calls: compile them with this FA4; its keys are not the run's to compare
    err.print(
        f"note: the run used {', '.join(other)}: compiling the run's calls with "
        "this environment's FA4 (its cache serves jobs that use this one); the "
        "keys cannot be compared with the run's"
    )
    for item in items:
        if item["kind"] == "replay":
            item["expect_key"], item["tensor_fields"] = None, []
            item["other_version"] = True


def _print_dry_run(items: list[Item]) -> None:
    for item in items:
        print(
            item["label"]
            if item["kind"] == "shape"
            else f"{item['label']}: replay {item['function']}"
            + (f" (compiled {item['times_compiled']}x)" if item.get("times_compiled", 1) > 1 else "")
        )


def _check_writable(cache_dir: Path, fingerprint: str) -> None:
    """Fail here, in one line, rather than in every compiler process."""
    folder = cache_dir / fingerprint
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write to the cache dir {cache_dir}: {exc.strerror}") from None


def _uncacheable(item: Item) -> Result:
    return {
        "label": item["label"],
        "ok": False,
        "rejected": False,
        "kernels": [],
        "item": item,
        "key_match": None,
        "key_diff": [],
        "seconds": 0.0,
        "error": UNCACHEABLE.format(fields=", ".join(item["tensor_fields"]), times=item["times_compiled"]),
    }


def _covered(item: Item) -> Result:
    return {
        "label": item["label"],
        "ok": True,
        "rejected": False,
        "error": None,
        "kernels": [],
        "covered": True,
        "key_match": True,
        "key_diff": [],
        "seconds": 0.0,
        "item": item,
    }


@dataclass
class _Compile:
    """The compile of the work items in worker processes, in two rounds: the shapes and the
    replays compiled first (REPLAY_FIRST), then the rest, less what the first round compiled."""

    cache_dir: Path
    target: Target
    jobs: int
    extra_env: dict[str, str]

    def run(self, items: list[Item], err: Console) -> tuple[list[Result], list[str]]:
        uncacheable = [i for i in items if i.get("tensor_fields")]
        items_to_run = [i for i in items if not i.get("tensor_fields")]
        first = [i for i in items_to_run if i["kind"] == "shape" or i["function"] in specs.REPLAY_FIRST]
        later = [i for i in items_to_run if i not in first]
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        results: list[Result] = []
        logs: list[str] = []
        with Progress(*columns, console=err, transient=False) as progress:
            task = progress.add_task("compiling", total=len(items))

            def on_result(result: Result) -> None:
                mark = "[green]ok[/]" if result["ok"] else "[red]failed[/]"
                progress.console.print(
                    f"  {mark} {result['label']} ({result.get('seconds', 0):.1f} s)", markup=True
                )
                progress.advance(task)

            for item in uncacheable:
                results.append(_uncacheable(item))
                progress.advance(task)
            for batch in (first, later):
                if batch is later and later:
                    covered = _already_compiled(later, results)
                    for item in covered:
                        results.append(_covered(item))
                        progress.advance(task)
                    batch = [i for i in later if i not in covered]
                if batch:
                    self._run_batch(batch, on_result, results, logs)
        return results, logs

    def _run_batch(
        self, batch: list[Item], on_result: Callable[[Result], None], results: list[Result], logs: list[str]
    ) -> None:
        part = warm.run_warm(
            batch,
            self.cache_dir,
            self.target.arch_vars,
            jobs=self.jobs,
            fake=self.target.fake,
            extra_env=self.extra_env,
            progress=on_result,
        )
        results += part.results
        if part.log_dir:
            logs.append(os.path.join(part.log_dir, "workers.log"))


def _already_compiled(later: list[Item], results: list[Result]) -> list[Item]:
    """The pre/post kernels of a backward are usually compiled by its replay already."""
    produced = {k["key"] for r in results for k in r["kernels"] if k["status"] != "not compiled"}
    bwd_ok = any(r["ok"] for r in results if (r.get("item") or {}).get("function") == "_flash_attn_bwd")
    return [i for i in later if i.get("expect_key") in produced or (i.get("other_version") and bwd_ok)]
