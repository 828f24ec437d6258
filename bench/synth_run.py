"""Write a synthetic run folder in the documented run-record format (docs/run-record.md).

usage: python bench/synth_run.py OUT --ranks R --steps S [--seed N] [--no-nvml]

R ranks x S optimizer steps; every rank is one process writing events/p<pid>.jsonl as the shim
does (process_start with its rank, a `training` event, optimizer_created, step_begin/step_end,
the ledger's spans per step - data, backward, optimizer on the training thread - gc per
generation that ran, alloc per step, a few compile events in the first steps), rank 0's log.txt carries a per-step log line, and nvml.csv
samples one GPU per rank every 0.5 s. Injected so that analysis has something to find:
  - every PERIOD-th step is slow on every rank, and the job prints "saving checkpoint" in it;
  - one rank (SLOW_RANK = R // 2) is 25 % slower in every step and runs gen-2 collections.
Deterministic: the same arguments write byte-identical files (random.Random(seed)).
Event rates per rank and step are what a real single-GPU run writes (tests/data/h200-*):
~4 lines per step, 0.5-0.7 KB per step per rank, plus the three spans the shim writes per
step (~7.3 lines, ~1 KB per step per rank in all).
"""

import argparse
import json
import os
import random
import sys

T0 = 1_800_000_000_000_000_000  # ns, a fixed wall clock so the output is reproducible
STEP_S = 0.25  # a healthy step
PERIOD = 50  # the periodic slow step (a checkpoint)
PERIOD_EXTRA_S = 1.5
SLOW_RANK_FACTOR = 1.25
NVML_INTERVAL_S = 0.5
PID0 = 10_000  # rank r is process PID0 + r
MAIN_TID = 139969661382976


def _dump(obj):
    return json.dumps(obj, separators=(", ", ": "))


def _compile_event(rank, i, start, end, step):
    # the shape the shim writes for a CuTe-DSL compile (key/key_fields are nested objects)
    return {
        "kind": "cute_dsl" if i % 2 == 0 else "triton",
        "kernel": f"_flash_attn_fwd:FlashAttentionForwardSm90_{i}",
        "start": start,
        "t": end,
        "duration_s": (end - start) / 1e9,
        "step": step,
        "in_step": True,
        "thread": "MainThread",
        "thread_id": MAIN_TID,
        "is_main_thread": True,
        "ok": True,
        "caller": {"file": "/job/train.py", "line": 120 + i, "function": "forward"},
        "key": f"(BFloat16, 128, 128, {i}, True)",
        "key_fields": {"dtype": "BFloat16", "head_dim": "128", "block": str(i)},
        "key_types": {"dtype": "type", "head_dim": "int"},
        "type": "compile",
    }


def _start_lines(rng, pid, rank, world, steps, t, skew_ns, barrier):
    """A rank's process_start, and its first barrier where asked."""
    lines = [
        _dump(
            {
                "pid": pid,
                "ppid": PID0 - 1,
                "rank": str(rank),
                "rank_source": "RANK",
                "local_rank": str(rank % 8),
                "world_size": str(world),
                "argv": ["train.py", "--steps", str(steps)],
                "python": "3.12.3",
                "main_thread": MAIN_TID,
                "type": "process_start",
                "t": t,
            }
        )
    ]
    if barrier:  # entered within 2 ms of true T0 + 1.5 s, left once the last rank is there
        enter = T0 + skew_ns + 1_500_000_000 + rng.randint(0, 2_000_000)
        leave = T0 + skew_ns + 1_502_000_000 + rng.randint(10_000, 100_000)
        lines.append(
            _dump(
                {
                    "cat": "collective",
                    "op": "barrier",
                    "backend": "nccl",
                    "group": "0",
                    "seq": 0,
                    "start": enter,
                    "t": leave,
                    "tid": MAIN_TID,
                    "type": "span",
                }
            )
        )
    return lines


