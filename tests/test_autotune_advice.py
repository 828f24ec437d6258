"""Autotune prescriptions in the installed versions' own terms (analyzers/jit/autotune_advice.py).

The events have the shape the shim records for `triton_autotune` (kernel, module, key names and
values, dtypes, bench seconds, cache_results, disk hit, chosen config) and the numbers of the
issue's H200 run: FLA 0.6.0 `chunk_gated_delta_rule` forward, ~37 s of first-call tuning.
"""

import pytest

from traindx.analyzers.jit import autotune_advice as aa

FLA_060 = {"triton": "3.6.0", "fla-core": "0.6.0", "flash-linear-attention": "0.6.0", "torch": "2.11.0"}
DTYPES = {"k": "torch.bfloat16", "w": "torch.bfloat16", "u": "torch.bfloat16", "g": "torch.float32"}


def _event(
    kernel,
    module,
    names,
    values,
    bench_s,
    step=0,
    start=0,
    cache_results=True,
    hit=False,
    best="{'BV': 32, 'num_warps': 4, 'num_ctas': 1, 'num_stages': 3}",
):
    return {
        "kind": "triton_autotune",
        "kernel": kernel,
        "module": module,
        "key_names": names,
        "key_fields": dict(zip(names, values)),
        "key_dtypes": DTYPES,
        "bench_s": bench_s,
        "duration_s": bench_s,
        "wall_s": bench_s + 0.4,
        "step": step,
        "start": start,
        "cache_results": cache_results,
        "disk_cache_hit": hit,
        "configs": 12,
        "configs_benchmarked": 12,
        "best_config": best,
        "caller": {"file": "/home/u/train/fla_job.py", "line": 57, "function": "main"},
    }


def fla_cold_start(cache_results=True):
    """The first step of the H200 run: every FLA kernel on the forward path tuned once."""
    names_h = ["H", "HV", "K", "V", "BT", "STATE_V_FIRST"]
    vals_h = ["16", "16", "128", "128", "64", "False"]
    return [
        _event(
            "chunk_local_cumsum_scalar_kernel",
            "fla.ops.utils.cumsum",
            ["B", "H", "BT", "IS_VARLEN", "REVERSE"],
            ["1", "16", "64", "True", "False"],
            1.9,
            start=1,
            cache_results=cache_results,
        ),
        _event(
            "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
            "fla.ops.gated_delta_rule.chunk_fwd",
            ["H", "HV", "K", "BC"],
            ["16", "16", "128", "16"],
            6.3,
            start=2,
            cache_results=cache_results,
        ),
        _event(
            "recompute_w_u_fwd_kernel",
            "fla.ops.gated_delta_rule.wy_fast",
            ["H", "HV", "K", "V", "BT", "BK", "BV", "IS_VARLEN"],
            ["16", "16", "128", "128", "64", "64", "64", "True"],
            5.2,
            start=3,
            cache_results=cache_results,
        ),
        _event(
            "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
            "fla.ops.common.chunk_delta_h",
            names_h,
            vals_h,
            14.8,
            start=4,
            cache_results=cache_results,
        ),
        _event(
            "chunk_fwd_kernel_o",
            "fla.ops.common.chunk_o",
            names_h,
            vals_h,
            9.1,
            start=5,
            cache_results=cache_results,
        ),
    ]


def fla_retuning_on_length():
    """An FLA kernel whose key holds a length that packing changes every step (fla#1147's kind)."""
    names = ["H", "K", "V", "BT", "NT"]
    out = []
    for step, nt in enumerate([128, 131, 126, 140, 133, 129]):
        out.append(
            _event(
                "chunk_fwd_kernel_o",
                "fla.ops.common.chunk_o",
                names,
                ["16", "128", "128", "64", str(nt)],
                2.4 if step else 9.0,
                step=step,
                start=100 + step,
            )
        )
    return out


