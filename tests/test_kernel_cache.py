"""kernel-cache: precompiling FA4 kernels on a CPU (real FA4 under FakeTensorMode) so that a job
compiles nothing, replaying a recorded run's compiles, and managing the cache folder."""

import contextlib
import errno
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from traindx.common.errors import UserError
from traindx.kernel_cache.cli import spec
from traindx.kernel_cache.store import cache as store

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "kernel_cache"
EXAMPLE = ROOT / "examples" / "fa4_seed.py"
# a small packed-varlen job: 2 q heads / 1 kv head of dim 64, sequences of 16-64 tokens, sm_90
EXAMPLE_ARGS = ["--arch", "sm_90", "--steps", "2", "--min-len", "16", "--max-len", "64"]
EXAMPLE_SPEC = "hd=64,hq=2,hkv=1,dtype=bf16,causal,varlen"
HAVE_FA4 = store.current_environment().fingerprint is not None
needs_fa4 = pytest.mark.skipif(not HAVE_FA4, reason="flash-attn-4 / nvidia-cutlass-dsl not installed")


def kernel_cache(*args, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "traindx.kernel_cache.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


def job_env(cache_dir=None):
    env = dict(os.environ)
    for name in ("FLASH_ATTENTION_ARCH", "CUTE_DSL_ARCH", "FLASH_ATTENTION_NUM_SMS", "FA_LOG_LEVEL"):
        env.pop(name, None)
    env.pop(store.DIR_VAR, None)
    env[store.ENABLE_VAR] = "0"
    if cache_dir is not None:
        env[store.ENABLE_VAR] = "1"
        env[store.DIR_VAR] = str(cache_dir)
    return env


def diagnose_example(run_dir, cache_dir):
    """The FA4 example under `diagnose`, with FA4's persistent cache in cache_dir."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "traindx",
            "--no-pyspy",
            "--no-nvml",
            "--quiet",
            "--run-dir",
            str(run_dir),
            "--",
            sys.executable,
            str(EXAMPLE),
            *EXAMPLE_ARGS,
        ],
        capture_output=True,
        text=True,
        env=job_env(cache_dir),
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from traindx import load_run

    return load_run(run_dir)


def entries(cache_dir):
    return sorted(str(p.relative_to(cache_dir)) for p in Path(cache_dir).glob("*/*/*.o"))


def fa4_compiles(run):
    c = run.compiles
    return c[c["kind"] == "cute_dsl"] if len(c) else c


# -- what to compile (no FA4 needed) ---------------------------------------------------------------
def test_spec_syntax():
    s = spec.parse_spec("hd=128,hq=16,hkv=4,dtype=bf16,causal,varlen,window=256:0,deterministic")
    assert (s["hd"], s["hdv"], s["hq"], s["hkv"]) == (128, 128, 16, 4)
    assert s["causal"] and s["varlen"] and s["deterministic"] and s["window"] == [256, 0]
    for bad, why in [
        ("hq=16", "hd="),
        ("hd=128,hq=16,hkv=5", "multiple"),
        ("hd=128,bogus", "unknown flag"),
        ("hd=abc", "bad value"),
        ("hd=128,dtype=fp64", "bad value"),
    ]:
        with pytest.raises(UserError, match=why):
            spec.parse_spec(bad)


def test_seqlen_ranges_cover_every_tile_boundary():
    assert spec.parse_seqlens("2048,4096") == [2048, 4096]
    swept = spec.parse_seqlens("16-4096")
    assert swept[0] == 16 and swept[-1] == 4096
    assert all(v in swept for v in range(16, 257, 8)) and 1024 in swept
    assert spec.parse_seqlens(None, varlen=True)[0] == 8  # varlen default: a sweep
    with pytest.raises(UserError):
        spec.parse_seqlens("64-16")
    # the longest and the shortest length go first, so parallel workers start on different keys
    assert spec.spread_order([16, 32, 48, 64])[:2] == [64, 16]


@pytest.mark.parametrize(
    "config, expected",
    [
        ("llama3_8b.json", [(128, 32, 8)]),
        ("qwen3_8b.json", [(128, 32, 8)]),
        ("qwen3_30b_a3b.json", [(128, 32, 4)]),
        ("qwen3_5_35b_a3b.json", [(256, 16, 2)]),  # text_config + layer_types
        ("qwen3_next_80b_a3b.json", [(256, 16, 2)]),  # full_attention_interval only
    ],
)
def test_model_configs_give_the_attention_shapes(config, expected):
    specs, notes = spec.model_specs(DATA / config, varlen=True)
    assert [(s["hd"], s["hq"], s["hkv"]) for s in specs] == expected
    assert all(s["varlen"] and s["causal"] and s["dtype"] == "bf16" and s["window"] is None for s in specs)
    if "qwen3_5" in config:
        assert notes == ["full_attention (10 layers)"]  # the 30 linear-attention layers are not FA4


def test_model_tensor_parallel_splits_heads():
    specs, _ = spec.model_specs(DATA / "qwen3_5_35b_a3b.json", tp=4)
    assert (specs[0]["hq"], specs[0]["hkv"]) == (4, 1)  # 2 kv heads replicated over 4 ranks


def test_arch_env():
    assert spec.arch_env("sm_90") == {
        "FLASH_ATTENTION_ARCH": "sm_90",
        "CUTE_DSL_ARCH": "sm_90a",
        "FLASH_ATTENTION_NUM_SMS": "132",
    }
    assert spec.arch_env("sm100", 148)["CUTE_DSL_ARCH"] == "sm_100a"
    with pytest.raises(UserError):
        spec.arch_number("hopper")


# -- the cache folder (no compile) -----------------------------------------------------------------
def elf_object(payload=100):
    """A whole ELF64 relocatable object as far as its header tells (two section headers at its
    end), as FA4's exported entries are."""
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header += struct.pack("<HHIQQQIHHHHHH", 1, 62, 1, 0, 0, 64 + payload, 0, 64, 0, 0, 64, 2, 0)
    return header + bytes(payload) + bytes(2 * 64)


def fake_folder(cache_dir, fingerprint, versions=None, n=2):
    folder = Path(cache_dir) / fingerprint
    for i in range(n):
        (folder / "fwd").mkdir(parents=True, exist_ok=True)
        (folder / "fwd" / f"{i:064x}.o").write_bytes(elf_object())
        (folder / "fwd" / f"{i:064x}.lock").write_bytes(b"")
    if versions:
        (folder / store.METADATA_FILE).write_text(json.dumps({"versions": versions}))
    return folder


@needs_fa4
def test_foreign_cache_is_unusable_with_reason(tmp_path):
    env = store.current_environment()
    fake_folder(tmp_path, env.fingerprint)
    other = dict(env.versions(), python="3.12")
    other["flash-attn-4"] = "4.0.0b17"
    fake_folder(tmp_path, "a" * 64, versions=other)
    fake_folder(tmp_path, "b" * 64)
    folders = {f.fingerprint: f for f in store.scan(tmp_path)}
    assert folders[env.fingerprint].usable
    reason = folders["a" * 64].reason
    assert "Python 3.12 (here" in reason and "flash-attn-4 4.0.0b17" in reason
    assert not folders["b" * 64].usable and "fingerprint differs" in folders["b" * 64].reason
    proc = kernel_cache("ls", "--cache-dir", tmp_path)
    assert proc.returncode == 0 and "unusable: built for Python 3.12" in proc.stdout


@needs_fa4
def test_pack_unpack_clear(tmp_path):
    env = store.current_environment()
    src, dst = tmp_path / "src", tmp_path / "dst"
    fake_folder(src, env.fingerprint, n=3)
    fake_folder(src, "c" * 64, versions=dict(env.versions(), python="3.99"))
    tarball = tmp_path / "cache.tar.gz"
    assert kernel_cache("pack", tarball, "--cache-dir", src).returncode == 0
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
    assert len([n for n in names if n.endswith(".o")]) == 3  # only this environment's folder
    assert not any(n.endswith(".lock") for n in names)
    proc = kernel_cache("unpack", tarball, "--cache-dir", dst)
    assert proc.returncode == 0, proc.stderr
    assert entries(dst) == [e for e in entries(src) if e.startswith(env.fingerprint)]
    assert f"export {store.DIR_VAR}={dst}" in proc.stdout
    # a pack for another environment unpacks, but is reported unusable
    foreign = tmp_path / "foreign.tar.gz"
    assert kernel_cache("pack", foreign, "--all", "--cache-dir", src).returncode == 0
    proc = kernel_cache("unpack", foreign, "--cache-dir", tmp_path / "other")
    assert "Python 3.99" in proc.stdout
    proc = kernel_cache("clear", "--stale", "--cache-dir", src)
    assert proc.returncode == 0 and not (src / ("c" * 64)).exists() and (src / env.fingerprint).exists()
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(__file__, arcname="../evil.o")
    proc = kernel_cache("unpack", bad, "--cache-dir", dst)
    assert proc.returncode == 2 and "not a kernel-cache pack" in proc.stderr


def test_clear_deletes_only_folders_the_cache_made(tmp_path):
    """Issue 39: a folder named like a fingerprint that holds anything FA4 and kernel-cache do not
    write (a thesis, a link) is kept, with one line saying why; the cache's own go."""
    ours = fake_folder(tmp_path, "e" * 64, versions={"python": "3.99"})
    thesis = tmp_path / ("d" * 64) / "thesis.tex"
    thesis.parent.mkdir()
    thesis.write_text("\\chapter{Four years of work}")
    linked = fake_folder(tmp_path, "f" * 64)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (linked / "fwd" / ("0" * 64 + ".lock")).unlink()
    (linked / "fwd" / ("0" * 64 + ".lock")).symlink_to(victim)
    proc = kernel_cache("clear", "--cache-dir", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (
        not ours.exists() and thesis.read_text().startswith("\\chapter") and victim.read_text() == "keep me"
    )
    assert linked.is_dir()
    kept = proc.stderr.strip().splitlines()
    assert len(kept) == 2 and any("thesis.tex" in line for line in kept) and "Traceback" not in proc.stderr
    assert "removed 2 entries in 1 folder(s)" in proc.stdout


def test_entry_problem_tells_a_cut_object_from_a_whole_one(tmp_path):
    whole = tmp_path / "whole.o"
    whole.write_bytes(elf_object())
    assert store.entry_problem(whole, whole.stat().st_size) is None
    for data, said in [
        (elf_object()[:-10], "truncated"),
        (elf_object()[:30], "truncated"),
        (b"\x7fEL", "truncated"),
        (b"", "empty"),
        (b"#!/bin/sh\n", "no ELF header"),
    ]:
        whole.write_bytes(data)
        assert said in store.entry_problem(whole, len(data))


@needs_fa4
@pytest.mark.slow  # verify imports FA4 and cutlass (~20 s)
def test_damaged_entries_make_a_folder_unusable_and_are_never_packed(tmp_path, monkeypatch):
    """Issue 39: `ls` does not call a folder with cut entries usable, `pack` refuses it in one
    line, and `verify --delete-bad` on a read-only cache says so in one line."""
    from traindx.kernel_cache.cli import main as kernel_cache_cli

    env = store.current_environment()
    folder = fake_folder(tmp_path, env.fingerprint, n=2)
    for entry in (folder / "fwd").glob("*.o"):
        entry.write_bytes(elf_object()[:100])  # a full disk cut both
    proc = kernel_cache("ls", "--cache-dir", tmp_path)
    assert proc.returncode == 0 and "usable" in proc.stdout
    assert "unusable" in proc.stdout and "damaged" in proc.stdout, proc.stdout
    proc = kernel_cache("pack", tmp_path / "c.tar.gz", "--cache-dir", tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "not packed" in proc.stderr
    assert not (tmp_path / "c.tar.gz").exists()

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kernel_cache_cli.main(["verify", "--delete-bad", "--cache-dir", str(tmp_path)])
    text = out.getvalue() + err.getvalue()
    assert code == 1 and "internal error" not in text and "Traceback" not in text
    assert "2 of 2 bad entries could not be deleted" in " ".join(text.split()), text
    assert len(list((folder / "fwd").glob("*.o"))) == 2


def test_env_prints_the_two_exports(tmp_path):
    proc = kernel_cache("env", "--cache-dir", tmp_path)
    assert proc.stdout.splitlines() == [f"export {store.ENABLE_VAR}=1", f"export {store.DIR_VAR}={tmp_path}"]
    assert kernel_cache("env", "--dir", "--cache-dir", tmp_path).stdout.strip() == str(tmp_path)


def test_bad_input_is_one_line(tmp_path):
    for args, why in [
        (["warm", "--spec", "hd=128,hkv=3", "--arch", "sm_90"], "multiple of"),
        (["warm", "--from-run", tmp_path, "--arch", "sm_90"], "not a traindx run"),
        (["warm", "--spec", "hd=64", "--arch", "sm_42"], "--arch"),
        (["warm"], "nothing to compile"),
    ]:
        proc = kernel_cache(*args, "--cache-dir", tmp_path / "c")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and why in lines[0], proc.stderr


# -- real FA4 compiles (CPU, FakeTensorMode) -----------------------------------------------------------
@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    """The example run cold under diagnose; FA4 itself writes its entries into job_cache."""
    base = tmp_path_factory.mktemp("seed")
    run = diagnose_example(base / "run", base / "job_cache")
    return run, base / "job_cache"


@pytest.mark.fa4
@needs_fa4
@pytest.mark.slow
def test_from_run_replays_the_keys_of_a_recorded_run(seed_run, tmp_path):
    run, job_cache = seed_run
    recorded = fa4_compiles(run)
    assert len(recorded) >= 3  # forward, backward and its pre/post kernels compiled in step 0
    proc = kernel_cache("warm", "--from-run", run.path, "--cache-dir", tmp_path, "--jobs", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("key matches the run's") == 2  # forward and backward
    # the replay wrote exactly the entries the job itself wrote, by FA4's own key hashes
    assert entries(tmp_path) and entries(tmp_path) == entries(job_cache)


@pytest.mark.fa4
@needs_fa4
@pytest.mark.slow
def test_warm_spec_then_the_job_compiles_nothing(seed_run, tmp_path):
    _, job_cache = seed_run
    cache = tmp_path / "cache"
    proc = kernel_cache(
        "warm",
        "--spec",
        EXAMPLE_SPEC,
        "--seqlens",
        "16-64",
        "--arch",
        "sm_90",
        "--cache-dir",
        cache,
        "--jobs",
        "1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    families = {Path(e).parts[1] for e in entries(cache)}
    assert {"fwd", "bwd", "bwd_pre", "bwd_post"} <= families
    assert set(entries(job_cache)) <= set(entries(cache))
    run = diagnose_example(tmp_path / "run", cache)
    assert len(run.steps) == 2
    assert len(fa4_compiles(run)) == 0


@pytest.mark.fa4
@needs_fa4
@pytest.mark.slow
def test_verify_reports_a_corrupted_entry(seed_run, tmp_path):
    _, job_cache = seed_run
    cache = tmp_path / "cache"
    shutil.copytree(job_cache, cache)
    n = len(entries(cache))
    victim = cache / entries(cache)[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # a cut-off write
    proc = kernel_cache("verify", "--cache-dir", cache)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    bad = [line for line in proc.stdout.splitlines() if line.startswith("bad ")]
    assert len(bad) == 1 and victim.name in bad[0]
    assert f"{n - 1} of {n} entries load; 1 bad" in proc.stdout  # the intact ones load
    assert "differs from kernel-cache's" not in proc.stdout  # our fingerprint is FA4's own


@pytest.mark.fa4
@needs_fa4
@pytest.mark.slow
def test_spec_fa4_rejects_gives_one_line_error(tmp_path):
    proc = kernel_cache(
        "warm", "--spec", "hd=512,hq=8", "--seqlens", "1024", "--arch", "sm_90", "--cache-dir", tmp_path
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kernel-cache: error: FA4") and "rejects hd=512" in last
    assert "not supported on SM90" in last
    assert "Traceback" not in proc.stderr and not entries(tmp_path)


def test_run_items_of_the_h200_seed_run():
    """The real H200 recording (FA4 4.0.0b17, max_seqlen as a tensor): 28 compiles are 5 distinct
    calls; the backward one compiled 24 times because its key holds tensors."""
    run_dir = ROOT / "tests" / "data" / "h200-seed-b17-tensor"
    if not run_dir.is_dir():
        pytest.skip("the H200 seed run record is not in this checkout")
    items, info = spec.run_items(run_dir)
    assert info["archs"] == [90] and info["num_sms"] == 132  # from the key and the GPU's name
    assert info["versions"]["flash-attn-4"] == "4.0.0b17"
    by_function = {}
    for item in items:
        by_function.setdefault(item["function"], []).append(item)
    assert [i["function"] for i in items[:2]] == ["_flash_attn_fwd", "_flash_attn_bwd"]
    (bwd,) = by_function["_flash_attn_bwd"]
    assert bwd["times_compiled"] == 24
    assert len(bwd["tensor_fields"]) == 2  # single_q_block, single_k_block (unnamed in this record)
    assert bwd["args"]["max_seqlen_q"]["tensor"] and bwd["args"]["q"]["shape"] == [16384, 16, 128]
    assert not by_function["_flash_attn_fwd"][0]["tensor_fields"]


def test_a_recorded_enum_and_dataclass_argument_is_rebuilt():
    """FA4 4.0.0b40 passes its resolved FwdConfig/BwdConfig (frozen dataclasses, nested) and a
    PackGQA enum to the functions that compile: a replay needs them back, equal to the original."""
    from helpers import LaunchConfig, Registers, TileOrder

    from traindx.kernel_cache.cli import worker
    from traindx.profiler.shim._traindx_shim.compiles import describe_value

    config = LaunchConfig(tile_m=128, registers=Registers(240, 24), order=TileOrder.LONGEST_FIRST)
    recorded = json.loads(
        json.dumps({"config": describe_value(config), "mode": describe_value(TileOrder.ROW)})
    )
    assert worker._rebuild("config", recorded["config"], recorded) == config
    assert worker._rebuild("mode", recorded["mode"], recorded) is TileOrder.ROW
    # a release whose class lacks a recorded field says so instead of compiling something else
    recorded["config"]["fields"]["stages"] = 2
    with pytest.raises(worker.Unreplayable, match="does not rebuild"):
        worker._rebuild("config", recorded["config"], recorded)
