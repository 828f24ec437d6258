"""Aligning the clocks of the nodes of one run from the job's own collectives, never by
assuming that the hosts' clocks agree.

Evidence: a collective that every rank of its group must enter before any rank can leave it
(a barrier; an all-reduce/all-gather/reduce-scatter/all-to-all whose call blocks the CPU until
the result is there). The shim records each blocking call as a span [start, end] on its own
host's clock, with its process group and a per-group sequence number that is the same on every
rank (no clock needed to match them). In true time, rank a (node A) and rank b (node B) of one
such collective satisfy start_a + off_A <= end_b + off_B and start_b + off_B <= end_a + off_A,
so d = off_B - off_A lies in [start_a - end_b, end_a - start_b]. Intersecting over every matched
collective gives an interval that is tight whenever each side was, at least once, the last to
arrive. Over more than two nodes the pairwise intervals are difference constraints; the
tightest bounds of each node against the reference node are shortest paths (Bellman-Ford), and
a negative cycle means the evidence contradicts itself (a clock that stepped or drifted during
the run, or an op that did not block as assumed): the run then says so.

Which calls block the CPU: barrier always (NCCL's barrier synchronises its stream) and
all_gather_object (it reads the gathered sizes and bytes back to the CPU); the other all-to-all
collectives only on backends whose blocking calls wait for the result (gloo, mpi). A blocking
NCCL all_reduce returns once it is enqueued, so its span says nothing about the other ranks.
Rooted ops (broadcast, reduce, gather, scatter) never count: the root or the leaves may leave
before the others arrive. A span that does not say its backend counts only if it always blocks.
"""

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

# (key (group, seq, op), node, process, start ns, end ns) of one collective
Span = tuple[tuple[str, int, Any], str, Any, int, int]
# {(node A, node B): [lo, hi, collectives]}: bounds on off_B - off_A
Bounds = dict[tuple[str, str], list[int]]

ALWAYS_SYNCHRONISING = frozenset({"barrier", "all_gather_object"})
SYNCHRONISING_ON_CPU_BACKENDS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
    }
)
CPU_BLOCKING_BACKENDS = frozenset({"gloo", "mpi"})
METHOD = "collective interval constraints (enter-before-leave), shortest paths to the reference"


def synchronising(op: Any, backend: Any) -> bool:
    if op in ALWAYS_SYNCHRONISING:
        return True
    return op in SYNCHRONISING_ON_CPU_BACKENDS and str(backend or "").lower() in CPU_BLOCKING_BACKENDS


def collective_spans(events: Iterable[dict[str, Any]], node: str, process: Any) -> list[Span]:
    """(key, node, process, start, end) of the usable collectives among one process's events;
    key = (group, seq, op)."""
    out = []
    for e in events:
        if e.get("type") != "span" or e.get("cat") != "collective" or e.get("seq") is None:
            continue
        if not synchronising(e.get("op"), e.get("backend")):
            continue
        start, end = e.get("start"), e.get("t")
        if isinstance(start, (int, float)) and isinstance(end, (int, float)) and end >= start:
            out.append(
                ((str(e.get("group")), int(e["seq"]), e.get("op")), node, process, int(start), int(end))
            )
    return out


def pairwise_bounds(spans: Iterable[Span]) -> Bounds:
    """{(A, B): [lo, hi, n]} bounds on off_B - off_A from matched collectives (A < B).

    A key seen twice in one process (a restarted rank counting again from 0) is ambiguous and
    dropped."""
    by_key: defaultdict[tuple[str, int, Any], list[tuple[str, Any, int, int]]] = defaultdict(list)
    for key, node, process, start, end in spans:
        by_key[key].append((node, process, start, end))
    bounds: Bounds = {}
    for entries in by_key.values():
        procs = [(n, p) for n, p, _, _ in entries]
        if len(set(procs)) != len(procs):
            continue
        per_node: dict[str, tuple[int, int]] = {}
        for node, _, start, end in entries:
            s, e = per_node.get(node, (start, end))
            # every rank's entry precedes every rank's exit: the latest entry and the earliest
            # exit of a node carry all of its information
            per_node[node] = (max(s, start), min(e, end))
        nodes = sorted(per_node)
        for i, a in enumerate(nodes):
            for b in nodes[i + 1 :]:
                (sa, ea), (sb, eb) = per_node[a], per_node[b]
                lo, hi = sa - eb, ea - sb
                cur = bounds.get((a, b))
                if cur is None:
                    bounds[(a, b)] = [lo, hi, 1]
                else:
                    cur[0], cur[1], cur[2] = max(cur[0], lo), min(cur[1], hi), cur[2] + 1
    return bounds