def _env_vars(prescriptions):
    return {k for p in prescriptions for k in (p.change or {}).get("env", {})}


def test_fla_cold_start_prescribes_warming_the_cache_it_already_writes():
    events = fla_cold_start()
    advice = aa.advise(events, FLA_060, env={}, run_path="runs/fla-cold", cache_dir="/data/triton-cache")
    assert advice.cold_bench_s == pytest.approx(1.9 + 6.3 + 5.2 + 14.8 + 9.1)
    assert advice.steady_bench_s == 0 and advice.steady == ()
    assert advice.kernels[0].kernel == "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"  # costliest first
    warm = [p for p in advice.cold if p.kind == "precompile"][0]
    assert warm.change["precompile"]["from_run"] == "runs/fla-cold"
    assert "kernel-cache warm --from-run runs/fla-cold" in warm.command
    # FLA 0.6.0 already passes cache_results=True (FLA_CACHE_RESULTS defaults to 1): what was
    # missing is a TRITON_CACHE_DIR that outlives the job, not another switch
    assert warm.change["env"] == {"TRITON_CACHE_DIR": "/data/triton-cache"}
    assert "FLA_CACHE_RESULTS" not in _env_vars(advice.cold)
    assert "TRITON_CACHE_AUTOTUNING" not in _env_vars(advice.cold)
    assert any("FLA_CACHE_RESULTS defaults to 1" in n for n in advice.notes)
    assert advice.evidence()["autotuned_kernels"][0]["bench_s"] == pytest.approx(14.8)


def test_fla_with_its_cache_turned_off_gets_its_own_switch_back():
    advice = aa.advise(
        fla_cold_start(cache_results=False),
        FLA_060,
        env={"FLA_CACHE_RESULTS": "0"},
        run_path="runs/x",
        cache_dir="/c",
    )
    env = [p for p in advice.cold if p.kind == "env"][0].change["env"]
    assert env == {"TRITON_CACHE_DIR": "/c", "FLA_CACHE_RESULTS": "1"}


def test_plain_triton_kernel_gets_triton_cache_autotuning_only_where_triton_reads_it():
    events = [
        _event(
            "fused_moe_kernel",
            "mylib.moe",
            ["M", "N", "K"],
            ["4096", "8192", "2048"],
            12.0,
            cache_results=False,
        )
    ]
    new = aa.advise(events, {"triton": "3.6.0"}, run_path="runs/a", cache_dir="/c")
    assert "TRITON_CACHE_AUTOTUNING" in _env_vars(new.cold)
    old = aa.advise(events, {"triton": "3.2.0"}, run_path="runs/a", cache_dir="/c")
    assert "TRITON_CACHE_AUTOTUNING" not in _env_vars(old.cold)
    upgrade = [p for p in old.cold if p.kind == "upgrade"]
    assert upgrade and upgrade[0].change["upgrade"] == {"package": "triton", "min_version": "3.6.0"}
    unknown = aa.advise(events, {}, run_path="runs/a", cache_dir="/c")  # no version recorded
    assert "TRITON_CACHE_AUTOTUNING" not in _env_vars(unknown.cold)
    assert not [p for p in unknown.cold if p.kind == "upgrade"]  # no upgrade from an unknown release


def test_fla_without_a_recorded_version_gets_no_fla_switch_and_no_upgrade():
    advice = aa.advise(
        fla_cold_start(cache_results=False),
        {"triton": "3.6.0"},
        env={"FLA_CACHE_RESULTS": "0"},
        run_path="runs/u",
        cache_dir="/c",
    )
    assert "FLA_CACHE_RESULTS" not in _env_vars(advice.cold)
    assert "TRITON_CACHE_AUTOTUNING" in _env_vars(advice.cold)  # Triton's switch reaches them too
    assert not [p for p in advice.cold if p.kind == "upgrade"]
    assert any("not in the run's manifest" in n for n in advice.notes)


