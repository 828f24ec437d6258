"""`kernel-cache warm --from-run RUN` for Triton kernels (flash-linear-attention's and others):
put the compiled kernels *and* the autotune choices a run paid for on disk before training.

What the shim records for a Triton kernel is its name, module, autotune key (names and values,
dtypes), the seconds spent and the config Triton chose, not every argument or the launch grid,
so a kernel cannot be replayed on its own. The warm-up replays the recorded *job* instead: the
run's command, from the run's directory, for as many steps as it took the run to meet every key
it tuned (`diagnose --steps N`), with the persistence switches of the installed Triton and FLA on
and TRITON_CACHE_DIR pointing at the cache being filled (Triton 3.6: compiled kernels are always
written there; autotune timings only with `cache_results`, i.e. TRITON_CACHE_AUTOTUNING=1 or
FLA_CACHE_RESULTS=1, FLA 0.6.0's default). The warm-up is itself a `diagnose` run, so what it
tuned and wrote is checked from its own record, kernel by kernel.

Needs a GPU: Triton benchmarks configs on the device, and its interpreter (TRITON_INTERPRET=1)
turns `cache_results` off (triton/runtime/autotuner.py:39 in 3.6.0). On a CPU-only machine it
says so in one line. What does not need a GPU: `--fla-config-dir DIR` writes FLA's own config
files (`<kernel>.json`, read with FLA_CACHE_MODE=strict|fuzzy|full, FLA_CONFIG_DIR=DIR) from the
configs the run chose.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traindx.common import argtypes
from traindx.common.atomic import write_text
from traindx.common.envvars import reads
from traindx.common.errors import UserError
from traindx.kernel_cache.cli.warm import gpu_arch

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord

Say = Callable[[str], object]
Event = dict[str, Any]

TRITON_KINDS = ("triton_autotune", "triton")
CONFIG_OPTIONS = ("num_warps", "num_ctas", "num_stages", "maxnreg", "ir_override")
NO_GPU_EXIT = 3
# TRAINDX_TRITON_WARM_ON_CPU=1 runs the warm-up without a GPU anyway (the tests: Triton's
# interpreter tunes, and the warm-up's own record then shows that nothing was kept)
WARMUP_TIMEOUT_S = 3600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`kernel-cache warm` options for Triton kernels (called from cli.prepare_warm)."""
    g = parser.add_argument_group("Triton / flash-linear-attention kernels (--from-run)")
    g.add_argument(
        "--triton-cache-dir",
        type=argtypes.output_folder,
        metavar="DIR",
        help="TRITON_CACHE_DIR to fill (default: $TRITON_CACHE_DIR, else triton-cache/ "
        "beside the run folders)",
    )
    g.add_argument(
        "--fla-config-dir",
        type=argtypes.output_folder,
        metavar="DIR",
        help="also write FLA config files (<kernel>.json) from the configs the run chose",
    )
    g.add_argument("--no-triton", action="store_true", help="warm FA4 kernels only")


# -- what the run recorded -----------------------------------------------------------------------
def triton_events(run: RunRecord) -> list[Event]:
    """The run's Triton compile and autotune events (all ranks) as dicts, oldest first."""
    compiles = run.compiles
    if not len(compiles) or "kind" not in compiles:
        return []
    rows = compiles[compiles["kind"].isin(TRITON_KINDS)].sort_values("start_ns")
    return [{k: v for k, v in row.items() if not _missing(v)} for row in rows.to_dict("records")]


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def has_fa4_compiles(run: RunRecord) -> bool:
    compiles = run.compiles
    return bool(len(compiles)) and "kind" in compiles and bool((compiles["kind"] == "cute_dsl").any())


