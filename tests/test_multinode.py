"""Multi-node runs on one machine: two "nodes" (two launchers, each under its own `diagnose`)
write their parts of one run folder; `diagnose merge` aligns their clocks from the job's own
collectives and gives one run over all ranks.

The shifted clock is real: the second node's diagnose, its torchrun agent and its rank run
under libfaketime (LD_PRELOAD, a fixed offset of the wall clock; the monotonic clock is left
alone, as on a host whose NTP is off). torch's c10d rendezvous compares wall-clock heartbeats
between agents (a node more than keep_alive_interval x keep_alive_max_attempt = 15 s off is
taken for dead), so the shift stays below that.
"""

import gzip
import hashlib
import importlib.util
import json
import os
import socket
import subprocess

import pytest
from helpers import PY, ROOT, diagnose

import traindx
from traindx.common.errors import UserError
from traindx.profiler import clocks, nodes

JOB = os.path.join(ROOT, "tests", "jobs", "ddp_train.py")
BIN = os.path.dirname(PY)
SHIFT_S = -6.5  # the second node's clock reads 6.5 s behind
STEPS = 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def faketime_library():
    spec = importlib.util.find_spec("libfaketime")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(
        list(spec.submodule_search_locations)[0], "vendor", "libfaketime", "src", "libfaketime.so.1"
    )
    return path if os.path.exists(path) else None


