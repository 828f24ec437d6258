"""kernel-cache: precompile FlashAttention-4 kernels into FA4's own persistent cache, and manage it.

  kernel-cache warm --spec hd=128,hq=16,hkv=4,causal,varlen --arch sm_90   compile before training
  kernel-cache warm --model path/config.json --varlen --arch sm_100
  kernel-cache warm --from-run runs/<id>                 replay the FA4 compiles a run recorded
  kernel-cache env                                       the two exports a job needs
  kernel-cache ls | verify | pack FILE | unpack FILE | clear

On a machine without a GPU, compiles run under torch's FakeTensorMode for the --arch given; on a
GPU, for that GPU. A job uses the cache with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 (and the
same FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, if one was given here).
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from traindx.common import argtypes
from traindx.common.errors import UserError
from traindx.kernel_cache.cli import spec as specs
from traindx.kernel_cache.store import cache as store

PROG = "kernel-cache"
COLLAPSE_ABOVE = 12  # work items; above this the table folds the ones that compiled nothing


def _arch_argument(text):
    """--arch: an arch FA4 builds for (kernel_cache.spec.arch_number decides); one line else."""
    import argparse

    from traindx.common.errors import UserError
    from traindx.kernel_cache.cli.spec import arch_number

    try:
        arch_number(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _console(stderr=False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # piped output (logs, CI) gets a wide fixed width instead of rich's 80-column fallback
    return Console(stderr=stderr, highlight=False, width=None if stream.isatty() else 200)


# -- warm ------------------------------------------------------------------------------------------
def prepare_warm(p):
    src = p.add_argument_group("what to compile (any combination)")
    src.add_argument("--from-run", metavar="RUN", help="replay the FA4 compiles a `diagnose` run recorded")
    src.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="FIELDS",
        help="attention shape, e.g. hd=128,hq=16,hkv=4,dtype=bf16,causal,varlen (repeatable; see below)",
    )
    src.add_argument(
        "--model",
        type=argtypes.existing_file,
        metavar="CONFIG",
        help="an HF config.json (Llama, Qwen3, Qwen3-MoE, Qwen3.5 hybrid, ...)",
    )
    src.add_argument(
        "--int-max-seqlen",
        action="store_true",
        help="--from-run: replay a max_seqlen the run passed as a tensor as a Python int "
        "(tokens / sequences), i.e. compile for the job once it is fixed",
    )
    shp = p.add_argument_group("shape options")
    shp.add_argument(
        "--seqlens",
        metavar="N,LO-HI",
        help="sequence lengths and ranges (default 4096; varlen: 8-4096; see below)",
    )
    shp.add_argument("--varlen", action="store_true", help="--model: packed sequences (varlen)")
    shp.add_argument("--no-causal", action="store_true", help="--model: bidirectional attention")
    shp.add_argument(
        "--dtype", choices=["bf16", "fp16"], help="--model: attention dtype (default: the config's)"
    )
    shp.add_argument("--deterministic", action="store_true", help="--model: deterministic backward")
    shp.add_argument(
        "--batch", type=argtypes.positive_int, metavar="N", help="--model: sequences per (packed) batch"
    )
    shp.add_argument(
        "--tp",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="--model: tensor-parallel size (splits heads)",
    )
    shp.add_argument("--fwd-only", action="store_true", help="--model: forward kernels only (inference)")
    tgt = p.add_argument_group("target")
    tgt.add_argument(
        "--arch",
        type=_arch_argument,
        help="GPU arch the cache is for: sm_90 (H100/H200), sm_100 (B200), sm_103 (B300), ... "
        "(default: the run's, else this machine's GPU)",
    )
    tgt.add_argument(
        "--num-sms",
        type=argtypes.positive_int,
        metavar="N",
        help="SM count of the target GPU (default: by arch/GPU)",
    )
    tgt.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="cpu: compile under FakeTensorMode; cuda: with real tensors on this GPU "
        "(auto: cuda when a GPU of the target arch is visible)",
    )
    tgt.add_argument(
        "--jobs",
        "-j",
        type=argtypes.positive_int,
        metavar="N",
        help="compiler processes (default: CPUs, at most 8)",
    )
    tgt.add_argument(
        "--dry-run", action="store_true", help="list the work items and the target; compile nothing"
    )
    _triton_arguments(p)
    p.epilog = specs.SPEC_HELP + "\n\n" + specs.__doc__.split("\n\n", 2)[2]


def _plan(args):
    """Work items plus a description of where they came from."""
    items, sources, run_info = [], [], None
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


def _target(args, run_info):
    """(arch vars for the workers, fake mode?, arch number, num_sms, a note)."""
    arch = specs.arch_number(args.arch) if args.arch else None
    run_env = (run_info or {}).get("env") or {}
    if arch is None and run_info and run_info["archs"]:
        if len(run_info["archs"]) > 1:
            raise UserError(f"the run compiled for several archs {run_info['archs']}: pick one with --arch")
        arch = run_info["archs"][0]
    if arch is None and run_env.get("FLASH_ATTENTION_ARCH"):
        arch = specs.arch_number(run_env["FLASH_ATTENTION_ARCH"])
    gpu = None if args.device == "cpu" else _gpu()
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
        or (int(run_sms) if str(run_sms or "").isdigit() else None)
        or (run_info or {}).get("num_sms")
        or (gpu[1] if real else None)
        or specs.NUM_SMS_BY_ARCH.get(arch, 132)
    )
    if real:
        arch_vars = {"FLASH_ATTENTION_NUM_SMS": str(num_sms)} if args.num_sms else {}
        note = f"on this GPU (sm_{arch}, {num_sms} SMs), real tensors"
    else:
        arch_vars = specs.arch_env(arch, num_sms)
        note = f"for sm_{arch} with {num_sms} SMs, under FakeTensorMode (no kernel runs)"
    return arch_vars, not real, arch, num_sms, note


def _gpu():
    from traindx.kernel_cache.cli.warm import gpu_arch

    return gpu_arch()


def _triton_arguments(p):
    from traindx.kernel_cache.cli import triton_warm

    triton_warm.add_arguments(p)


def _warm_triton(args):
    """--from-run: warm the Triton/FLA kernels the run compiled and tuned (kernel_cache.triton_warm).
    Returns (exit code or None when the run has no Triton kernels, whether FA4 work remains)."""
    if not args.from_run:
        return None, True
    from traindx.derive.run import load_run
    from traindx.kernel_cache.cli import triton_warm

    code = triton_warm.warm_from_run(args)
    if code is None:
        return None, True
    fa4_left = bool(args.spec or args.model) or triton_warm.has_fa4_compiles(load_run(args.from_run))
    return code, fa4_left


def run_warm(args):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from traindx.kernel_cache.cli import warm

    items, sources, run_info = _plan(args)
    arch_vars, fake, arch, num_sms, note = _target(args, run_info)
    env = store.require_fa4()
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    extra_env = dict((run_info or {}).get("env") or {})
    err = _console(stderr=True)
    if run_info:
        ran = run_info.get("versions") or {}
        other = [
            f"{name} {ran[name]} (here {here})"
            for name, here in (("flash-attn-4", env.fa4), ("nvidia-cutlass-dsl", env.cutlass))
            if ran.get(name) and here and ran[name] != here
        ]
        if other:
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
        f"  {len(items)} work items {note}; {min(jobs, len(items))} processes; "
        f"cache {cache_dir}/{env.fingerprint[:12]}…"
    )

    if args.dry_run:
        for item in items:
            print(
                item["label"]
                if item["kind"] == "shape"
                else f"{item['label']}: replay {item['function']}"
                + (f" (compiled {item['times_compiled']}x)" if item.get("times_compiled", 1) > 1 else "")
            )
        return 0
    try:  # fail here, in one line, rather than in every compiler process
        (cache_dir / env.fingerprint).mkdir(parents=True, exist_ok=True)
        probe = cache_dir / env.fingerprint / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write to the cache dir {cache_dir}: {exc.strerror}") from None
    uncacheable = [i for i in items if i.get("tensor_fields")]
    items_to_run = [i for i in items if not i.get("tensor_fields")]
    started = time.perf_counter()
    first = [i for i in items_to_run if i["kind"] == "shape" or i["function"] in specs.REPLAY_FIRST]
    later = [i for i in items_to_run if i not in first]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    results, logs = [], []
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task("compiling", total=len(items))

        def on_result(result):
            mark = "[green]ok[/]" if result["ok"] else "[red]failed[/]"
            progress.console.print(
                f"  {mark} {result['label']} ({result.get('seconds', 0):.1f} s)", markup=True
            )
            progress.advance(task)

        for item in uncacheable:
            results.append(
                {
                    "label": item["label"],
                    "ok": False,
                    "rejected": False,
                    "kernels": [],
                    "item": item,
                    "key_match": None,
                    "key_diff": [],
                    "seconds": 0.0,
                    "error": f"cannot be cached: its key holds a tensor ({', '.join(item['tensor_fields'])}; "
                    f"compiled {item['times_compiled']}x in the run): a max_seqlen tensor leaking "
                    "into FA4's key (FA4 <= 4.0.0b21) makes a new key every call. Pass max_seqlen "
                    "as a Python int, or upgrade flash-attn-4 (>= 4.0.0b26)",
                }
            )
            progress.advance(task)
        for batch in (first, later):
            if batch is later and later:
                # the pre/post kernels of a backward are usually compiled by its replay already
                produced = {k["key"] for r in results for k in r["kernels"] if k["status"] != "not compiled"}
                bwd_ok = any(
                    r["ok"] for r in results if (r.get("item") or {}).get("function") == "_flash_attn_bwd"
                )
                covered = [
                    i for i in later if i.get("expect_key") in produced or (i.get("other_version") and bwd_ok)
                ]
                for item in covered:
                    results.append(
                        {
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
                    )
                    progress.advance(task)
                batch = [i for i in later if i not in covered]
            if not batch:
                continue
            part = warm.run_warm(
                batch, cache_dir, arch_vars, jobs=jobs, fake=fake, extra_env=extra_env, progress=on_result
            )
            results += part.results
            if part.log_dir:
                logs.append(os.path.join(part.log_dir, "workers.log"))
    order = {item["label"]: i for i, item in enumerate(items)}
    results.sort(key=lambda r: order.get(r["label"], 0))
    if any(k["status"] == "written" for r in results for k in r["kernels"]):
        store.write_metadata(
            cache_dir / env.fingerprint, arch=f"sm_{arch}", num_sms=num_sms, source="; ".join(sources)
        )
    try:
        code = _summarize(results, items, cache_dir, env, time.perf_counter() - started)
    except UserError:  # FA4 rejected every item: the one-line reason is all there is to say
        for log in logs:
            shutil.rmtree(os.path.dirname(log), ignore_errors=True)
        raise
    if logs:
        print(f"{PROG}: compiler output and tracebacks: {', '.join(logs)}", file=sys.stderr)
    return code


def _summarize(results, items, cache_dir, env, seconds):
    from rich.table import Table

    failed = [r for r in results if not r["ok"]]
    if failed and len(failed) == len(results) and all(r["rejected"] for r in failed):
        first = failed[0]
        more = f" (and {len(failed) - 1} more work items)" if len(failed) > 1 else ""
        raise UserError(f"FA4 {env.fa4} rejects {first['label']}: {first['error']}{more}")
    table = Table(title="kernel-cache warm", title_justify="left")
    table.add_column("work item", no_wrap=True)
    table.add_column("written", justify="right")
    table.add_column("already present", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("result")
    quiet = {"items": 0, "present": 0, "seconds": 0.0}
    for r in results:
        counts = {s: sum(1 for k in r["kernels"] if k["status"] == s) for s in ("written", "present")}
        if (
            len(results) > COLLAPSE_ABOVE
            and r["ok"]
            and not counts["written"]
            and r.get("key_match") is not False
        ):
            # a length sweep: most items only meet kernels compiled by another item
            quiet["items"] += 1
            quiet["present"] += counts["present"]
            quiet["seconds"] += r.get("seconds", 0)
            continue
        if not r["ok"]:
            outcome = ("[red]rejected by FA4:[/] " if r["rejected"] else "[red]failed:[/] ") + str(r["error"])
            args_ = (r.get("item") or {}).get("args") or {}
            if any(
                isinstance(v, dict) and v.get("tensor")
                for k, v in args_.items()
                if k.startswith("max_seqlen")
            ) and not (r.get("item") or {}).get("int_max_seqlen"):
                outcome += (
                    " (the run passed max_seqlen as a tensor: --int-max-seqlen compiles "
                    "what the job needs once it passes an int)"
                )
        elif r.get("covered"):
            outcome = (
                "left to the replays above (this FA4 compiles its own pre/post kernels)"
                if (r.get("item") or {}).get("other_version")
                else "compiled by the replays above"
            )
        elif r.get("key_match") is False:
            outcome = "[yellow]compiled, key differs from the run's:[/] " + "; ".join(r["key_diff"][:3])

        elif r.get("key_match"):
            outcome = "ok, key matches the run's"
        elif (r.get("item") or {}).get("other_version"):
            outcome = "ok (for this FA4)"
        else:
            outcome = "ok"
        table.add_row(
            r["label"], str(counts["written"]), str(counts["present"]), f"{r.get('seconds', 0):.1f}", outcome
        )
    if quiet["items"]:
        table.add_row(
            f"{quiet['items']} more work items",
            "0",
            str(quiet["present"]),
            f"{quiet['seconds']:.1f}",
            "ok, nothing new to compile",
        )
    # distinct kernels: several work items often share one (a length sweep, fwd+bwd replays)
    status = {}
    for r in results:
        for k in r["kernels"]:
            if k["status"] in ("written", "present"):
                ident = (k["family"], k["hash"])
                status[ident] = "written" if "written" in (status.get(ident), k["status"]) else "present"
    n_written = sum(1 for s in status.values() if s == "written")
    table.add_section()
    table.add_row(
        f"{len(results)} items, {len(failed)} failed; distinct kernels",
        str(n_written),
        str(len(status) - n_written),
        f"{seconds:.1f}",
        "",
    )
    out = _console()
    out.print(table)
    folder = cache_dir / env.fingerprint
    entries = store.entry_paths(cache_dir)
    out.print(
        f"cache: {folder} ({len(entries)} entries, {store.human_size(sum(entries.values()))}) "
        f"for {env.describe()}",
        soft_wrap=True,
    )
    out.print("a job uses it with:")
    for line in _exports(cache_dir):
        out.print(f"  {line}")
    if failed:
        print(f"{PROG}: error: {len(failed)} of {len(results)} work items failed:", file=sys.stderr)
        for r in failed[:8]:  # the reason itself, not only a table cell a narrow terminal cuts
            error = str(r.get("error") or "no error text").strip().splitlines() or ["?"]
            print(
                f"  {r.get('label')}: " + " | ".join(line.strip() for line in error[-3:])[:600],
                file=sys.stderr,
            )
        return 1
    return 0


# -- env / ls / verify / pack / unpack / clear ------------------------------------------------------
def _exports(cache_dir):
    return [f"export {store.ENABLE_VAR}=1", f"export {store.DIR_VAR}={cache_dir}"]


def run_env(args):
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    if args.dir:  # for $(kernel-cache env --dir)
        print(cache_dir)
        return 0
    for line in _exports(cache_dir):
        print(line)
    return 0


def _folders_table(folders, title):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("fingerprint folder")
    table.add_column("entries", justify="right")
    table.add_column("size", justify="right")
    table.add_column("kernels")
    table.add_column("serves")
    table.add_column("here")
    for f in folders:
        fams = ", ".join(f"{name} {n}" for name, (n, _) in f.families().items()) or "-"
        here = "[green]usable[/]" if f.usable else f"[red]unusable:[/] {f.reason}"
        if f.stale_files:
            here += f" ({f.stale_files} leftover temp files)"
        table.add_row(
            f.fingerprint[:16] + "…", str(len(f.entries)), store.human_size(f.size), fams, f.served(), here
        )
    return table


def run_ls(args):
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    env = store.current_environment()
    folders = store.scan(cache_dir)
    out = _console()
    out.print(
        f"cache dir: {cache_dir}"
        + (
            ""
            if os.environ.get(store.ENABLE_VAR) == "1"
            else f"  (note: {store.ENABLE_VAR}=1 is not set in this shell)"
        )
    )
    out.print(
        f"this environment: {env.describe()}; fingerprint "
        f"{env.fingerprint[:16] + '…' if env.fingerprint else '(FA4 not installed)'}"
    )
    if not folders:
        out.print("no FA4 cache entries here")
        return 0
    out.print(_folders_table(folders, f"{len(folders)} fingerprint folders"))
    if args.entries:
        for f in folders:
            for e in f.entries:
                out.print(f"{e.path}  {store.human_size(e.size)}")
    return 0


def run_verify(args):
    env = store.require_fa4()
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    folders = store.scan(cache_dir)
    out = _console()
    fa4_fp = store.fa4_fingerprint()
    if fa4_fp != env.fingerprint:
        # our reading of the fingerprint no longer matches FA4's: trust FA4's, and say so
        out.print(
            f"[yellow]warning:[/] FA4's fingerprint {fa4_fp[:12]}… differs from kernel-cache's "
            f"{env.fingerprint[:12]}…; checking FA4's"
        )
        for f in folders:
            f.usable = f.fingerprint == fa4_fp
            f.reason = "" if f.usable else "fingerprint differs from FA4's for this environment"
    usable = [f for f in folders if f.usable]
    bad, good = [], 0
    for folder in folders:
        if not folder.usable:
            out.print(f"[yellow]skipped[/] {folder.path}: unusable here: {folder.reason}")
    for folder in usable:
        for entry in folder.entries:
            try:
                if entry.size == 0:
                    raise OSError("empty file")
                store.load_entry(entry.path)
                good += 1
            except Exception as exc:
                message = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                bad.append((entry, f"{type(exc).__name__}: {message}"))
    for entry, why in bad:
        out.print(f"[red]bad[/] {entry.path}: {why}", soft_wrap=True)
        if args.delete_bad:
            entry.path.unlink(missing_ok=True)
    total = sum(len(f.entries) for f in usable)
    out.print(
        f"{good} of {total} entries load"
        + (f"; {len(bad)} bad" if bad else "")
        + (" (deleted: FA4 recompiles them on first use)" if bad and args.delete_bad else "")
    )
    if not usable or not total:
        out.print(
            f"no cache entries for this environment ({env.describe()}) in {cache_dir}: "
            "a job would compile every kernel"
        )
        return 1
    return 1 if bad else 0


def run_pack(args):
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    folders = store.scan(cache_dir)
    if not args.all:
        folders = [f for f in folders if f.usable]
    if not folders or not any(f.entries for f in folders):
        raise UserError(
            f"nothing to pack: no entries for this environment in {cache_dir}"
            + ("" if args.all else " (--all packs every folder)")
        )
    count = store.pack(cache_dir, args.tarball, folders)
    print(
        f"packed {count} entries from {len(folders)} folder(s) into {args.tarball} "
        f"({store.human_size(Path(args.tarball).stat().st_size)})"
    )
    return 0


def run_unpack(args):
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    touched = store.unpack(args.tarball, cache_dir)
    out = _console()
    folders = [f for f in store.scan(cache_dir) if f.fingerprint in touched]
    out.print(_folders_table(folders, f"unpacked into {cache_dir}"))
    if not any(f.usable for f in folders):
        out.print(f"[red]none of it serves this environment[/] ({store.current_environment().describe()})")
        return 1
    for line in _exports(cache_dir):
        out.print(line)
    return 0


def run_clear(args):
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    folders = store.scan(cache_dir)
    if args.stale:
        folders = [f for f in folders if not f.usable]
    removed = store.clear(folders)
    print(f"removed {removed} entries in {len(folders)} folder(s) from {cache_dir}")
    return 0


def run_warm_all(args):
    """FA4 kernels (run_warm) and, for --from-run, the Triton/FLA kernels the run compiled."""
    triton_code, fa4_left = _warm_triton(args)
    if not fa4_left:
        return triton_code
    return run_warm(args) or (triton_code or 0)


COMMANDS = {
    "warm": (prepare_warm, run_warm_all, "precompile FA4 kernels into FA4's persistent cache"),
    "env": (
        lambda p: p.add_argument("--dir", action="store_true", help="print only the cache dir"),
        run_env,
        "print the exports that make a job use the cache",
    ),
    "ls": (
        lambda p: p.add_argument("--entries", action="store_true", help="list every entry"),
        run_ls,
        "list cache folders, entries, sizes and which environment each serves",
    ),
    "verify": (
        lambda p: p.add_argument("--delete-bad", action="store_true", help="delete entries that do not load"),
        run_verify,
        "load every entry the way FA4 does; report the bad ones",
    ),
    "pack": (
        lambda p: (
            p.add_argument("tarball", type=argtypes.output_file, help="output .tar.gz"),
            p.add_argument("--all", action="store_true", help="also folders for other environments"),
        ),
        run_pack,
        "write the cache for this environment into a tarball",
    ),
    "unpack": (
        lambda p: p.add_argument("tarball", type=argtypes.existing_file),
        run_unpack,
        "extract a tarball from `pack` into the cache dir",
    ),
    "clear": (
        lambda p: p.add_argument(
            "--stale", action="store_true", help="only folders that do not serve this environment"
        ),
        run_clear,
        "delete cache folders",
    ),
}


WRITES_CACHE = {"warm", "unpack", "clear"}


def build_parser():
    parser = argtypes.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (prepare, _, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        # the commands that write into the cache dir need one they can create files in
        p.add_argument(
            "--cache-dir",
            metavar="DIR",
            type=argtypes.output_folder if name in WRITES_CACHE else argtypes.folder_path,
            help=f"the cache dir (default: ${store.DIR_VAR}, else FA4's default)",
        )
        if prepare:
            prepare(p)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command][1](args)
    except UserError as exc:
        print(f"{PROG}: error: {argtypes.one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of traindx: one line (TRAINDX_DEBUG=1 shows the traceback)
        if os.environ.get("TRAINDX_DEBUG"):
            raise
        print(
            f"{PROG}: internal error: {type(exc).__name__}: {argtypes.one_line(exc)} "
            "(a bug of traindx; TRAINDX_DEBUG=1 shows where)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
