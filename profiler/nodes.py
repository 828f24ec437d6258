"""Multi-node runs: one `diagnose` per node, each writing its own part of one run folder.

Layout of a multi-node run folder RUN (a shared file system, or folders copied together later):

    RUN/nodes/<node>/   a complete run folder of that node alone (manifest.json, events/, procs/,
                        pyspy/, nvml.csv, log.txt, its own report): written by that node's
                        diagnose only, so no two hosts ever write one file and no lock is needed
    RUN/clock.json      written by `diagnose merge RUN`: each node's clock offset to the
                        reference node, with its error bound and the evidence behind it
    RUN/manifest.json   written by `diagnose merge RUN`: the merged manifest ("nodes": [...],
                        ranks over all nodes); the node folders stay untouched

A node's name must be unique within the run, and a host name is not (two agents on one machine,
a re-used host): it is the host name plus the launcher's node rank (torchrun --node-rank,
accelerate --machine_rank, SLURM_NODEID), or `--node NAME`; the folder is claimed with an
exclusive mkdir, so a clash gets a suffix instead of mixing two nodes' files.

Ray: a node of a Ray cluster is the command that starts it, `ray start --head --block` or
`ray start --address HEAD:PORT --block`; the training workers are started later by that node's
raylet (its child), so they inherit the shim from it like any other child of the job.
"""

import functools
import io
import json
import os
import re
import shutil
import socket
import stat
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from traindx.common import atomic, untrusted
from traindx.common.errors import UserError
from traindx.profiler import manifest as manifest_file
from traindx.profiler.clocks import METHOD
from traindx.profiler.shim._traindx_shim.roles import parse_process_file, safe_label
from traindx.profiler.torchtrace import load_traces as load_folder

# (folder, node or None, clock offset in ns) of one part of a run
Part = tuple[str, Any, int]

NODES_DIR = "nodes"
CLOCK_FILE = "clock.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _flag(argv: Sequence[str], *names: str) -> str | None:
    """Value of `--name V` / `--name=V` in argv (first of names found), else None."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def _max_nodes(value: object) -> int:
    """torchrun's --nnodes: 'N' or 'MIN:MAX' -> the largest node count, else 0."""
    parts = str(value or "").split(":")
    return max((int(p) for p in parts if p.strip().isdigit()), default=0)


def _launcher_args(command: Sequence[str]) -> tuple[str | None, Sequence[str]]:
    """(kind, its arguments) when the command starts a known multi-node launcher."""
    if not command:
        return None, []
    exe = os.path.basename(command[0])
    if exe == "torchrun":
        return "torchrun", command[1:]
    if exe in ("accelerate",) and command[1:2] == ["launch"]:
        return "accelerate", command[2:]
    if exe == "ray" and command[1:2] == ["start"]:
        return "ray", command[2:]
    if exe.startswith("python"):
        for i, arg in enumerate(command[:-1]):
            if arg == "-m" and command[i + 1] in _TORCHRUN_MODULES:
                return "torchrun", command[i + 2 :]
    return None, []


