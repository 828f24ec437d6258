"""`kernel-cache env | ls | verify | pack | unpack | clear`: the cache on disk, listed, checked,
moved between machines and cleared."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.table import Table

from traindx.common.errors import UserError
from traindx.kernel_cache.cli.output import console, exports
from traindx.kernel_cache.store import cache as store


def run_env(args: argparse.Namespace) -> int:
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    if args.dir:  # for $(kernel-cache env --dir)
        print(cache_dir)
        return 0
    for line in exports(cache_dir):
        print(line)
    return 0


def folders_table(folders: list[store.CacheFolder], title: str) -> Table:
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


def run_ls(args: argparse.Namespace) -> int:
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    env = store.current_environment()
    folders = store.scan(cache_dir)
    out = console()
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
    out.print(folders_table(folders, f"{len(folders)} fingerprint folders"))
    if args.entries:
        for f in folders:
            for e in f.entries:
                out.print(f"{e.path}  {store.human_size(e.size)}")
    return 0


def _load_error(entry: store.Entry) -> str | None:
    """Why an entry does not load the way FA4 loads it; None when it does."""
    try:
        if entry.size == 0:
            raise OSError("empty file")
        store.load_entry(entry.path)
        return None
    except Exception as exc:
        message = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {message}"


def run_verify(args: argparse.Namespace) -> int:
    env = store.require_fa4()
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    folders = store.scan(cache_dir)
    out = console()
    fa4_fp = store.fa4_fingerprint()
    if fa4_fp != env.fingerprint:
        # our reading of the fingerprint no longer matches FA4's: trust FA4's, and say so
        out.print(
            f"[yellow]warning:[/] FA4's fingerprint {fa4_fp[:12]}… differs from kernel-cache's "
            f"{(env.fingerprint or '')[:12]}…; checking FA4's"
        )
        for f in folders:
            f.usable = f.fingerprint == fa4_fp
            f.reason = "" if f.usable else "fingerprint differs from FA4's for this environment"
    usable = [f for f in folders if f.usable]
    for folder in folders:
        if not folder.usable:
            out.print(f"[yellow]skipped[/] {folder.path}: unusable here: {folder.reason}")
    checked = [(entry, _load_error(entry)) for folder in usable for entry in folder.entries]
    bad = [(entry, why) for entry, why in checked if why is not None]
    good = len(checked) - len(bad)
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


def run_pack(args: argparse.Namespace) -> int:
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


def run_unpack(args: argparse.Namespace) -> int:
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    touched = store.unpack(args.tarball, cache_dir)
    out = console()
    folders = [f for f in store.scan(cache_dir) if f.fingerprint in touched]
    out.print(folders_table(folders, f"unpacked into {cache_dir}"))
    if not any(f.usable for f in folders):
        out.print(f"[red]none of it serves this environment[/] ({store.current_environment().describe()})")
        return 1
    for line in exports(cache_dir):
        out.print(line)
    return 0


def run_clear(args: argparse.Namespace) -> int:
    cache_dir = store.resolve_cache_dir(args.cache_dir)
    folders = store.scan(cache_dir)
    if args.stale:
        folders = [f for f in folders if not f.usable]
    removed = store.clear(folders)
    print(f"removed {removed} entries in {len(folders)} folder(s) from {cache_dir}")
    return 0