def start_diagnose(args, cwd, env):
    full = dict(os.environ)
    full.pop("TRAINDX_RUN_DIR", None)
    full.update({"OMP_NUM_THREADS": "1", **env})
    return subprocess.Popen(
        [PY, "-m", "traindx", *args],
        cwd=cwd,
        env=full,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(procs, timeout=240):
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    return outs


def digest(folder):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            if name.endswith((".jsonl", ".csv", ".txt")) and "events" in root or name == "log.txt":
                with open(os.path.join(root, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()


@pytest.mark.slow
def test_two_torchrun_agents_with_c10d_and_a_shifted_clock_merge_into_one_run(tmp_path):
    library = faketime_library()
    if library is None:
        pytest.skip("libfaketime (the dev extra) is not installed: no way to shift a clock")
    port = free_port()

    def node(rank, env):
        return start_diagnose(
            [
                "--run-dir",
                "RUN",
                "--quiet",
                "--",
                os.path.join(BIN, "torchrun"),
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "mn",
                "--node-rank",
                str(rank),
                JOB,
                "--steps",
                str(STEPS),
                "--io-wait",
                "0.1",
                "--uneven",
                "0.05",
                "--reduce-loss",
            ],
            tmp_path,
            env,
        )

    shifted = {"LD_PRELOAD": library, "FAKETIME": f"{SHIFT_S:+}", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    outs = finish([node(0, {}), node(1, shifted)])
    run_dir = tmp_path / "RUN"
    parts = nodes.node_dirs(run_dir)
    assert len(parts) == 2, os.listdir(run_dir / "nodes")
    plain, late = sorted(parts)  # <host>-n0, <host>-n1 (the shifted one)
    assert plain.endswith("-n0") and late.endswith("-n1")
    assert "diagnose merge" in outs[0][1]
    for d in parts.values():  # each node turned its events into tables as its job ended
        assert os.path.exists(os.path.join(d, "tables", "events", "index.json"))
    with pytest.raises(UserError, match="diagnose merge"):
        traindx.load_run(run_dir)

    # each node alone: one rank each, and their step ends are SHIFT_S apart (the shift is real)
    alone = {n: traindx.load_run(d) for n, d in parts.items()}
    assert [len(r.ranks) for r in alone.values()] == [1, 1]
    assert alone[late].manifest["node"]["source"] == "torchrun --node-rank"
    raw_gap = (alone[late].steps["end_ns"].to_numpy() - alone[plain].steps["end_ns"].to_numpy()) / 1e9
    assert abs(raw_gap.mean() - SHIFT_S) < 0.5, raw_gap

    before = {n: digest(d) for n, d in parts.items()}
    proc = diagnose(["merge", "RUN"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert before == {n: digest(d) for n, d in parts.items()}  # raw evidence untouched
    with open(run_dir / "clock.json") as f:
        clock = json.load(f)
    assert clock["consistent"], clock["conflicts"]
    ref = clock["reference"]
    est = clock["nodes"][late]["offset_ns"] - clock["nodes"][plain]["offset_ns"]
    err = clock["nodes"][late]["error_ns"] + clock["nodes"][plain]["error_ns"]
    true = -SHIFT_S * 1e9  # the late node's timestamps need +6.5 s
    # honest: the true shift lies inside the stated bound; useful: the bound is far below it
    assert abs(est - true) <= err, (est, err, clock)
    assert err < 0.5e9, clock
    assert clock["nodes"][ref]["error_ns"] == 0 and clock["nodes"][late]["constraints"] >= STEPS
    assert f"offset {clock['nodes'][late]['offset_ns'] / 1e9:+.6f} s" in proc.stdout

    run = traindx.load_run(run_dir)
    assert len(run.tables._node_tables) == 2  # read from the nodes' tables, offsets applied
    assert run.ranks == ["0", "1"]
    assert sorted(run.manifest["nodes"]) == sorted(parts)
    assert set(run.manifest["rank_nodes"].values()) == set(parts)
    assert run.steps.groupby("rank").size().to_dict() == {"0": STEPS, "1": STEPS}
    ends = run.steps.pivot(index="step", columns="rank", values="end_ns")
    gap = (ends["0"] - ends["1"]).abs().max() / 1e9
    assert gap < 0.5, ends  # DDP steps end together once the clocks agree (6.5 s apart raw)
    assert set(run.processes["node"].dropna()) == set(parts)
    starts = run.events[run.events["type"] == "process_start"]
    assert set(starts["node"]) == set(parts)
    for rank, node_name in run.manifest["rank_nodes"].items():
        if f"pyspy@{node_name}" not in run.missing:
            assert (rank, "all") in run.pyspy, sorted(run.pyspy)
    assert set(run.log_steps["step"]) >= set(range(1, STEPS + 1))
    assert (run_dir / "report.html").exists()
    again = diagnose(["report", "RUN", "--reanalyze", "--quiet"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.slow
def test_srun_style_nodes_share_the_job_id_folder(tmp_path):
    """srun starts one diagnose per node with SLURM_* set (no real Slurm here); the job sets
    RANK itself. Without --run-dir both land in runs/slurm-<job id>/nodes/<host>-n<node id>."""
    port = free_port()

    def node(i):
        env = {
            "SLURM_JOB_ID": "4711",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NODEID": str(i),
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        return start_diagnose(
            [
                "--quiet",
                "--no-pyspy",
                "--",
                PY,
                JOB,
                "--steps",
                "4",
                "--io-wait",
                "0.05",
                "--uneven",
                "0.03",
                "--reduce-loss",
            ],
            tmp_path,
            env,
        )

    finish([node(0), node(1)])
    run_dir = tmp_path / "runs" / "slurm-4711"
    names = sorted(nodes.node_dirs(run_dir))
    assert [n[-3:] for n in names] == ["-n0", "-n1"], names
    proc = diagnose(["merge", str(run_dir), "--no-report"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = traindx.load_run(run_dir)
    assert run.ranks == ["0", "1"]
    assert run.manifest["rank_nodes"] == {"0": names[0], "1": names[1]}
    with open(run_dir / "clock.json") as f:
        clock = json.load(f)
    # same host, same clock: the estimate must say ~0 within its own bound
    other = [n for n in names if n != clock["reference"]][0]
    e = clock["nodes"][other]
    assert abs(e["offset_ns"]) <= e["error_ns"] < 0.5e9, clock


def test_merge_of_a_folder_without_nodes_is_one_clear_line(tmp_path):
    proc = diagnose(["merge", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not a multi-node run" in proc.stderr


# -- the clock solver on its own ------------------------------------------------------------------
def span(group, seq, start, end, op="all_reduce", backend="gloo"):
    return {
        "type": "span",
        "cat": "collective",
        "group": group,
        "seq": seq,
        "op": op,
        "backend": backend,
        "start": start,
        "t": end,
    }


def test_three_nodes_chained_through_the_middle_recover_offsets_within_bounds():
    """A-B share group g1, B-C share g2 (A and C never meet): C is bounded through B. Each
    collective: true entries, the last entry + 1 ms = every exit; clocks read true - skew."""
    skew = {"A": 0, "B": 2_000_000_000, "C": -3_500_000_000}
    events = {n: [] for n in skew}
    for seq in range(20):
        for group, pair in (("g1", ("A", "B")), ("g2", ("B", "C"))):
            base = 10**12 + seq * 10**8 + (0 if group == "g1" else 5 * 10**7)
            entries = {pair[0]: base + (seq % 2) * 3_000_000, pair[1]: base + (1 - seq % 2) * 3_000_000}
            leave = max(entries.values()) + 1_000_000
            for n, t in entries.items():
                events[n].append(span(group, seq, t - skew[n], leave - skew[n] + 200_000))
    per_node, summary = clocks.align({n: [("r", ev)] for n, ev in events.items()})
    assert summary["consistent"]
    ref = summary["reference"]
    for n in skew:
        true = skew[n] - skew[ref]  # add to n's timestamps to read ref's clock
        e = per_node[n]
        assert e["error_ns"] is not None and abs(e["offset_ns"] - true) <= e["error_ns"], (n, e)
        assert e["error_ns"] <= 3_000_000


def test_enqueue_only_nccl_collectives_are_not_evidence_but_barriers_are():
    a = [
        span("0", 0, 100, 110, backend="nccl"),
        span("0", 1, 200, 900, op="barrier", backend="nccl"),
        span("0", 2, 300, 310, op="broadcast", backend="gloo"),
    ]
    usable = clocks.collective_spans(a, "A", "r")
    assert [s[0][2] for s in usable] == ["barrier"]


def test_contradicting_collectives_are_reported_not_hidden():
    # B leaves collective 0 before A enters it and A leaves collective 1 before B enters it,
    # under any single offset: the evidence contradicts itself
    ev = {
        "A": [span("0", 0, 1000, 1100), span("0", 1, 2000, 2010)],
        "B": [span("0", 0, 0, 10), span("0", 1, 5000, 5100)],
    }
    per_node, summary = clocks.align({n: [("r", e)] for n, e in ev.items()})
    assert not summary["consistent"] and summary["conflicts"]
    other = [n for n in per_node if n != summary["reference"]][0]
    assert "inconsistent" in per_node[other].get("note", "") or not summary["consistent"]


@pytest.mark.parametrize(
    "command,env,expected",
    [
        (["torchrun", "--nnodes=2", "--node_rank=1", "t.py"], {}, ("h-n1", "torchrun --node-rank")),
        (
            ["python", "-m", "torch.distributed.run", "--nnodes", "1:4", "t.py"],
            {},
            ("h", "torchrun --nnodes"),
        ),
        (["torchrun", "--nnodes", "1", "t.py"], {}, None),
        (["torchrun", "t.py"], {"PET_NNODES": "2", "PET_NODE_RANK": "3"}, ("h-n3", "torchrun --node-rank")),
        (
            ["accelerate", "launch", "--num_machines", "2", "--machine_rank", "1", "t.py"],
            {},
            ("h-n1", "accelerate --machine_rank"),
        ),
        (
            ["python", "t.py"],
            {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"},
            ("h-n2", "SLURM_NODEID"),
        ),
        (
            ["python", "t.py"],
            {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "16", "SLURM_PROCID": "9"},
            ("h-n1-t9", "SLURM_NODEID"),
        ),
        (["python", "t.py"], {"SLURM_NNODES": "1", "SLURM_NODEID": "0"}, None),
    ],
)
def test_node_identity_from_the_launch(command, env, expected):
    assert nodes.node_identity(command, env, hostname="h.cluster") == expected


def test_two_agents_claiming_one_name_get_separate_folders(tmp_path):
    a = nodes.claim_node_dir(str(tmp_path), "h")
    b = nodes.claim_node_dir(str(tmp_path), "h")
    assert a != b and os.path.basename(b) == "h-2"


def write_node(root, name, shift_ns, arrivals, pid=4242, rank="0"):
    """A node's run folder in the documented run-record format: one rank process (the same pid
    on both nodes, as on two hosts), its steps and barrier spans on a clock shift_ns off the
    true time, two GPUs in the inventory, NVML samples of GPU 0, a py-spy dump."""
    folder = root / "nodes" / name
    (folder / "events").mkdir(parents=True)
    (folder / "pyspy").mkdir()
    base = 1_800_000_000 * 10**9
    local = lambda t: t - shift_ns
    events = [
        {
            "type": "process_start",
            "t": local(base),
            "pid": pid,
            "ppid": 1,
            "rank": rank,
            "argv": ["train.py"],
        },
        {"type": "training", "t": local(base + 1), "evidence": "init_process_group", "rank": rank},
    ]
    for step, late in enumerate(arrivals):
        t0 = base + (step + 1) * 10**9
        enter = t0 + (50_000_000 if late else 0)
        leave = t0 + 51_000_000  # everyone leaves just after the last one entered
        events += [
            {"type": "step_begin", "t": local(t0 - 400_000_000), "step": step},
            {
                "type": "span",
                "cat": "collective",
                "op": "barrier",
                "group": "0",
                "seq": step,
                "backend": "nccl",
                "start": local(enter),
                "t": local(leave),
            },
            {"type": "step_end", "t": local(leave + 1000), "step": step},
        ]
    with open(folder / "events" / f"p{pid}.jsonl", "w") as f:
        f.write("\n".join(json.dumps(e) for e in events) + "\n")
    manifest = {
        "traindx_run": 1,
        "command": ["torchrun", "train.py"],
        "start_ns": local(base),
        "end_ns": local(base + 10 * 10**9),
        "exit_code": 0,
        "host": {"hostname": name},
        "gpus": [{"index": 0, "name": "H200"}, {"index": 1, "name": "H200"}],
        "ranks": {rank: pid},
        "missing": {},
        "status": "finished",
        "options": {},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "nvml.csv").write_text(
        "t,gpu,util\n" + "".join(f"{local(base + i * 10**9)},0,{50 + i}\n" for i in range(3))
    )
    (folder / "pyspy" / f"p{pid}-dump.jsonl").write_text(
        json.dumps(
            {
                "t": local(base + 2 * 10**9),
                "pid": pid,
                "threads": [
                    {
                        "thread_name": "MainThread",
                        "thread_id": 1,
                        "active": True,
                        "owns_gil": True,
                        "frames": [],
                    }
                ],
            }
        )
        + "\n"
    )
    (folder / "trace").mkdir()
    with gzip.open(folder / "trace" / f"{rank}.json.gz", "wt") as f:  # a Kineto window
        json.dump(
            {
                "baseTimeNanoseconds": local(base),
                "traceEvents": [
                    {
                        "ph": "X",
                        "cat": "kernel",
                        "name": "gemm",
                        "ts": 3_000_000.0,
                        "dur": 500.0,
                        "pid": 0,
                        "tid": 7,
                    }
                ],
            },
            f,
        )
    return folder


def test_merge_of_two_hosts_with_the_same_pid_and_gpu_ids(tmp_path):
    arrivals = [True, False, True, False]
    write_node(tmp_path, "alpha", 0, arrivals, rank="0")
    write_node(tmp_path, "beta", 100 * 10**9, [not a for a in arrivals], rank="1")
    proc = diagnose(["merge", str(tmp_path), "--no-report"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = traindx.load_run(tmp_path)
    clock = json.loads((tmp_path / "clock.json").read_text())
    ref = clock["reference"]
    other = "beta" if ref == "alpha" else "alpha"
    true = (100 if other == "beta" else -100) * 10**9
    assert abs(clock["nodes"][other]["offset_ns"] - true) <= clock["nodes"][other]["error_ns"] <= 10**6
    assert run.ranks == ["0", "1"]
    procs = run.processes.sort_values("node")
    assert list(procs["pid"]) == [4242, 4242] and list(procs["node"]) == ["alpha", "beta"]
    assert list(procs["label"]) == ["0", "1"]
    ends = run.steps.pivot(index="step", columns="rank", values="end_ns")
    assert (ends["0"] - ends["1"]).abs().max() < 10**6
    # GPU 0 of each host becomes a run-wide index (0 and 2); its samples are on one clock
    assert sorted(run.gpu["gpu"].unique()) == [0, 2]
    by_gpu = run.gpu.groupby("gpu")["t"].min()
    assert abs(by_gpu[0] - by_gpu[2]) < 10**6
    assert [g["run_index"] for g in run.manifest["gpus"]] == [0, 1, 2, 3]
    assert set(run.dumps["rank"]) == {"0", "1"}
    assert run.dumps["t"].max() - run.dumps["t"].min() < 10**6
    kernels = run.torch_trace
    assert sorted(kernels["rank"]) == ["0", "1"]
    assert kernels["start_ns"].max() - kernels["start_ns"].min() < 10**6


def test_merged_run_reads_each_nodes_own_tables_and_reparses_a_stale_one(tmp_path):
    """What each node's diagnose writes at its job's end (record.write_tables) is what the
    merged run's loader reads: the same tables as parsing every node's JSONL, with each node's
    clock offset applied at load (the tables hold the node's own clock); a node whose raw files
    changed since is parsed again, the others still come from their tables."""
    import sys

    import pandas as pd

    from traindx.cli.commands.merge import merge
    from traindx.derive.run import write_tables

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import synth_run

    run_dir = str(tmp_path / "RUN")
    folders = synth_run.write_multinode(run_dir, nodes=3, per_node=2, steps=20, seed=4)
    clock, _ = merge(run_dir)
    offsets = {n: e["offset_ns"] for n, e in clock["nodes"].items()}
    assert len(set(offsets.values())) == 3  # three different clocks: every offset matters
    raw = traindx.load_run(run_dir, cache=False)
    assert raw.tables._node_tables == []
    for folder in folders:
        assert write_tables(folder) is None
    run = traindx.load_run(run_dir)
    assert len(run.tables._node_tables) == 3  # every node from its tables, nothing parsed
    assert not os.path.exists(os.path.join(run_dir, "tables"))  # and no run-wide copy of them
    assert run.tables.types == raw.tables.types
    for typ in raw.tables.types:
        pd.testing.assert_frame_equal(raw.tables.frame(typ), run.tables.frame(typ), obj=typ)
    pd.testing.assert_frame_equal(raw.processes, run.processes)
    pd.testing.assert_frame_equal(raw.ledger, run.ledger)
    assert run.labels == raw.labels and run.ranks == [str(r) for r in range(6)]
    assert run.tables.t_min() == raw.tables.t_min()
    # the node's tables keep its own clock: rank 2 (node-001) as recorded there, then shifted
    node1 = traindx.load_run(folders[1])
    assert node1.tables._cached is not None
    here = run.steps[run.steps["rank"] == "2"]["end_ns"].to_numpy()
    there = node1.steps[node1.steps["rank"] == "2"]["end_ns"].to_numpy()
    assert list(here - there) == [offsets["node-001"]] * 20

    # node-002 grows after writing its tables: its tables are stale, its JSONL is read again
    late = os.path.join(folders[2], "events", "p10001.jsonl")
    with open(late, "a") as f:
        f.write(json.dumps({"type": "stop_requested", "t": synth_run.T0 + 10**12}) + "\n")
    grown = traindx.load_run(run_dir)
    assert [base for base, _ in grown.tables._node_tables] == [0, 2]  # nodes 000 and 001
    reparsed = traindx.load_run(run_dir, cache=False)
    for typ in reparsed.tables.types:
        pd.testing.assert_frame_equal(reparsed.tables.frame(typ), grown.tables.frame(typ), obj=typ)
    stop = grown.of_type("stop_requested")
    assert list(stop["rank"]) == ["5"] and list(stop["node"]) == ["node-002"]
    assert list(stop["t"]) == [synth_run.T0 + 10**12 + offsets["node-002"]]


def test_a_node_that_cannot_write_its_tables_warns_in_one_line_and_keeps_its_events(tmp_path, capsys):
    import sys

    from traindx.cli.commands.run import _write_node_tables

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import synth_run

    (folder,) = synth_run.write_multinode(str(tmp_path / "RUN"), nodes=1, per_node=2, steps=10)
    (tmp_path / "RUN" / "nodes" / "node-000" / "tables").write_text("a file in the way")
    before = digest(folder)
    _write_node_tables(folder)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "diagnose: warning: the node's event tables were not written (NotADirectoryError"
    ), err
    assert digest(folder) == before
    assert len(traindx.load_run(folder).steps) == 20
