"""`kernel-cache env | ls | verify | pack | unpack | clear`: the cache on disk, listed, checked,
moved between machines and cleared."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.markup import escape
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
        here = "[green]usable[/]" if f.usable else f"[red]unusable:[/] {escape(f.reason)}"
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


def _delete(bad: Sequence[tuple[store.Entry, str]]) -> str | None:
    """Delete the bad entries; one line on what could not be (a read-only cache), else None."""
    failed = []
    for entry, _ in bad:
        try:
            entry.path.unlink(missing_ok=True)
        except OSError as exc:
            failed.append((entry, exc.strerror or str(exc)))
    if not failed:
        return None
    entry, why = failed[0]
    return (
        f"{len(failed)} of {len(bad)} bad entries could not be deleted from {entry.path.parent.parent} "
        f"({why}); FA4 will fail to load them and recompile each time: give a writable --cache-dir"
    )


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
            f.serves = f.fingerprint == fa4_fp
            f.reason = "" if f.serves else "fingerprint differs from FA4's for this environment"
    usable = [f for f in folders if f.serves]  # damaged entries are checked (and deleted) too
    for folder in folders:
        if not folder.serves:
            out.print(f"[yellow]skipped[/] {folder.path}: unusable here: {escape(folder.reason)}")
    damaged = {e.path: why for f in usable for e, why in f.bad}  # by their bytes: never loaded
    checked = [(e, damaged.get(e.path) or _load_error(e)) for folder in usable for e in folder.entries]
    bad = [(entry, why) for entry, why in checked if why is not None]
    good = len(checked) - len(bad)
    for entry, why in bad:
        out.print(f"[red]bad[/] {escape(str(entry.path))}: {escape(why)}", soft_wrap=True)
    not_deleted = _delete(bad) if args.delete_bad else None
    if not_deleted:
        out.print(f"[red]not deleted:[/] {escape(not_deleted)}", soft_wrap=True)
    total = sum(len(f.entries) for f in usable)
    out.print(
        f"{good} of {total} entries load"
        + (f"; {len(bad)} bad" if bad else "")
        + (
            " (deleted: FA4 recompiles them on first use)"
            if bad and args.delete_bad and not not_deleted
            else ""
        )
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
        folders = [f for f in folders if f.serves]
    if not folders or not any(f.entries for f in folders):
        raise UserError(
            f"nothing to pack: no entries for this environment in {cache_dir}"
            + ("" if args.all else " (--all packs every folder)")
        )
    bad = [(f, e, why) for f in folders for e, why in f.bad]
    if bad:
        folder, entry, why = bad[0]
        raise UserError(
            f"not packed: {len(bad)} damaged entries in {cache_dir} (first: {entry.path}: {why}); "
            "kernel-cache verify --delete-bad removes them"
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
        folders = [f for f in folders if not f.serves]
    removed, kept = store.clear(folders)
    for line in kept:
        print(f"kernel-cache: {line}", file=sys.stderr)
    print(f"removed {removed} entries in {len(folders) - len(kept)} folder(s) from {cache_dir}")
    # a folder kept because it is not the cache's is no failure; one that could not be removed is
    return 1 if any("not cleared" in line for line in kept) else 0