def node_identity(
    command: Sequence[str], env: Mapping[str, str], explicit: str | None = None, hostname: str | None = None
) -> tuple[str, str] | None:
    """(node name, source) when this diagnose is one node of a multi-node run, else None.

    Sources, first match wins: `--node NAME`; SLURM with more than one node (SLURM_NODEID, and
    the task id when srun starts several diagnose per node); torchrun with --nnodes > 1 (its
    --node-rank, or PET_NODE_RANK; elastic rendezvous without one: the host name alone, made
    unique when the folder is claimed); accelerate launch --num_machines > 1 (--machine_rank);
    `ray start` (a Ray cluster node: `<host>-head` for --head, else the host name).
    """
    host = (hostname or socket.gethostname()).split(".")[0] or "node"
    host = re.sub(r"[^A-Za-z0-9._-]", "_", host)
    kind, args = _launcher_args(command)
    if kind == "ray":
        _check_ray_start(args)
    if explicit:
        if not _NAME.fullmatch(explicit):
            raise UserError(f"--node {explicit!r}: use letters, digits, '.', '_' and '-'")
        return explicit, "--node"
    if kind == "torchrun":
        nnodes = _flag(args, "--nnodes") or env.get("PET_NNODES")
        if _max_nodes(nnodes) > 1:
            rank = _flag(args, "--node-rank", "--node_rank") or env.get("PET_NODE_RANK")
            if rank is not None and str(rank).isdigit():
                return f"{host}-n{rank}", "torchrun --node-rank"
            return host, "torchrun --nnodes"
    if kind == "accelerate" and _max_nodes(_flag(args, "--num_machines", "--num-machines")) > 1:
        rank = _flag(args, "--machine_rank", "--machine-rank")
        if rank is not None and str(rank).isdigit():
            return f"{host}-n{rank}", "accelerate --machine_rank"
        return host, "accelerate --num_machines"
    if kind == "ray":
        # the role names the head; workers of one host are told apart when the folder is claimed
        if "--head" in args:
            return f"{host}-head", "ray start --head"
        return host, "ray start --address"
    nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if _max_nodes(nnodes) > 1 and str(env.get("SLURM_NODEID", "")).isdigit():
        name = f"{host}-n{env['SLURM_NODEID']}"
        tasks, nodes = env.get("SLURM_NTASKS", ""), _max_nodes(nnodes)
        if tasks.isdigit() and int(tasks) > nodes and str(env.get("SLURM_PROCID", "")).isdigit():
            name += f"-t{env['SLURM_PROCID']}"  # several diagnose per node: one folder each
        return name, "SLURM_NODEID"
    return None


def _check_ray_start(args: Sequence[str]) -> None:
    """`ray start` without --block daemonizes the node and returns at once: diagnose would end
    while the raylet (and the workers it starts later) keeps running, unrecorded."""
    if "--block" not in args:
        raise UserError(
            "ray start returns at once and leaves the node running in the background: "
            "run it in the foreground under diagnose with `ray start --block ...`"
        )


def shared_run_dir(command: Sequence[str], env: Mapping[str, str], run_dir: str | None) -> str:
    """The shared run folder of a multi-node run: --run-dir, else an id every node of the
    launch knows (Slurm's job id, torchrun's --rdzv-id) under ./runs."""
    if run_dir:
        return run_dir
    if env.get("SLURM_JOB_ID"):
        return os.path.join("runs", f"slurm-{env['SLURM_JOB_ID']}")
    kind, args = _launcher_args(command)
    rdzv = _flag(args, "--rdzv-id", "--rdzv_id") if kind == "torchrun" else None
    if rdzv and rdzv != "none" and _NAME.fullmatch(rdzv):
        return os.path.join("runs", f"rdzv-{rdzv}")
    raise UserError(
        "a multi-node run needs --run-dir DIR on a folder every node can write "
        "(each node writes DIR/nodes/<node>/)"
    )


def claim_node_dir(run_dir: str, name: str) -> str:
    """Create RUN/nodes/<name> exclusively (a taken name gets -2, -3, ...); returns its path."""
    root = os.path.join(run_dir, NODES_DIR)
    os.makedirs(root, exist_ok=True)
    for i in range(1, 1000):
        path = os.path.join(root, name if i == 1 else f"{name}-{i}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise UserError(f"could not claim a node folder under {root}")


def node_dirs(run_dir: str) -> dict[str, str]:
    """{node name: folder} of the node parts in a run folder that have a manifest."""
    root = os.path.join(run_dir, NODES_DIR)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return {}
    return {n: os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n, "manifest.json"))}


