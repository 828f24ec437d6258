"""The table `kernel-cache warm` ends with: one row per work item (a long length sweep folds the
items that compiled nothing), the distinct kernels written and found, where the cache is and the
exports a job needs; then the reasons of the failed items on stderr."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from traindx.common.errors import UserError
from traindx.kernel_cache.cli.output import PROG, console, exports
from traindx.kernel_cache.store import cache as store

COLLAPSE_ABOVE = 12  # work items; above this the table folds the ones that compiled nothing

Result = dict[str, Any]


def summarize(results: Sequence[Result], cache_dir: Path, env: store.Environment, seconds: float) -> int:
    """Print the summary; 1 when a work item failed, else 0. FA4 rejecting every item is one
    UserError with the first reason."""
    failed = [r for r in results if not r["ok"]]
    if failed and len(failed) == len(results) and all(r["rejected"] for r in failed):
        first = failed[0]
        more = f" (and {len(failed) - 1} more work items)" if len(failed) > 1 else ""
        raise UserError(f"FA4 {env.fa4} rejects {first['label']}: {first['error']}{more}")
    table = _results_table(results)
    n_written, n_present = _distinct_kernels(results)
    table.add_section()
    table.add_row(
        f"{len(results)} items, {len(failed)} failed; distinct kernels",
        str(n_written),
        str(n_present),
        f"{seconds:.1f}",
        "",
    )
    out = console()
    out.print(table)
    folder = cache_dir / (env.fingerprint or "")
    entries = store.entry_paths(cache_dir)
    out.print(
        f"cache: {folder} ({len(entries)} entries, {store.human_size(sum(entries.values()))}) "
        f"for {env.describe()}",
        soft_wrap=True,
    )
    out.print("a job uses it with:")
    for line in exports(cache_dir):
        out.print(f"  {line}")
    if failed:
        _print_failures(failed, len(results))
        return 1
    return 0


def _results_table(results: Sequence[Result]) -> Table:
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
        table.add_row(
            r["label"],
            str(counts["written"]),
            str(counts["present"]),
            f"{r.get('seconds', 0):.1f}",
            _outcome(r),
        )
    if quiet["items"]:
        table.add_row(
            f"{quiet['items']} more work items",
            "0",
            str(quiet["present"]),
            f"{quiet['seconds']:.1f}",
            "ok, nothing new to compile",
        )
    return table


def _outcome(r: Result) -> str:
    """The result cell of one work item."""
    item = r.get("item") or {}
    if not r["ok"]:
        outcome = ("[red]rejected by FA4:[/] " if r["rejected"] else "[red]failed:[/] ") + str(r["error"])
        args = item.get("args") or {}
        tensor_max_seqlen = any(
            isinstance(v, dict) and v.get("tensor") for k, v in args.items() if k.startswith("max_seqlen")
        )
        if tensor_max_seqlen and not item.get("int_max_seqlen"):
            outcome += (
                " (the run passed max_seqlen as a tensor: --int-max-seqlen compiles "
                "what the job needs once it passes an int)"
            )
        return outcome
    if r.get("covered"):
        return (
            "left to the replays above (this FA4 compiles its own pre/post kernels)"
            if item.get("other_version")
            else "compiled by the replays above"
        )
    if r.get("key_match") is False:
        return "[yellow]compiled, key differs from the run's:[/] " + "; ".join(r["key_diff"][:3])
    if r.get("key_match"):
        return "ok, key matches the run's"
    if item.get("other_version"):
        return "ok (for this FA4)"
    return "ok"


def _distinct_kernels(results: Sequence[Result]) -> tuple[int, int]:
    """(written, already present) over distinct kernels: several work items often share one (a
    length sweep, fwd+bwd replays)."""
    status: dict[tuple[str, str], str] = {}
    for r in results:
        for k in r["kernels"]:
            if k["status"] in ("written", "present"):
                ident = (k["family"], k["hash"])
                status[ident] = "written" if "written" in (status.get(ident), k["status"]) else "present"
    n_written = sum(1 for s in status.values() if s == "written")
    return n_written, len(status) - n_written


def _print_failures(failed: Sequence[Result], total: int) -> None:
    print(f"{PROG}: error: {len(failed)} of {total} work items failed:", file=sys.stderr)
    for r in failed[:8]:  # the reason itself, not only a table cell a narrow terminal cuts
        error = str(r.get("error") or "no error text").strip().splitlines() or ["?"]
        print(
            f"  {r.get('label')}: " + " | ".join(line.strip() for line in error[-3:])[:600],
            file=sys.stderr,
        )
