"""A step is a training iteration: real torch loops on the CPU, run under `diagnose` as a user
would, each checked through the run folder (`traindx.load_run(run).steps`)."""

import json
import os
import re
import textwrap

import pytest
from helpers import PY, diagnose, only_run_dir

import traindx

# One script, one loop shape per mode. Every iteration prints "iter i: loss ..." once, as the
# job's own log line, after the iteration's work (nanoGPT prints after zero_grad).
LOOPS = textwrap.dedent('''
    import sys, time
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.optim import Optimizer

    mode, n = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    torch.set_num_threads(1)

    def mlp():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def batch():
        x = torch.randn(8, 16)
        return x, x.flip(1)

    def log(i, loss, t0):
        print(f"iter {i}: loss {loss:.4f}, time {(time.perf_counter() - t0) * 1000:.2f}ms",
              flush=True)

    class OptimizersContainer(Optimizer):
        """Modelled on torchtitan's: one AdamW per model part, stepped by the container, which
        subclasses Optimizer and calls Optimizer.__init__ (so torch's hooks fire for both)."""
        def __init__(self, parts, lr):
            self.optimizers = [torch.optim.AdamW(p.parameters(), lr=lr) for p in parts]
            Optimizer.__init__(self, [q for p in parts for q in p.parameters()], {"lr": lr})

        def step(self, *args, **kwargs):
            for o in self.optimizers:
                o.step(*args, **kwargs)

        def zero_grad(self, *args, **kwargs):
            for o in self.optimizers:
                o.zero_grad(*args, **kwargs)

    def end_of_iteration(i, loss, t0):  # the function a --step-marker names
        log(i, loss, t0)

    if mode == "container":
        parts = [mlp(), mlp(), mlp()]
        opt = OptimizersContainer(parts, 1e-3)
        for i in range(n):
            t0 = time.perf_counter()
            x, y = batch()
            out = x
            for p in parts:
                out = p(out)
            loss = F.mse_loss(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            log(i, loss.item(), t0)

    elif mode == "gan":
        gen, disc = mlp(), nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
        opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
        for i in range(n):
            t0 = time.perf_counter()
            real, _ = batch()
            fake = gen(torch.randn(8, 16))
            d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = F.softplus(-disc(fake)).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            log(i, g_loss.item(), t0)

    elif mode == "scaler":
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for i in range(n):
            t0 = time.perf_counter()
            x, y = batch()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), y)
            if i == 2:
                loss = loss * float("inf")  # an overflow: GradScaler skips optimizer.step()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            log(i, loss.item(), t0)

    elif mode == "sgd":  # no torch.optim at all
        model = mlp()
        for i in range(n):
            t0 = time.perf_counter()
            x, y = batch()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 1e-2 * p.grad
                    p.grad = None
            log(i, loss.item(), t0)

    elif mode in ("critic", "critic-marker", "critic-fn", "critic-module"):
        # WGAN-style: the critic steps 3 times per generator step; the job says what a step is
        import traindx_loop_util
        if mode == "critic-marker":
            import traindx  # a job that marks its own steps
        gen, critic = mlp(), nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        opt_g = torch.optim.RMSprop(gen.parameters(), lr=1e-4)
        opt_c = torch.optim.RMSprop(critic.parameters(), lr=1e-4)
        for i in range(n):
            t0 = time.perf_counter()
            for _ in range(3):
                real, _ = batch()
                c_loss = critic(gen(torch.randn(8, 16)).detach()).mean() - critic(real).mean()
                opt_c.zero_grad()
                c_loss.backward()
                opt_c.step()
            g_loss = -critic(gen(torch.randn(8, 16))).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            if mode == "critic-marker":
                log(i, g_loss.item(), t0)
                traindx.step()
            elif mode == "critic-fn":
                end_of_iteration(i, g_loss.item(), t0)
            elif mode == "critic-module":
                traindx_loop_util.log_step(i, g_loss.item())
            else:
                log(i, g_loss.item(), t0)

    elif mode == "nanogpt":  # nanoGPT's loop: accumulate, step, zero_grad, then print
        model = mlp()
        if "--compile" in sys.argv:
            model = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        accumulation = 4
        X, Y = batch()
        t0 = time.perf_counter()
        for i in range(n):
            if i == 0:
                with torch.no_grad():  # nanoGPT's estimate_loss() at iteration 0
                    model(X)
            for micro_step in range(accumulation):
                loss = F.mse_loss(model(X), Y) / accumulation
                X, Y = batch()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            dt, t0 = t1 - t0, t1
            print(f"iter {i}: loss {loss.item() * accumulation:.4f}, time {dt * 1000:.2f}ms",
                  flush=True)

    elif mode == "trainer":  # an optimizer built seconds before the loop, then a DataLoader
        from torch.utils.data import DataLoader, TensorDataset
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8 * n, 16)
        loader = DataLoader(TensorDataset(x, x.flip(1)), batch_size=8)
        time.sleep(1.0)  # the framework's set-up after building the optimizer
        with torch.no_grad():  # an evaluation before training (Lightning's sanity check)
            model(x[:8])
        for i, (xb, yb) in enumerate(loader):
            t0 = time.perf_counter()
            loss = F.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
            log(i, loss.item(), t0)
''')