def plan(run: RunRecord, events: list[Event]) -> dict[str, Any]:
    """What a warm-up must cover: kernels, keys, and the steps the run needed to meet them all."""
    tuned: dict[str, dict[str, Any]] = {}
    compiled: dict[str, dict[str, Any]] = {}
    last_step = 0
    for e in events:
        step = e.get("step")
        step = int(step) if isinstance(step, (int, float)) else 0
        last_step = max(last_step, step)
        if e.get("kind") == "triton_autotune":
            entry = tuned.setdefault(
                e.get("kernel") or "?", {"keys": [], "bench_s": 0.0, "module": e.get("module")}
            )
            entry["keys"].append(e.get("key_fields") or e.get("key"))
            entry["bench_s"] += float(e.get("bench_s", e.get("duration_s")) or 0.0)
        elif not e.get("autotune_of"):
            entry = compiled.setdefault(e.get("kernel") or "?", {"count": 0, "seconds": 0.0})
            entry["count"] += 1
            entry["seconds"] += float(e.get("duration_s") or 0.0)
    return {
        "tuned": tuned,
        "compiled": compiled,
        "steps": last_step + 1,
        "command": list(run.manifest.get("command") or []),
        "cwd": run.manifest.get("cwd"),
    }


def default_cache_dir(run: RunRecord) -> str:
    """The TRITON_CACHE_DIR the prescriptions name: the job's own, else beside the run folders."""
    env = run.manifest.get("environment") or run.manifest.get("env") or {}
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    if isinstance(env.get("TRITON_CACHE_DIR"), str) and env["TRITON_CACHE_DIR"] != "<redacted>":
        job_dir: str = env["TRITON_CACHE_DIR"]
        return job_dir
    return os.path.abspath(os.path.join(run.path, os.pardir, "triton-cache"))