def _shortest(
    nodes: list[str], edges: dict[tuple[str, str], float], source: str
) -> tuple[dict[str, float], bool]:
    """Bellman-Ford distances from source over edges {(u, v): w}; (dist, negative_cycle)."""
    inf = float("inf")
    dist = dict.fromkeys(nodes, inf)
    dist[source] = 0.0
    for _ in range(len(nodes)):
        changed = False
        for (u, v), w in edges.items():
            if dist[u] + w < dist[v]:
                dist[v] = dist[u] + w
                changed = True
        if not changed:
            return dist, False
    return dist, True


def solve(
    nodes: Iterable[str], bounds: Bounds, reference: str | None = None
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Per node: offset_ns (add it to the node's timestamps to put them on the reference
    node's clock), error_ns (half the width of the interval the evidence allows: the true
    offset is within offset_ns ± error_ns), constraints (matched collectives with the
    reference, direct or through other nodes), method, and consistent / note."""
    ordered = sorted(nodes)
    if not ordered:
        return {}, None
    count: defaultdict[str, int] = defaultdict(int)
    for (a, b), (_, _, n) in bounds.items():
        count[a] += n
        count[b] += n
    reference = reference or max(ordered, key=lambda n: (count[n], -ordered.index(n)))
    # difference constraints: off_b - off_a <= hi (edge a->b, hi), off_a - off_b <= -lo (b->a)
    edges: dict[tuple[str, str], float] = {}
    conflicts = []
    for (a, b), (low, high, n) in bounds.items():
        if low > high:
            conflicts.append(
                f"{a}~{b}: the {n} collectives allow no common offset "
                f"(lower bound {low} ns > upper bound {high} ns)"
            )
        edges[(a, b)] = min(edges.get((a, b), float("inf")), high)
        edges[(b, a)] = min(edges.get((b, a), float("inf")), -low)
    upper, cycle_up = _shortest(ordered, edges, reference)  # off_X - off_ref <= upper[X]
    reverse = {(v, u): w for (u, v), w in edges.items()}
    lower_neg, cycle_lo = _shortest(ordered, reverse, reference)  # off_ref - off_X <= lower_neg[X]
    consistent = not conflicts and not cycle_up and not cycle_lo
    out = {}
    for node in ordered:
        hi, lo = upper[node], -lower_neg[node]
        n = sum(c for (a, b), (_, _, c) in bounds.items() if node in (a, b))
        entry: dict[str, Any] = {
            "offset_ns": 0,
            "error_ns": None,
            "constraints": n,
            "method": METHOD,
            "lower_ns": None,
            "upper_ns": None,
        }
        if node == reference:
            entry.update(offset_ns=0, error_ns=0, lower_ns=0, upper_ns=0, method="reference (its own clock)")
        elif hi == float("inf") or lo == float("-inf"):
            # one side of the interval is open: the node never arrived last (or first)
            entry.update(
                method="unaligned: no matched collective bounds this node's clock on "
                "both sides; its timestamps are used as recorded",
                lower_ns=None if lo == float("-inf") else int(lo),
                upper_ns=None if hi == float("inf") else int(hi),
            )
        else:
            # -offset is what node X's clock reads ahead of the reference: offsets are what
            # each node's timestamps need added, i.e. off_X - off_ref in the model above
            entry.update(
                offset_ns=int(round((lo + hi) / 2)),
                error_ns=int(round(abs(hi - lo) / 2)),
                lower_ns=int(lo),
                upper_ns=int(hi),
            )
            if lo > hi:
                entry["note"] = "inconsistent: the bounds cross; the error bound is not guaranteed"
        out[node] = entry
    result: dict[str, Any] = {"reference": reference, "consistent": consistent, "conflicts": conflicts}
    if not consistent and not conflicts:
        result["conflicts"] = [
            "the constraints through several nodes contradict each other "
            "(a negative cycle): a clock stepped or drifted during the run"
        ]
    return out, result


def align(
    node_events: Mapping[str, Iterable[tuple[Any, list[dict[str, Any]]]]], reference: str | None = None
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """node_events: {node: [(process id, [events])]} -> (per-node offsets, summary)."""
    spans = []
    for node, processes in node_events.items():
        for process, events in processes:
            spans.extend(collective_spans(events, node, process))
    bounds = pairwise_bounds(spans)
    nodes, summary = solve(list(node_events), bounds, reference=reference)
    summary = summary or {}
    summary["pairs"] = {
        f"{a}~{b}": {"lower_ns": lo, "upper_ns": hi, "collectives": n}
        for (a, b), (lo, hi, n) in sorted(bounds.items())
    }
    summary["usable_collectives"] = len({s[0] for s in spans})
    return nodes, summary