LOOP_UTIL = textwrap.dedent("""
    def log_step(i, loss):
        print(f"iter {i}: loss {loss:.4f}", flush=True)
""")


def _run(tmp_path, mode, n, *options, extra=()):
    script = tmp_path / "loops.py"
    script.write_text(LOOPS)
    (tmp_path / "traindx_loop_util.py").write_text(LOOP_UTIL)
    proc = diagnose(
        [
            "--out",
            "runs",
            "--no-pyspy",
            "--no-nvml",
            "--quiet",
            "--torch-profile",
            "off",
            *options,
            "--",
            PY,
            str(script),
            mode,
            str(n),
            *extra,
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    return proc, traindx.load_run(run_dir), run_dir


def _events(run_dir, type_):
    """Rank 0's events of one type, from its own file (the manifest maps ranks to files)."""
    with open(os.path.join(run_dir, "manifest.json")) as f:
        pid = json.load(f)["ranks"]["0"]
    with open(os.path.join(run_dir, "events", f"p{pid}.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["type"] == type_]


def _printed_iters(proc):
    return [int(m) for m in re.findall(r"^iter (\d+):", proc.stdout, re.M)]


def _assert_steps(run, n):
    steps = run.steps
    assert list(steps["step"]) == list(range(n))
    assert steps["duration_s"].notna().all() and (steps["duration_s"] > 0).all()
    # contiguous: each step begins where the previous one ended
    assert (steps["start_ns"].iloc[1:].values == steps["end_ns"].iloc[:-1].values).all()


@pytest.mark.slow
def test_an_optimizer_container_counts_once_per_iteration(tmp_path):
    proc, run, run_dir = _run(tmp_path, "container", 6)
    assert _printed_iters(proc) == list(range(6))
    # torch's hooks fire 4 times an iteration here (the container and its 3 AdamWs)
    _assert_steps(run, 6)
    assert {e["source"] for e in _events(run_dir, "step_end")} == {"torch.optim"}


@pytest.mark.slow
def test_two_optimizers_in_one_iteration_are_one_step(tmp_path):
    proc, run, _ = _run(tmp_path, "gan", 5)
    _assert_steps(run, 5)


@pytest.mark.slow
def test_a_grad_scaler_skipped_step_is_still_an_iteration(tmp_path):
    proc, run, run_dir = _run(tmp_path, "scaler", 5)
    _assert_steps(run, 5)
    ends = _events(run_dir, "step_end")
    assert [e.get("skipped_optimizer_steps", 0) for e in ends] == [0, 0, 1, 0, 0]
    assert {e["source"] for e in ends} == {"grad_scaler"}


@pytest.mark.slow
def test_a_hand_written_sgd_loop_counts_backward_passes(tmp_path):
    proc, run, run_dir = _run(tmp_path, "sgd", 5)
    _assert_steps(run, 5)
    assert {e["source"] for e in _events(run_dir, "step_end")} == {"backward"}


@pytest.mark.slow
def test_optimizers_at_different_rates_follow_the_learned_cycle(tmp_path):
    # without a marker the critic's steps (3 an iteration) are the steps: documented behaviour
    proc, run, _ = _run(tmp_path, "critic", 3)
    assert len(run.steps) == 9


@pytest.mark.slow
def test_traindx_step_marker_wins_over_optimizer_steps(tmp_path):
    proc, run, run_dir = _run(tmp_path, "critic-marker", 4)
    _assert_steps(run, 4)
    assert _events(run_dir, "step_marker")


@pytest.mark.parametrize(
    "mode,target",
    [("critic-fn", "__main__:end_of_iteration"), ("critic-module", "traindx_loop_util:log_step")],
)
@pytest.mark.slow
def test_step_marker_option_names_the_jobs_function(tmp_path, mode, target):
    proc, run, run_dir = _run(tmp_path, mode, 4, "--step-marker", target)
    _assert_steps(run, 4)
    assert {e["source"] for e in _events(run_dir, "step_end")} == {"--step-marker"}
    assert not _events(run_dir, "shim_error")


def test_step_marker_option_rejects_what_is_not_module_function(tmp_path):
    proc = diagnose(["--step-marker", "not a function", "--", PY, "-c", "pass"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "--step-marker" in proc.stderr and "Traceback" not in proc.stderr


def test_traindx_step_is_a_cheap_no_op_outside_diagnose():
    traindx.step()  # not recording: nothing happens, nothing raises


@pytest.mark.slow
def test_gradient_accumulation_with_one_optimizer_is_one_step_per_iteration(tmp_path):
    proc, run, _ = _run(tmp_path, "nanogpt", 5)
    _assert_steps(run, 5)
    assert _printed_iters(proc) == list(range(5))


@pytest.mark.slow
def test_steps_n_stops_after_the_last_steps_own_log_line(tmp_path):
    proc, run, run_dir = _run(tmp_path, "nanogpt", 20, "--steps", "4")
    _assert_steps(run, 4)
    # nanoGPT prints after zero_grad: the 4th iteration's line is there, the 5th's is not
    assert _printed_iters(proc) == [0, 1, 2, 3]
    assert _events(run_dir, "stop")[0]["at"] == "forward"


@pytest.mark.slow
def test_steps_n_with_torch_compile_keeps_the_last_log_line(tmp_path):
    proc, run, run_dir = _run(tmp_path, "nanogpt", 20, "--steps", "3", extra=["--compile"])
    _assert_steps(run, 3)
    assert _printed_iters(proc) == [0, 1, 2]
    # watching for step 0's first forward leaves no trace in the job: no warning about global
    # module hooks, no guard of ours in a recompile (only the eval/train grad-mode pair)
    assert "global hooks" not in proc.stderr, proc.stderr[-2000:]
    reasons = [e.get("recompile_reason") or "" for e in _events(run_dir, "compile")]
    assert not any("hook" in r or "traindx" in r for r in reasons), reasons
    assert _events(run_dir, "step_begin")[0]["begun_by"] == "forward"


@pytest.mark.slow
def test_step_0_begins_at_the_first_batch_not_at_the_optimizers_creation(tmp_path):
    proc, run, run_dir = _run(tmp_path, "trainer", 4)
    _assert_steps(run, 4)
    created = _events(run_dir, "optimizer_created")[0]["t"]
    begin = _events(run_dir, "step_begin")[0]
    assert begin["step"] == 0 and begin["begun_by"] == "batch"
    # the second of set-up and the no_grad evaluation after building the optimizer are start-up
    assert begin["t"] - created >= 0.9e9


def test_log_lines_that_arrived_in_one_read_take_the_steps_before_their_stamp():
    """HF Trainer prints a loss dict with no step at each step's end; its step is the number of
    step ends seen when the launcher stamped the line. Two dicts read from the pipe at once
    share a stamp taken after the next step ended (a CI run: steps 1, 2, 3, 5, 5): the earlier
    one takes the free step before. Two lines of one step (stamped apart or together) keep it."""
    from traindx.derive.run import _spread_coalesced

    def placed(steps, stamps):
        rows = [{"step": s, "t": t} for s, t in zip(steps, stamps)]
        _spread_coalesced(rows)
        return [r["step"] for r in rows]

    assert placed([1, 2, 3, 5, 5, 6], [10, 20, 30, 79, 79, 90]) == [1, 2, 3, 4, 5, 6]
    assert placed([3, 6, 6, 6], [30, 65, 65, 65]) == [3, 4, 5, 6]
    assert placed([1, 1, 2, 2], [10, 10, 20, 20]) == [1, 1, 2, 2]
    assert placed([1, 2, 2], [10, 20, 25]) == [1, 2, 2]
    # the first two loss dicts read at once, stamped after step 2 ended (a fresh-clone CI run:
    # 2, 2, 3, ...): one loss line per step, so the first takes step 1
    rows = [{"step": s, "t": t, "loss": 1.0} for s, t in zip([2, 2, 3], [20, 20, 30])]
    _spread_coalesced(rows)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # a loaded CI run: loss dicts read apart, the fourth only after step 5 ended (1, 2, 3, 5, 5):
    # a stamp is never early, so the fourth takes step 4; losses printed per micro-batch (four
    # on each step) stay where they were placed
    for steps in ([1, 2, 3, 5, 5, 6], [1, 2, 4, 5, 5, 6]):
        rows = [{"step": s, "t": 10 * k, "loss": 1.0} for k, s in enumerate(steps)]
        _spread_coalesced(rows)
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    rows = [{"step": 1 + k // 4, "t": 10 * k, "loss": 1.0} for k in range(12)]
    _spread_coalesced(rows)
    assert [r["step"] for r in rows] == [1 + k // 4 for k in range(12)]