def _step_lines(lines, rng, rank, step, begin, slow_rank, allocated):
    """One step's events appended to lines: its boundaries, spans, compiles, gc and allocator
    counters. Returns the step's end and the allocated bytes after it."""
    lines.append(_dump({"step": step, "t": begin, "type": "step_begin"}))
    duration = STEP_S * rng.uniform(0.97, 1.03)
    if step == 0:
        duration += 8.0  # warm-up: imports, compiles, the allocator
    if step > 0 and step % PERIOD == 0:
        duration += PERIOD_EXTRA_S
    if rank == slow_rank:
        duration *= SLOW_RANK_FACTOR
    if step < 3:  # a few compiles in the first steps
        for i in range(2):
            c_end = begin + int((0.2 + 0.3 * i) * 1e9)
            lines.append(_dump(_compile_event(rank, step * 2 + i, c_end - 150_000_000, c_end, step)))
    end = begin + int(duration * 1e9)
    # the training thread's spans: the batch wait, backward (after an unhooked forward),
    # the optimizer step; what is left of the step is forward and the loop's own code
    d_end = begin + int(0.02 * (end - begin))
    b_start = begin + int(0.35 * (end - begin))
    b_end = begin + int(0.85 * (end - begin))
    o_end = begin + int(0.95 * (end - begin))
    for cat, s0, s1 in (
        ("data", begin + 10_000, d_end),
        ("backward", b_start, b_end),
        ("optimizer", b_end + 10_000, o_end),
    ):
        lines.append(_dump({"cat": cat, "start": s0, "t": s1, "tid": MAIN_TID, "type": "span"}))
    lines.append(
        _dump(
            {
                "step": step,
                "t": end,
                "source": "torch.optim",
                "duration_s": (end - begin) / 1e9,
                "type": "step_end",
            }
        )
    )
    gens = [0] + ([1] if step % 10 == 0 else []) + ([2] if rank == slow_rank and step % 7 == 3 else [])
    for g in gens:
        count = rng.randint(600, 900)
        total = (0.05 if g == 2 else 0.002) * rng.uniform(0.8, 1.2)
        lines.append(
            _dump(
                {
                    "step": step,
                    "generation": g,
                    "count": count,
                    "total_s": round(total, 9),
                    "max_s": round(total / 3, 9),
                    "collected": rng.randint(0, 30000),
                    "type": "gc",
                    "t": end + 1000,
                }
            )
        )
    allocated += rng.randint(-1_000_000, 1_000_000)
    lines.append(
        _dump(
            {
                "step": step,
                "num_alloc_retries": 0,
                "num_ooms": 0,
                "num_sync_all_streams": 0,
                "num_device_alloc": 102,
                "num_device_free": 0,
                "allocated_bytes_all_current": allocated,
                "allocated_bytes_all_peak": 16_087_230_464,
                "reserved_bytes_all_current": 16_477_323_264,
                "reserved_bytes_all_peak": 16_477_323_264,
                "inactive_split_bytes_all_current": 425_159_168,
                "type": "alloc",
                "t": end + 2000,
            }
        )
    )
    return end, allocated


def _log_lines(log_lines, end_times, steps):
    """Rank 0's log: a checkpoint line every PERIOD steps, a step line every step."""
    for step, begin, end in end_times:
        if step > 0 and step % PERIOD == 0:
            log_lines.append(f"{begin + 100_000_000} o saving checkpoint to ckpt/step_{step}.pt")
        log_lines.append(
            f"{end - 1000} o step {step} | loss {2.5 - step / (steps * 2):.4f} "
            f"| step time {(end - begin) / 1e9:.3f} s"
        )


def write_rank(out_dir, rank, world, steps, seed, slow_rank, log_lines, pid=None, skew_ns=0, barrier=False):
    """skew_ns: how far this host's clock reads ahead of true time (every timestamp has it).
    barrier: the process group's first barrier (torch.distributed: a blocking collective that
    every rank enters before any leaves), which `diagnose merge` aligns the node clocks with."""
    rng = random.Random(seed * 1_000_003 + rank)
    pid = PID0 + rank if pid is None else pid
    path = os.path.join(out_dir, "events", f"p{pid}.jsonl")
    t = T0 + skew_ns + rank * 1_000_000  # ranks start a millisecond apart
    lines = _start_lines(rng, pid, rank, world, steps, t, skew_ns, barrier)
    t += 2_000_000_000
    lines.append(_dump({"optimizer": "AdamW", "type": "optimizer_created", "t": t}))
    lines.append(_dump({"evidence": "optimizer", "rank": str(rank), "type": "training", "t": t + 1000}))
    allocated = 3_307_771_392
    end_times = []
    for step in range(steps):
        begin = t
        end, allocated = _step_lines(lines, rng, rank, step, begin, slow_rank, allocated)
        end_times.append((step, begin, end))
        t = end + 50_000
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    if rank == 0:
        _log_lines(log_lines, end_times, steps)
    return end_times[-1][2] if end_times else t