def test_retuning_names_the_changing_length_and_fla_060_fuzzy_mode():
    advice = aa.advise(
        fla_retuning_on_length(), FLA_060, run_path="runs/r", cache_dir="/c", config_dir="/data/fla-configs"
    )
    kernel = advice.kernels[0]
    assert [f for f, _, _ in kernel.changing_fields] == ["NT"]
    assert kernel.retune_steps == [1, 2, 3, 4, 5]
    assert advice.cold_bench_s == pytest.approx(9.0)
    assert advice.steady_bench_s == pytest.approx(5 * 2.4)
    code = [p for p in advice.steady if p.kind == "code"][0]
    assert "NT (6 values" in code.summary and "packed length" in code.summary
    assert code.expected_gain_s_per_step == pytest.approx(2.4)
    fuzzy = [p for p in advice.steady if p.kind == "env"][0]
    assert fuzzy.change["env"] == {"FLA_CACHE_MODE": "fuzzy", "FLA_CONFIG_DIR": "/data/fla-configs"}


def test_an_fla_release_we_did_not_read_gets_an_upgrade_not_a_variable():
    old = {"triton": "3.3.1", "flash-linear-attention": "0.3.2"}
    advice = aa.advise(fla_retuning_on_length(), old, run_path="runs/r", cache_dir="/c")
    names = _env_vars(advice.cold) | _env_vars(advice.steady)
    assert not names & {"FLA_CACHE_MODE", "FLA_CONFIG_DIR", "FLA_CACHE_RESULTS", "TRITON_CACHE_AUTOTUNING"}
    upgrades = [p.change["upgrade"] for p in advice.cold + advice.steady if p.kind == "upgrade"]
    assert {"package": "flash-linear-attention", "min_version": "0.6.0"} in upgrades


@pytest.mark.parametrize(
    "packages",
    [FLA_060, {"triton": "3.2.0", "fla-core": "0.5.9"}, {"triton": "3.6.0+git1234", "fla-core": "0.6.0"}, {}],
)
def test_never_a_variable_the_installed_version_does_not_read(packages):
    events = (
        fla_cold_start(cache_results=False)
        + fla_retuning_on_length()
        + [_event("my_kernel", "proj.kernels", ["N"], ["1024"], 3.0, cache_results=False, start=999)]
    )
    advice = aa.advise(events, packages, env={"FLA_CACHE_RESULTS": "0"}, run_path="runs/z", cache_dir="/c")
    owner = {
        "TRITON_CACHE_DIR": "triton",
        "TRITON_CACHE_AUTOTUNING": "triton",
        "FLA_CACHE_RESULTS": "fla",
        "FLA_CACHE_MODE": "fla",
        "FLA_CONFIG_DIR": "fla",
    }
    for name in _env_vars(advice.cold + advice.steady):
        if name == "TRITON_CACHE_DIR":
            continue  # read by every Triton release (and by torch inductor)
        assert aa.reads(packages, owner[name], name), (name, packages)


def test_release_parsing():
    assert aa.release("3.6.0+git1a2b") == (3, 6, 0)
    assert aa.release("0.6.0rc1") == (0, 6, 0)
    assert aa.release(None) is None and aa.release("unknown") is None
    assert aa.reads({"triton": "3.10.0"}, "triton", "TRITON_CACHE_AUTOTUNING")


def test_a_run_whose_choices_came_from_disk_needs_no_warm_up():
    events = [dict(e, disk_cache_hit=True, bench_s=0.004) for e in fla_cold_start()]
    advice = aa.advise(events, FLA_060, run_path="runs/w", cache_dir="/c")
    assert advice.cold == () and advice.cold_bench_s == 0
    assert any("5 of 5 autotuned kernel(s) read their first choice" in n for n in advice.notes)


def test_no_events_no_advice():
    advice = aa.advise([], FLA_060)
    assert advice.kernels == [] and advice.cold == () and advice.steady == ()
