"""Synthetic op traces of a DP x PP (x TP) job under the 1F1B schedule, with a fault of choice.

An event-driven generator of its own (not traindx's replay): each stage runs its 1F1B program
in order; a receive is posted when the stage's previous compute ends and completes when the
peer's send is posted plus a latency; a data-parallel collective ends when its last DP rank
joined plus its transfer time; clipping joins every rank. Vectorised over steps and DP ranks.

Faults: slow_worker=(stage, dp, factor), slow_stage=(stage, factor), seq_cv (log-normal
micro-batch lengths, the same micro-batch as long on every stage: sequence-length imbalance),
slow_optype=(optype, probability, factor) (random instances of one type slow).

    make(dp=4, pp=4, mb=8, steps=10) -> DataFrame in the straggler study's trace columns
"""

from __future__ import annotations

import numpy as np
import pandas as pd

F, B = "forward-compute", "backward-compute"


def _program(stage: int, pp: int, mb: int, vpp: int = 1) -> list[tuple[str, int, int]]:
    """(compute, chunk, micro-batch) in the order the stage runs them: 1F1B, interleaved when
    vpp > 1 (Megatron's order: micro-batches in groups of pp, chunk by chunk)."""
    total = mb * vpp

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // pp) % vpp
        return (chunk if forward else vpp - 1 - chunk), (k // (pp * vpp)) * pp + k % pp

    warm = min((pp - stage - 1) * 2 + (vpp - 1) * pp if vpp > 1 else pp - stage - 1, total)
    prog = [(F, *unit(k, True)) for k in range(warm)]
    for j in range(total - warm):
        prog += [(F, *unit(warm + j, True)), (B, *unit(j, False))]
    prog += [(B, *unit(k, False)) for k in range(total - warm, total)]
    return prog


def make(
    dp: int = 4,
    pp: int = 4,
    mb: int = 8,
    steps: int = 10,
    tp: int = 1,
    seed: int = 0,
    fwd: float = 0.05,
    slow_worker: tuple[int, int, float] | None = None,
    slow_stage: tuple[int, float] | None = None,
    seq_cv: float = 0.0,
    slow_optype: tuple[str, float, float] | None = None,
    noise: float = 0.01,
    with_tp_column: bool = False,
    vpp: int = 1,
) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    shape = (steps, dp)
    lat, ag_t, rs_t = 0.0005, 0.01, 0.02
    lengths = (
        np.exp(rng.normal(0.0, seq_cv, (steps, dp, mb)) - seq_cv**2 / 2)
        if seq_cv > 0
        else np.ones((steps, dp, mb))
    )

    def dur(optype: str, stage: int, i: int) -> np.ndarray:
        base = (
            fwd
            if optype == F
            else 2 * fwd
            if optype == B
            else {"grads-reduce-scatter": rs_t}.get(optype, 0.0)
        )
        d = base * rng.lognormal(0.0, noise, shape)
        if optype in (F, B):
            d = d * (lengths[:, :, i] if optype == F else lengths[:, :, i] ** 1.2) / vpp
            if slow_stage is not None and slow_stage[0] == stage:
                d = d * slow_stage[1]
            if slow_worker is not None and slow_worker[0] == stage:
                d[:, slow_worker[1]] *= slow_worker[2]
        if slow_optype is not None and slow_optype[0] == optype:
            d = d * np.where(rng.random(shape) < slow_optype[1], slow_optype[2], 1.0)
        return d

    rows: list[tuple[int, str, int, int, np.ndarray, np.ndarray]] = []  # stage, optype, seq, mb, start, dur
    zero = np.zeros(shape)
    ag_end = zero + ag_t
    rows += [(s, "params-all-gather", 0, -1, zero.copy(), ag_end.copy()) for s in range(pp)]
    cur = _pipeline(rows, pp, vpp, mb, ag_end, dur, lat)
    _tail(rows, cur, pp, zero, dur)
    return _frame(rows, steps, dp, pp, tp, with_tp_column, rng)


def _pipeline(rows: list, pp: int, vpp: int, mb: int, ag_end: np.ndarray, dur, lat: float) -> list:
    """Run every stage's program; a compute waits for its input from the previous model chunk
    (forward) or the next one (backward). Every compute records a receive before it and a send
    after it; where the model has no peer (its first / last chunk) they are no-ops of no time,
    as Megatron's interleaved schedule records them; without interleaving the first and last
    stage record none."""
    n_chunks = pp * vpp
    end: dict[tuple[int, str, int, int], np.ndarray] = {}
    recv_start: dict[tuple[int, str, int, int], np.ndarray] = {}
    seq: dict[tuple[int, str], int] = {}

    def emit(stage: int, optype: str, mbi: int, start: np.ndarray, d: np.ndarray, chunk: int = -1) -> None:
        k = seq.get((stage, optype), 0)
        seq[(stage, optype)] = k + 1
        rows.append((stage, optype, k, mbi, start, d, chunk))

    cur = [ag_end.copy() for _ in range(pp)]
    progs = [_program(s, pp, mb, vpp) for s in range(pp)]
    ptr = [0] * pp
    while any(ptr[s] < len(progs[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while ptr[s] < len(progs[s]):
                optype, c, i = progs[s][ptr[s]]
                g = c * pp + s
                pg = g - 1 if optype == F else g + 1
                peer = (pg % pp, optype, pg // pp, i)
                has_peer = 0 <= pg < n_chunks
                if has_peer and peer not in end:
                    break
                start = cur[s]
                kind = "forward-recv" if optype == F else "backward-recv"
                if has_peer:
                    arrive = np.maximum(start, end[peer]) + lat
                    emit(s, kind, -1, start, arrive - start)
                    recv_start[(s, optype, c, i)] = start
                    start = arrive
                elif vpp > 1:
                    emit(s, kind, -1, start, start * 0)
                d = dur(optype, s, i)
                emit(s, optype, i, start, d, c)
                end[(s, optype, c, i)] = start + d
                cur[s] = start + d
                ptr[s] += 1
                moved = True
                if vpp > 1 and not 0 <= (g + 1 if optype == F else g - 1) < n_chunks:
                    emit(s, "forward-send" if optype == F else "backward-send", -1, cur[s], start * 0)
                elif 0 <= (g + 1 if optype == F else g - 1) < n_chunks:
                    rows.append(("send", s, optype, c, i))  # its end is known once the peer posts
        if not moved:
            raise RuntimeError("pipeline programs deadlocked")
    out = []
    for row in rows:
        if row[0] != "send":
            out.append(row)
            continue
        _, s, optype, c, i = row
        g = c * pp + s
        ng = g + 1 if optype == F else g - 1
        e = end[(s, optype, c, i)]
        group_end = np.maximum(e, recv_start[(ng % pp, optype, ng // pp, i)]) + lat
        kind = "forward-send" if optype == F else "backward-send"
        k = seq.get((s, kind), 0)
        seq[(s, kind)] = k + 1
        out.append((s, kind, k, -1, e, group_end - e, -1))
    rows[:] = out
    return cur


def _tail(rows: list, cur: list, pp: int, zero: np.ndarray, dur) -> None:
    """gc, layernorm, embedding (first & last stage), reduce-scatter (DP), clip (all), optimizer."""
    ln_t, emb_t, clip_t, opt_t = 0.0001, 0.004, 0.002, 0.01
    t = [cur[s].copy() for s in range(pp)]
    for s in range(pp):
        rows.append((s, "gc", 0, -1, t[s].copy(), zero.copy()))
        rows.append((s, "layernorm-grads-all-reduce", 0, -1, t[s].copy(), zero + ln_t))
        t[s] = t[s] + ln_t
    emb = sorted({0, pp - 1})
    emb_start = np.maximum.reduce([t[s] for s in emb])
    for s in emb:
        rows.append((s, "embedding-grads-all-reduce", 0, -1, t[s].copy(), emb_start + emb_t - t[s]))
        t[s] = emb_start + emb_t
    for s in range(pp):
        rs = dur("grads-reduce-scatter", s, 0)
        gstart = t[s].max(axis=1, keepdims=True)
        rows.append((s, "grads-reduce-scatter", 0, -1, t[s].copy(), gstart + rs - t[s]))
        t[s] = gstart + rs
    clip_start = np.maximum.reduce(t).max(axis=1, keepdims=True) + zero
    for s in range(pp):
        rows.append((s, "optimizer-clip-main-grad", 0, -1, t[s].copy(), clip_start + clip_t - t[s]))
        rows.append((s, "optimizer", 0, -1, clip_start + clip_t, zero + opt_t))


def _frame(
    rows: list, steps: int, dp: int, pp: int, tp: int, with_tp: bool, rng: np.random.Generator
) -> pd.DataFrame:
    n = steps * dp
    step_ix = np.repeat(np.arange(steps), dp)
    dp_ix = np.tile(np.arange(dp), steps)
    parts = []
    optypes = sorted({r[1] for r in rows})
    code = {o: k for k, o in enumerate(optypes)}
    for t in range(tp if with_tp else 1):
        jitter = 1.0 if t == 0 else 1.0 + 0.002 * rng.random()
        for row in rows:
            s, optype, seq, mbi, start, d = row[:6]
            chunk = (
                row[6]
                if len(row) > 6
                else (0 if optype in ("params-all-gather", "grads-reduce-scatter") else -1)
            )
            parts.append(
                {
                    "dp_rank": dp_ix.astype(np.int32),
                    "stage": np.full(n, s, np.int16),
                    "tp": np.full(n, t, np.int16),
                    "step": step_ix.astype(np.int32),
                    "optype": np.full(n, code[optype], np.int8),
                    "start_ts": start.reshape(-1),
                    "duration": (d.reshape(-1) * jitter).astype(np.float64),
                    "seq_id": np.full(n, seq, np.int32),
                    "mb_id": np.full(n, mbi, np.int16),
                    "mc": np.full(n, chunk, np.int8),
                }
            )
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    parts.clear()
    frame = pd.DataFrame(cols)
    frame["optype"] = pd.Categorical.from_codes(frame["optype"].to_numpy(), optypes)
    gmc = frame["mc"].astype(np.int16) * pp + frame["stage"]
    frame["gmc"] = gmc.where(frame["optype"].isin([F, B]), -1).astype(np.int16)
    frame["rank"] = (frame["dp_rank"] * pp + frame["stage"]) * (tp if with_tp else 1) + frame["tp"]
    if not with_tp:
        frame = frame.drop(columns=["tp"])
    return frame