def read_clock(run_dir: str) -> dict[str, int]:
    """{node: offset_ns} from RUN/clock.json (an unknown offset counts as 0)."""
    path = os.path.join(run_dir, CLOCK_FILE)
    try:
        clock = untrusted.load_json(path)  # a run folder's file: no link, FIFO or device
        return {n: int(v.get("offset_ns") or 0) for n, v in clock["nodes"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{path} is missing or corrupt: run `diagnose merge {run_dir}`") from None


def parts(run_dir: str, manifest: Mapping[str, Any]) -> list[Part]:
    """[(folder, node, offset_ns)] whose evidence makes up the run: the run folder itself, or
    for a merged multi-node run each node's folder with the offset that puts its clock on the
    reference node's."""
    if not manifest.get("nodes"):
        return [(run_dir, None, 0)]
    offsets = read_clock(run_dir)
    return [  # a node name that is not a plain folder name (`../x`) names no part of this run
        (os.path.join(run_dir, NODES_DIR, node), node, offsets.get(node, 0))
        for node in manifest["nodes"]
        if isinstance(node, str) and safe_label(node) == node
    ]


TIME_FIELDS = ("t", "start", "end")


def shift_events(events: list[dict[str, Any]], node: str, offset_ns: int) -> list[dict[str, Any]]:
    """The one place a node's timestamps move onto the reference clock: every time field of
    every event gets offset_ns; the event is tagged with its node."""
    for event in events:
        for key in TIME_FIELDS:
            value = event.get(key)
            if isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float):
                event[key] = value + offset_ns
        event["node"] = node
    return events


def rename_labels(per_node: Iterable[tuple[Any, Mapping[Any, str]]]) -> dict[tuple[Any, Any], str]:
    """{(node, pid): label} from each node's [(node, {pid: label})] in the merged manifest's
    node order. Rank labels are the job's global ranks, so they do not repeat across nodes;
    when they do (two single-node jobs, ranks of unknown rank), the first node keeps the plain
    label and the others get '<label>@<node>'."""
    labels: dict[tuple[Any, Any], str] = {}
    taken: set[str] = set()
    for node, node_labels in per_node:
        rename: dict[str, str] = {}
        for label in sorted(set(node_labels.values()), key=lambda r: (len(r), r)):
            rename[label] = safe_label(label if label not in taken else f"{label}@{node}")
        taken.update(rename.values())
        labels.update({(node, pid): rename[label] for pid, label in node_labels.items()})
    return labels


def combine(
    loaded: list[tuple[str, int, tuple[list[dict[str, Any]], list[dict[str, Any]], Mapping[Any, str]]]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[tuple[Any, Any], str]]:
    """One run's (rows, process table, labels) from its nodes' [(node, offset_ns, (rows, table,
    {pid: label}))]: rows moved onto the reference clock and relabelled (`rename_labels`);
    processes are (node, pid): a pid may repeat on another host."""
    labels = rename_labels([(node, node_labels) for node, _, (_, _, node_labels) in loaded])
    rows, table = [], []
    for node, offset, (node_rows, node_table, node_labels) in loaded:
        for event in shift_events(node_rows, node, offset):
            if event.get("rank") is not None:
                event["rank"] = _renamed(labels, node, node_labels, event["rank"])
            rows.append(event)
        for proc in node_table:
            proc = dict(proc, node=node)
            if proc.get("label") is not None:
                proc["label"] = labels.get((node, proc["pid"]), proc["label"])
            table.append(proc)
    return rows, table, labels


def _renamed(
    labels: Mapping[tuple[Any, Any], str], node: str, node_labels: Mapping[Any, str], label: str
) -> str:
    for pid, old in node_labels.items():
        if old == label:
            return labels[(node, pid)]
    return label


def load_traces(run_dir: str, manifest: Mapping[str, Any]) -> tuple[Any, dict[str, str]]:
    """torchtrace.load_traces of the run, or of every node of a merged run with the node's
    offset added to start_ns/end_ns (trace files are named by global rank)."""
    tables, errors = [], {}
    for folder, node, offset in parts(run_dir, manifest):
        table, errs = load_folder(folder)
        errors.update(errs)
        if node is not None and len(table):
            table = table.copy()
            for col in ("start_ns", "end_ns"):
                table[col] = table[col] + offset
        tables.append(table)
    tables = [t for t in tables if len(t)] or tables[:1]
    return (tables[0] if len(tables) == 1 else pd.concat(tables, ignore_index=True)), errors


# -- merging the node parts (diagnose merge) ---------------------------------------------------------
def read_manifest(folder: str) -> dict[str, Any]:
    """A node's manifest, read as untrusted input (profiler/manifest.read_manifest: its fields
    checked); one that is not a manifest is a UserError."""
    path = os.path.join(folder, "manifest.json")
    manifest, problem = manifest_file.read_manifest(path, stacklevel=3)
    if manifest is None:
        raise UserError(f"{path}: {problem}")
    return manifest


def write_json(path: str, data: Any) -> None:
    atomic.write_json(path, data, indent=2, default=str)


def clock_line(per_node: Mapping[str, Any], reference: str) -> str:
    """One line for the report's host table: each node's offset and bound."""
    out = []
    for n, e in per_node.items():
        if n == reference:
            continue
        err = "unaligned" if e["error_ns"] is None else f"± {e['error_ns'] / 1e6:.3f} ms"
        out.append(f"{n} {e['offset_ns'] / 1e9:+.6f} s {err}")
    return "; ".join(out) + f" (reference {reference}; clock.json)"


def merged_manifest(
    node_manifests: Mapping[str, dict[str, Any]],
    offsets: Mapping[str, int],
    labels: Mapping[tuple[Any, Any], str],
    clock_summary: Mapping[str, Any],
    per_node_clock: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One manifest over the nodes (the reference node's command, options and packages)."""
    reference = clock_summary.get("reference") or next(iter(node_manifests))
    base = dict(node_manifests[reference])

    def shifted(m: Mapping[str, Any], key: str, node: str) -> int | None:
        value = m.get(key)
        return value + offsets.get(node, 0) if isinstance(value, int) else None

    starts, ends, gpus, missing, per_node = [], [], [], {}, {}
    codes = []
    for n, m in node_manifests.items():
        starts.append(shifted(m, "start_ns", n))
        ends.append(shifted(m, "end_ns", n))
        for g in m.get("gpus") or []:  # run_index: the GPU's index in the merged nvml.csv
            g = dict(g) if isinstance(g, dict) else {"gpu": g}
            gpus.append(dict(g, node=n, run_index=len(gpus)))
        for key, why in (m.get("missing") or {}).items():
            missing[f"{key}@{n}"] = why
        codes.append(m.get("exit_code"))
        per_node[n] = {
            "host": m.get("host"),
            "node": m.get("node"),
            "start_ns": m.get("start_ns"),
            "end_ns": m.get("end_ns"),
            "exit_code": m.get("exit_code"),
            "status": m.get("status"),
            "command": m.get("command"),
            "ranks": m.get("ranks"),
            "nvml": m.get("nvml"),
        }
    hosts = sorted({(m.get("host") or {}).get("hostname") or "?" for m in node_manifests.values()})
    failed = [c for c in codes if c not in (0, None)]
    base.update(
        {
            "nodes": list(node_manifests),
            "node_manifests": per_node,
            "host": dict(
                base.get("host") or {},
                hostname=", ".join(hosts),
                nodes=len(node_manifests),
                clock_offsets=clock_line(per_node_clock or {}, reference),
            ),
            "start_ns": min((s for s in starts if s is not None), default=None),
            "end_ns": max((e for e in ends if e is not None), default=None),
            "exit_code": failed[0] if failed else (0 if all(c == 0 for c in codes) else None),
            "status": "merged",
            "gpus": gpus,
            "missing": missing,
            "ranks": {
                label: pid
                for (node, pid), label in sorted(labels.items(), key=lambda kv: kv[1])
                if _is_rank(label)
            },
            "rank_nodes": {label: node for (node, pid), label in labels.items() if _is_rank(label)},
            "clock": {
                "file": "clock.json",
                "reference": reference,
                "consistent": clock_summary.get("consistent"),
            },
        }
    )
    base.pop("node", None)
    base.pop("nvml", None)
    return base


def _is_rank(label: str | None) -> bool:
    return label is not None


def _regular(path: str) -> bool:
    """A plain file of a node's part: a link there (to a file of whoever merges) is not read."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def merge_nvml(parts: list[Part], out_path: str, gpu_base: Mapping[str, int]) -> bool:
    """Every node's nvml.csv on the reference clock; GPU indices made run-wide (the merged
    manifest's gpus list), the node kept in its own column."""
    frames = []
    for folder, node, offset in parts:
        path = os.path.join(folder, "nvml.csv")
        if not _regular(path) or os.path.getsize(path) == 0:
            continue
        try:
            df = pd.read_csv(path, on_bad_lines="skip")
        except (ValueError, pd.errors.EmptyDataError):
            continue
        if "t" not in df or not len(df):
            continue
        df["t"] = pd.to_numeric(df["t"], errors="coerce")
        df = df.dropna(subset=["t"])
        df["t"] = df["t"].astype("int64") + offset
        if "gpu" in df:
            df["gpu"] = pd.to_numeric(df["gpu"], errors="coerce") + gpu_base.get(node, 0)
        df["node"] = node
        frames.append(df)
    if not frames:
        return False
    merged = pd.concat(frames, ignore_index=True).sort_values("t", kind="stable")
    atomic.replace_with(out_path, lambda tmp: merged.to_csv(tmp, index=False))
    return True


def merge_log(parts: list[Part], out_path: str) -> None:
    lines = []
    for folder, node, offset in parts:
        path = os.path.join(folder, "log.txt")
        if not _regular(path):
            continue
        try:  # untrusted input: no link, FIFO or device
            text = untrusted.read_text(path)
        except OSError as exc:
            warnings.warn(f"{path}: not read ({exc.strerror}); its log lines left out", stacklevel=2)
            continue
        for line in text.split("\n"):
            if line:
                t, _, rest = line.partition(" ")
                if t.isdigit():
                    lines.append((int(t) + offset, rest))
    lines.sort(key=lambda x: x[0])
    atomic.write_lines(out_path, (f"{t_ns} {rest}\n" for t_ns, rest in lines))


def merge_pyspy(parts: list[Part], labels: Mapping[tuple[Any, Any], str], out_dir: str) -> None:
    """py-spy files of each node's ranks, named by the rank (pids may repeat across nodes);
    recordings are hard-linked or copied (no timestamps inside), dump snapshots rewritten on the reference
    clock. Every name is a safe label and every write stays in out_dir, through no link."""
    atomic.refuse_links(out_dir)  # a planted pyspy -> elsewhere is neither emptied nor written into
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    for folder, node, offset in parts:
        src = os.path.join(folder, "pyspy")
        try:
            names = sorted(os.listdir(src))
        except OSError:
            continue
        for name in names:
            stem, dot, ext = name.partition(".")
            who, _, flavour = stem.rpartition("-")
            pid = parse_process_file(who, "")
            label: str | None = labels.get((node, pid)) if pid is not None else who
            if label is None or not flavour or not _regular(os.path.join(src, name)):
                continue
            target = os.path.join(out_dir, safe_label(f"{label}-{flavour}{dot}{ext}"))
            if name.endswith("-dump.jsonl"):
                with io.TextIOWrapper(untrusted.open_file(os.path.join(src, name)), "utf-8", "replace") as f:
                    atomic.write_lines(target, _shifted_snapshots(f, node, offset), root=out_dir)
            else:
                atomic.replace_with(
                    target, functools.partial(_link_or_copy, os.path.join(src, name)), root=out_dir
                )


def _link_or_copy(src: str, tmp: str) -> None:
    os.remove(tmp)  # the writer's own empty file: a hard link takes its name (no second copy)
    try:
        os.link(src, tmp, follow_symlinks=False)
    except OSError:
        shutil.copyfile(src, tmp, follow_symlinks=False)


def _shifted_snapshots(lines: Iterable[str], node: Any, offset: int) -> Iterable[str]:
    for line in lines:
        try:
            snap = json.loads(line)
            snap["t"] = int(snap["t"]) + offset
            snap["node"] = node
            yield json.dumps(snap) + "\n"
        except (ValueError, KeyError, TypeError):
            continue  # a cut-off line: the node's own file keeps it


def unfinished_nodes(run_dir: str) -> list[str]:
    """Nodes whose part still says `running` (still running, or killed)."""
    return [
        n
        for n, d in node_dirs(os.path.abspath(run_dir)).items()
        if read_manifest(d).get("status") == "running"
    ]


def format_clock(clock: dict[str, Any]) -> str:
    lines = [
        f"clock reference: {clock['reference']} ({clock['usable_collectives']} matched collectives usable)"
    ]
    for n, e in clock["nodes"].items():
        err = "unknown" if e["error_ns"] is None else f"± {e['error_ns'] / 1e6:.3f} ms"
        lines.append(
            f"  {n}: host {e.get('host')}, ranks {','.join(e.get('ranks') or []) or '-'}, "
            f"offset {e['offset_ns'] / 1e9:+.6f} s {err}, {e['constraints']} constraints"
            + ("" if e["method"] == METHOD else f" ({e['method']})")
        )
    if not clock["consistent"]:
        lines.append("  INCONSISTENT: " + "; ".join(clock["conflicts"]))
    return "\n".join(lines)