def persistence_env(packages: Mapping[str, str], cache_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The variables that make the installed Triton/FLA keep compiled kernels and choices."""
    env = {"TRITON_CACHE_DIR": str(cache_dir)}
    if reads(packages, "triton", "TRITON_CACHE_AUTOTUNING"):
        env["TRITON_CACHE_AUTOTUNING"] = "1"
    if reads(packages, "fla", "FLA_CACHE_RESULTS"):
        env["FLA_CACHE_RESULTS"] = "1"
    return env


def installed_packages() -> dict[str, str]:
    out = {}
    for name in ("triton", "fla-core", "flash-linear-attention"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


# -- FLA's own config files ------------------------------------------------------------------------
def _literal(text: object) -> Any:
    try:
        return ast.literal_eval(str(text))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def fla_config_files(events: list[Event], triton_version: str | None = None) -> dict[str, dict[str, Any]]:
    """{kernel: file content} in the format of fla/ops/utils/cache.py (0.6.0): `autotune_entries`
    keyed by md5 of the JSON of the autotune key (key values, then the dtype of every tensor
    argument: Triton's tuning key), each with the chosen `config` split into kwargs and options."""
    files: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.get("kind") != "triton_autotune" or not e.get("best_config"):
            continue
        chosen = _literal(e["best_config"])
        fields = e.get("key_fields") or {}
        names = list(e.get("key_names") or fields.keys())
        values = [_literal(fields.get(n)) for n in names if n in fields]
        if not isinstance(chosen, dict) or any(
            v is None and fields.get(n) != "None" for n, v in zip(names, values)
        ):
            continue  # a value we cannot rebuild exactly (e.g. a tensor in the key)
        key = values + [str(d) for d in (e.get("key_dtypes") or {}).values()]
        config = {
            "kwargs": {k: v for k, v in chosen.items() if k not in CONFIG_OPTIONS},
            "num_warps": chosen.get("num_warps", 4),
            "num_stages": chosen.get("num_stages", 3),
            "num_ctas": chosen.get("num_ctas", 1),
        }
        if chosen.get("maxnreg") is not None:
            config["maxnreg"] = chosen["maxnreg"]
        serial = json.dumps(key, separators=(",", ":"), sort_keys=True)
        kernel = e.get("kernel") or "?"
        content = files.setdefault(
            kernel, {"kernel_name": kernel, "triton_version": triton_version, "autotune_entries": {}}
        )
        content["autotune_entries"][hashlib.md5(serial.encode()).hexdigest()] = {
            "autotune_key": key,
            "config": config,
        }
    return files


def write_fla_configs(
    events: list[Event], directory: str | os.PathLike[str], triton_version: str | None = None
) -> list[Path]:
    folder = Path(directory)
    files = fla_config_files(events, triton_version)
    if not files:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for kernel, content in files.items():
        path = folder / f"{kernel}.json"
        if path.exists():  # keep entries another run wrote
            try:
                old = json.loads(path.read_text())
                content["autotune_entries"] = {
                    **(old.get("autotune_entries") or {}),
                    **content["autotune_entries"],
                }
            except (OSError, ValueError):
                pass
        write_text(path, json.dumps(content, indent=1, sort_keys=True))
        written.append(path)
    return written


# -- the warm-up -------------------------------------------------------------------------------------
def warmup_command(the_plan: Mapping[str, Any], run_dir: str | os.PathLike[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "traindx",
        "--quiet",
        "--no-pyspy",
        "--torch-profile",
        "off",
        "--steps",
        str(the_plan["steps"]),
        "--run-dir",
        str(run_dir),
        "--",
        *the_plan["command"],
    ]


def _gpu_visible() -> bool:
    return gpu_arch() is not None


def check_warmup(the_plan: Mapping[str, Any], warm_run: RunRecord) -> list[dict[str, Any]]:
    """Per tuned kernel of the plan: did the warm-up tune it with the choices kept on disk?"""
    rows = []
    events = triton_events(warm_run)
    by_kernel: dict[Any, list[Event]] = {}
    for e in events:
        if e.get("kind") == "triton_autotune":
            by_kernel.setdefault(e.get("kernel"), []).append(e)
    for kernel, info in the_plan["tuned"].items():
        got = by_kernel.get(kernel, [])
        recorded = [e.get("cache_results") for e in got if e.get("cache_results") is not None]
        hits = sum(1 for e in got if e.get("disk_cache_hit"))
        if not got:
            status, ok = "not tuned by the warm-up (the job did not reach it)", False
        elif recorded and not any(recorded) and not hits:
            status, ok = "tuned, but Triton's cache_results was off: nothing kept on disk", False
        elif hits == len(got):
            status, ok = "already on disk", True
        elif recorded:
            status, ok = "ok, choices written", True
        else:  # an older shim: it did not say whether Triton kept the choice
            status, ok = "tuned (unverified: the record does not say whether Triton kept it)", True
        rows.append(
            {
                "kernel": kernel,
                "run_keys": len(info["keys"]),
                "warm_keys": len(got),
                "disk_hits": hits,
                "bench_s": sum(float(e.get("bench_s", e.get("duration_s")) or 0) for e in got),
                "status": status,
                "ok": ok,
            }
        )
    return rows


def warm_from_run(args: argparse.Namespace, out: Say = print, err: Say | None = None) -> int | None:
    """Returns None when the run compiled no Triton kernel (nothing to do here), else an exit code."""
    from traindx.derive.run import load_run  # lazy: pandas, only for --from-run

    say = err or _to_stderr
    if getattr(args, "no_triton", False):
        return None
    run = load_run(args.from_run)
    events = triton_events(run)
    if not events:
        return None
    the_plan = plan(run, events)
    if not the_plan["tuned"] and has_fa4_compiles(run):
        # compiles alone: Triton keeps those in TRITON_CACHE_DIR by itself; replaying a whole FA4
        # job for them (e.g. inside `diagnose --fix`) would cost more than it saves
        seconds = sum(c["seconds"] for c in the_plan["compiled"].values())
        say(
            f"kernel-cache warm: Triton: {len(the_plan['compiled'])} kernel(s) compiled ({seconds:.1f} s), "
            "none autotuned: left to Triton's own cache (TRITON_CACHE_DIR)"
        )
        return None
    packages = run.manifest.get("packages") or {}
    here = installed_packages()
    cache_dir = Path(getattr(args, "triton_cache_dir", None) or default_cache_dir(run)).absolute()
    env = persistence_env(here or packages, cache_dir)
    names = ", ".join(the_plan["tuned"]) or ", ".join(the_plan["compiled"])
    bench = sum(t["bench_s"] for t in the_plan["tuned"].values())
    say(
        f"kernel-cache warm: Triton: {len(the_plan['tuned'])} autotuned kernel(s) ({bench:.1f} s of "
        f"benchmarking in {run.path}) and {len(the_plan['compiled'])} compiled: {names}"
    )
    if getattr(args, "fla_config_dir", None):
        _write_fla_config_files(events, args.fla_config_dir, here.get("triton"), say)
    if not the_plan["command"]:
        raise UserError(f"{run.path}: the manifest holds no command to replay")
    command = warmup_command(the_plan, cache_dir / ".warmup" / time.strftime("%Y%m%d-%H%M%S"))
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    if getattr(args, "dry_run", False):
        _print_dry_run(the_plan, exports, command, out)
        return 0
    if not _gpu_visible() and os.environ.get("TRAINDX_TRITON_WARM_ON_CPU") != "1":
        say(
            f"kernel-cache: skipped Triton: the {len(the_plan['tuned'])} autotuned kernel(s) need a "
            "GPU to benchmark, and Triton's interpreter keeps no autotune results (TRITON_INTERPRET=1 "
            "turns cache_results off): run this on a GPU node of the job's kind"
        )
        return NO_GPU_EXIT
    cache_dir.mkdir(parents=True, exist_ok=True)
    say(f"  warm-up: the run's command for {the_plan['steps']} step(s) with {exports}")
    started = time.perf_counter()
    proc, run_dir = _run_warmup(command, the_plan, env)
    seconds = time.perf_counter() - started
    rows = check_warmup(the_plan, load_run(run_dir))
    for r in rows:
        out(
            f"  {'ok ' if r['ok'] else 'FAIL'} {r['kernel']}: {r['warm_keys']} key(s) tuned "
            f"({r['disk_hits']} from disk, {r['bench_s']:.1f} s) for the run's {r['run_keys']}: "
            f"{r['status']}"
        )
    out(f"triton cache: {cache_dir} ({seconds:.0f} s, warm-up run {run_dir}); a job uses it with:")
    for k, v in env.items():
        out(f"  export {k}={shlex.quote(v)}")
    if proc.returncode not in (0, None):
        say(f"kernel-cache: the warm-up job exited {proc.returncode} (see {run_dir}/log.txt)")
    failed = [r for r in rows if not r["ok"]]
    return 1 if failed or not rows else 0


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr)


def _write_fla_config_files(
    events: list[dict[str, Any]], directory: str, triton_version: str | None, say: Say
) -> None:
    written = write_fla_configs(events, directory, triton_version)
    say(
        f"  FLA config files: {len(written)} written to {directory} (a job reads them "
        f"with FLA_CACHE_MODE=fuzzy FLA_CONFIG_DIR={directory})"
        if written
        else "  FLA config files: none (the run recorded no chosen config with a rebuildable key)"
    )


def _print_dry_run(the_plan: dict[str, Any], exports: str, command: list[str], out: Say) -> None:
    out(
        f"triton warm-up ({the_plan['steps']} step(s), in {the_plan['cwd']}): {exports} {shlex.join(command)}"
    )
    for kernel, info in the_plan["tuned"].items():
        out(
            f"  autotuned {kernel}: {len(info['keys'])} key(s), {info['bench_s']:.1f} s; "
            f"first key {info['keys'][0]}"
        )


def _run_warmup(
    command: list[str], the_plan: dict[str, Any], env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The run's command for the plan's steps, recorded by `diagnose` into its own run folder."""
    try:
        proc = subprocess.run(
            command,
            cwd=the_plan["cwd"] or None,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=WARMUP_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"the Triton warm-up did not finish: {exc}") from None
    run_dir = Path(command[command.index("--run-dir") + 1])
    if not (run_dir / "manifest.json").exists():
        tail = "\n".join(proc.stdout.splitlines()[-5:])
        raise UserError(f"the Triton warm-up wrote no run ({run_dir}); its output ended: {tail}")
    return proc, run_dir