def write_run(out_dir, ranks, steps, seed=0, nvml=True, node=None):
    """node: (node index, nodes, ranks per node) writes one node's part of a multi-node run:
    its ranks (global numbers, pids 10000 + local rank as on separate hosts), its own clock
    (NODE_SKEW_NS) and the process group's first barrier."""
    os.makedirs(os.path.join(out_dir, "events"), exist_ok=True)
    world = ranks if node is None else node[1] * node[2]
    slow_rank = world // 2 if world > 1 else -1
    own = range(ranks) if node is None else range(node[0] * node[2], (node[0] + 1) * node[2])
    skew = 0 if node is None else node_skew_ns(node[0])
    log_lines = []
    last_end = T0 + skew
    for rank in own:
        last_end = max(
            last_end,
            write_rank(
                out_dir,
                rank,
                world,
                steps,
                seed,
                slow_rank,
                log_lines,
                pid=None if node is None else PID0 + rank - own[0],
                skew_ns=skew,
                barrier=node is not None,
            ),
        )
    with open(os.path.join(out_dir, "log.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(log_lines) + ("\n" if log_lines else ""))
    if nvml:
        _write_nvml(out_dir, seed, T0 + skew, last_end, min(ranks, 8))
    manifest = _manifest(ranks, steps, seed, nvml, node, skew, last_end, slow_rank, own)
    if node is not None:  # what diagnose's _record_node adds to a node's manifest
        manifest["node"] = {
            "name": os.path.basename(out_dir),
            "source": "--node",
            "run_dir": os.path.dirname(os.path.dirname(os.path.abspath(out_dir))),
        }
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    return out_dir


def _write_nvml(out_dir, seed, t, last_end, gpus):
    """nvml.csv from t to the last step's end: one node's GPUs (NVML sees the node, not the job)."""
    rng = random.Random(seed)
    with open(os.path.join(out_dir, "nvml.csv"), "w", encoding="utf-8") as f:
        f.write("t,gpu,util,mem_util,sm_clock_mhz,mem_used_bytes,power_w,clock_event_reasons\n")
        while t < last_end:
            for g in range(gpus):
                f.write(
                    f"{t},{g},{rng.randint(85, 100)},{rng.randint(30, 60)},1980,"
                    f"{60_000_000_000 + g},{rng.uniform(500, 700):.3f},0\n"
                )
            t += int(NVML_INTERVAL_S * 1e9)


def _manifest(ranks, steps, seed, nvml, node, skew, last_end, slow_rank, own):
    """The run's manifest.json, as the launcher writes it."""
    return {
        "traindx_run": 1,
        "command": ["python3", "train.py", "--steps", str(steps)],
        "cwd": "/job",
        "start_ns": T0 + skew - 1_000_000_000,
        "end_ns": last_end + 1_000_000_000,
        "exit_code": 0,
        "host": {
            "hostname": "synth" if node is None else f"synth{node[0]}",
            "platform": "Linux",
            "python": "3.12.3",
            "cpus": 2,
            "user": "bench",
        },
        "gpus": [
            {
                "index": g,
                "name": "NVIDIA H200",
                "uuid": f"GPU-{g:08x}-0000-0000-0000-000000000000",
                "memory_bytes": 150754820096,
            }
            for g in range(min(ranks, 8))
        ],
        "packages": {"torch": "2.11.0", "traindx": "0.1.0"},
        "env": {},
        "options": {
            "steps": None,
            "pyspy": False,
            "shim": True,
            "nvml": nvml,
            "torch_profile": None,
            "synthetic": {
                "ranks": ranks,
                "steps": steps,
                "seed": seed,
                "period": PERIOD,
                "slow_rank": str(slow_rank),
            },
        },
        "ranks": {str(r): PID0 + r - own[0] for r in own},
        "missing": {"pyspy": "synthetic run (bench/synth_run.py): no py-spy recordings"},
        "status": "finished",
        "signals_forwarded": [],
    }


def node_skew_ns(n):
    """Node n's clock reads up to ±1 s off true time (the reference is whichever node merge
    picks; the offsets it finds are these skews' differences, within its error bound)."""
    return ((n * 7919) % 2001 - 1000) * 1_000_000


def write_multinode(out_dir, nodes, per_node, steps, seed=0, nvml=True):
    """The node parts of a multi-node run, RUN/nodes/node-NNN/ as each node's diagnose writes
    them (not merged: `diagnose merge RUN` writes clock.json and the merged manifest)."""
    folders = []
    for n in range(nodes):
        folder = os.path.join(out_dir, "nodes", f"node-{n:03d}")
        write_run(folder, per_node, steps, seed, nvml=nvml, node=(n, nodes, per_node))
        folders.append(folder)
    return folders


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-nvml", action="store_true")
    a = p.parse_args(argv)
    if a.ranks < 1 or a.steps < 1:
        print("synth_run: --ranks and --steps must be >= 1", file=sys.stderr)
        return 2
    if os.path.exists(os.path.join(a.out, "manifest.json")):
        print(f"synth_run: {a.out} already holds a run", file=sys.stderr)
        return 2
    write_run(a.out, a.ranks, a.steps, a.seed, nvml=not a.no_nvml)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
