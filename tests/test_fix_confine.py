"""`diagnose --fix` never writes where the user's files are (issue 39, item 1; its rows of the
fault suite): every arm's writes are confined to its own folder, a private overlay view where
user namespaces are allowed (traindx.fixing.run.confine), a private copy where they are not.

Rows: a job saving ckpt.pt and out/final.txt relative to its cwd, appending to a results file
by absolute path outside the run folder and to a > 2 MB file beside its script, under --fix
(baseline, a source-patch candidate run from a scratch copy): the user's tree and the outside
file byte-identical after; the kept arm's writes copied into place on request and the others'
dropped; a write where no overlay goes refused; the scratch copy never links back to a user
file; without a namespace, a private copy and a warning for a write through an absolute path."""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest
from helpers import PY, ROOT, diagnose

from traindx.fixing.run import confine as fix_confine
from traindx.fixing.run import scratch
from traindx.profiler.launcher import Options

JOB = os.path.join(ROOT, "tests", "jobs", "fix_writes_outputs.py")
NAMESPACE = fix_confine.probe()
needs_namespace = pytest.mark.skipif(NAMESPACE is not None, reason=f"no user namespace here: {NAMESPACE}")


def _hashes(root, skip=None):
    """{relative path: sha256} of every file (and each folder's listing) under root."""
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if os.path.join(folder, d) != skip)
        out[os.path.relpath(folder, root) + "/"] = sorted(dirs + files)
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _user_tree(tmp_path):
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (proj / "out").mkdir(parents=True)
    elsewhere.mkdir()
    (proj / "job.py").write_text(open(JOB).read())
    (proj / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    (proj / "ckpt.pt").write_text("the user's own checkpoint\n")
    (proj / "out" / "final.txt").write_text("the user's own result\n")
    (elsewhere / "results.txt").write_text("line 0\n")
    return proj, elsewhere


@needs_namespace
@pytest.mark.slow
def test_fix_leaves_the_users_tree_and_every_outside_path_byte_identical(tmp_path):
    proj, elsewhere = _user_tree(tmp_path)
    fix_dir = proj / "runs" / "fix"  # the run folder inside the user's tree, as by default
    (proj / "runs").mkdir()
    before = (_hashes(proj), _hashes(elsewhere))
    proc = diagnose(
        [
            "--fix",
            "--no-pyspy",
            "--quiet",
            "--steps",
            "8",
            "--fix-tries",
            "1",
            "--no-warm-up",
            "--run-dir",
            str(fix_dir),
            "--",
            PY,
            "job.py",
            "--steps",
            "8",
            "--index-size",
            "60000",
            "--results",
            str(elsewhere / "results.txt"),
        ],
        cwd=proj,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (_hashes(proj, skip=str(fix_dir)), _hashes(elsewhere)) == before
    fix = json.loads((fix_dir / "fix.json").read_text())
    assert fix["arms"] and fix["arms"][0]["mechanism"] == "source"  # run from the scratch copy
    assert fix["confinement"]["method"] == "namespace"
    said = " ".join(proc.stderr.split())  # the terminal wraps lines
    assert "runs the job up to 4 times" in said and "not confined: what the job sends" in said
    # every arm wrote into its own folder; none of it stays (--keep-outputs was not given)
    if fix["best"]:
        wrote = {os.path.relpath(p, tmp_path) for p in fix["confinement"]["outputs"]}
        # (big.bin beside the script is the scratch copy's: the candidate runs the copy)
        assert {"proj/ckpt.pt", "proj/out/final.txt", "elsewhere/results.txt"} <= wrote
        assert "--keep-outputs copies the kept arm's into place" in said
    for folder, dirs, _ in os.walk(fix_dir):
        assert "captured" not in dirs, folder
    # the scratch copy holds no link back to a file of the user's tree
    for folder, _, files in os.walk(fix_dir / "scratch"):
        for name in files:
            assert not os.path.islink(os.path.join(folder, name)), name


def _run(command, run_dir, options):
    """A run_job without the recorder: the command under the arm's wrap, in its cwd."""
    env = dict(os.environ, **(options.extra_env or {}))
    wrap = list(options.wrap or [])
    return subprocess.run(wrap + command, cwd=options.cwd, env=env, capture_output=True, text=True)


WRITER = """
import os, sys
tag = sys.argv[1]
open("ckpt.pt", "w").write(tag)
os.makedirs("out", exist_ok=True)
open("out/final.txt", "w").write(tag)
open(sys.argv[2], "a").write(tag + "\\n")
open("big.bin", "ab").write(tag.encode())
if sys.argv[3:] == ["--write-in-root"]:
    try:
        open("/traindx-confine-probe-" + tag, "w").write(tag)
        print("root-write: made")
    except OSError as exc:
        print("root-write:", exc.strerror)
open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "t-" + tag), "w").write(tag)
"""


@needs_namespace
def test_each_arm_writes_into_its_own_view_and_the_kept_ones_outputs_are_kept_on_request(tmp_path):
    proj, elsewhere = _user_tree(tmp_path)
    (proj / "writer.py").write_text(WRITER)
    root = proj / "runs" / "fix"
    root.mkdir(parents=True)
    before = _hashes(elsewhere), _hashes(proj, skip=str(root))
    said = []
    confiner = fix_confine.Confiner(str(root), str(proj))
    run = confiner.wrap_runner(_run, lambda kind, text="", **data: said.append((kind, text)))
    results = str(elsewhere / "results.txt")
    arms = {}
    for tag in ("A", "B"):
        arm = root / tag
        arm.mkdir()
        argv = [sys.executable, "writer.py", tag, results, "--write-in-root"]
        proc = run(argv, str(arm), Options(cwd=str(proj)))
        assert proc.returncode == 0, proc.stderr
        # a write where no overlay goes (a file in /) is refused or captured, never made
        assert not os.path.exists(f"/traindx-confine-probe-{tag}"), proc.stdout
        arms[tag] = str(arm)
    assert (_hashes(elsewhere), _hashes(proj, skip=str(root))) == before
    out = confiner.finish(arms["B"], keep_outputs=True, say=lambda *a, **k: None)
    assert not any(os.path.exists(os.path.join(arm, "captured")) for arm in arms.values())
    assert (proj / "ckpt.pt").read_text() == "B" and (proj / "out" / "final.txt").read_text() == "B"
    assert (elsewhere / "results.txt").read_text() == "line 0\nB\n"  # one line: the kept arm's
    big = (proj / "big.bin").read_bytes()
    assert big.endswith(b"B") and len(big) == 3 * 2**20 + 1  # B's one append, not A's
    assert str(proj / "ckpt.pt") in out["kept_outputs"]


@needs_namespace
def test_the_view_passes_the_exit_code_keeps_outside_sockets_and_refuses_what_it_cannot_make(tmp_path):
    server = socket.socket(socket.AF_UNIX)  # a service of the machine's (a Ray cluster, X, PMIx)
    server.bind(str(tmp_path / "service.sock"))
    server.listen(1)
    threading.Thread(target=lambda: server.accept()[0].sendall(b"hello"), daemon=True).start()
    confiner = fix_confine.Confiner(str(tmp_path / "fix"), str(tmp_path))
    (tmp_path / "fix" / "arm").mkdir(parents=True)
    options = confiner.prepare(
        str(tmp_path / "fix" / "arm"), Options(cwd=str(tmp_path)), lambda *a, **k: None
    )
    client = "import socket, sys; c = socket.socket(socket.AF_UNIX); c.connect(sys.argv[1]); print(c.recv(5))"
    proc = _run(
        [sys.executable, "-c", client + "; raise SystemExit(7)", str(tmp_path / "service.sock")],
        None,
        options,
    )
    assert proc.returncode == 7 and "b'hello'" in proc.stdout, proc.stderr
    bad = [*options.wrap[:-2], json.dumps({"overlays": [["/nonexistent-x", "/nonexistent-u", "/n-w"]]}), "--"]
    proc = subprocess.run([*bad, "true"], capture_output=True, text=True)
    assert proc.returncode == 126 and len(proc.stderr.strip().splitlines()) == 1
    assert "the job was not started" in proc.stderr and "Traceback" not in proc.stderr


def test_without_a_user_namespace_each_arm_runs_in_a_private_copy(tmp_path):
    proj, elsewhere = _user_tree(tmp_path)
    (proj / "writer.py").write_text(WRITER)
    root = proj / "runs" / "fix"
    (root / "A").mkdir(parents=True)
    said = []
    confiner = fix_confine.Confiner(str(root), str(proj), method="copy", why="a test")
    assert "private copy" in confiner.notice(3)[0][1] and "up to 3 times" in confiner.notice(3)[0][1]
    options = confiner.prepare(str(root / "A"), Options(cwd=str(proj)), lambda *a, **k: None)
    assert options.cwd.startswith(str(root / "A")) and options.extra_env["TMPDIR"].startswith(str(root))
    for folder, _, files in os.walk(options.cwd):
        for name in files:
            path = os.path.join(folder, name)
            original = proj / os.path.relpath(path, options.cwd)
            assert not os.path.islink(path) and os.stat(path).st_ino != os.stat(original).st_ino
    proc = _run([sys.executable, "writer.py", "A", str(proj / "ckpt.pt")], None, options)
    assert proc.returncode == 0, proc.stderr
    confiner.after(str(root / "A"), lambda kind, text="", **d: said.append((kind, text)))
    assert (proj / "out" / "final.txt").read_text() == "the user's own result\n"
    # the absolute path into the user's tree is not confinable this way: said after the arm
    assert any(kind == "warning" and "ckpt.pt" in text for kind, text in said), said


def test_a_scratch_copy_never_links_a_large_file_back_to_the_users(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    (tree / "job.py").write_text("print(1)\n")
    scratch.copy_tree(str(tree), str(tmp_path / "copy"))
    copy = tmp_path / "copy" / "big.bin"
    assert not copy.is_symlink() and os.stat(copy).st_ino != os.stat(tree / "big.bin").st_ino
    with open(copy, "ab") as f:
        f.write(b"x")
    assert os.path.getsize(tree / "big.bin") == 3 * 1024 * 1024


def test_the_view_covers_every_writable_folder_and_a_working_folder_with_a_mount_below(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    for sub in ("data", "src"):
        (proj / sub).mkdir(parents=True)
    table = [
        fix_confine.Mount("/", "ext4", True),
        fix_confine.Mount("/proc", "proc", True),
        fix_confine.Mount("/dev", "devtmpfs", True),
        fix_confine.Mount("/dev/shm", "tmpfs", True),
        fix_confine.Mount(str(proj / "data"), "xfs", True),  # a data volume mounted in the job's folder
    ]
    zones = fix_confine.plan_zones(table, str(proj))
    assert {str(proj / "data"), str(proj / "src")} <= set(zones.overlays)
    assert str(proj) in zones.tops and str(proj) not in zones.overlays  # its own files: a private copy
    assert all(str(proj) == top or str(proj).startswith(top + "/") for top in zones.tops)  # its parents
    assert not any(z == "/proc" or z.startswith(("/proc/", "/dev/")) for z in zones.overlays)
    assert zones.tmpfs == ["/dev/shm"] and zones.readonly == ["/"]
    # a writable folder above the working one gets a private copy of its own files too
    above = fix_confine.plan_zones(table, str(proj / "src"))
    assert str(tmp_path) in above.partial and str(tmp_path) in above.tops
    monkeypatch.setattr(fix_confine, "mounts", lambda: table)
    notice = fix_confine.Confiner(str(proj / "src" / "runs"), str(proj / "src"), method="namespace").notice(4)
    assert not any("holds a mount below it" in text for _, text in notice)


INNER = """
import subprocess, sys
from traindx.fixing.run import confine as fix_confine
from traindx.profiler.launcher import Options
proj, arm = sys.argv[1], sys.argv[2]
confiner = fix_confine.Confiner(proj + "/runs/fix", proj)
assert confiner.method == "namespace", confiner.why
options = confiner.prepare(arm, Options(cwd=proj), lambda *a, **k: None)
job = "echo new > ckpt.pt && mkdir out && echo f > out/final.txt && echo more >> data/shard.txt && cat data/shard.txt"
proc = subprocess.run(options.wrap + ["sh", "-c", job], cwd=proj, capture_output=True, text=True)
print(proc.returncode, proc.stdout.split(), proc.stderr)
confiner.after(arm, lambda *a, **k: None)
print(sorted(real[len(proj) + 1 :] for real, _ in fix_confine.captured_files(arm)))
"""


@needs_namespace
@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) here")
def test_a_working_folder_with_a_data_volume_mounted_below_is_confined_too(tmp_path):
    """The job's folder holds a mount (a container's data volume): its own files come from a
    private copy bound over it, the volume is overlaid; nothing of either changes."""
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "ckpt.pt").write_text("the user's own checkpoint\n")
    arm = proj / "runs" / "fix" / "A"
    arm.mkdir(parents=True)
    volume = "mount -t tmpfs tmpfs data && echo shard > data/shard.txt && "
    outer = f'{volume}exec "$0" -c "$1" "$2" "$3"'  # the volume is an inherited (locked) mount inside
    proc = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", outer, sys.executable, INNER, str(proj), str(arm)],
        cwd=proj,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stderr
    ran, captured = proc.stdout.strip().splitlines()[-2:]
    assert ran.startswith("0 ['shard', 'more']"), proc.stdout
    assert captured == str(sorted(["ckpt.pt", "out/final.txt", "data/shard.txt"]))
    assert (proj / "ckpt.pt").read_text() == "the user's own checkpoint\n" and not (proj / "out").exists()


ABOVE = """
import subprocess, sys
from traindx.fixing.run import confine as fix_confine
from traindx.profiler.launcher import Options
proj, arm, scratch = sys.argv[1:4]
confiner = fix_confine.Confiner(proj + "/runs/fix", proj)
assert confiner.method == "namespace", confiner.why
print([text for _, text in confiner.notice(3) if "holds a mount below it" in text])
options = confiner.prepare(arm, Options(cwd=proj), lambda *a, **k: None)
job = f"echo x > {scratch}/x.txt && echo y >> {scratch}/vol/y.txt && cat {scratch}/x.txt {scratch}/vol/y.txt"
proc = subprocess.run(options.wrap + ["sh", "-c", job], cwd=proj, capture_output=True, text=True)
print(proc.returncode, proc.stdout.split(), proc.stderr.strip().splitlines()[-1:])
confiner.after(arm, lambda *a, **k: None)
print(sorted(real[len(scratch) + 1 :] for real, _ in fix_confine.captured_files(arm)))
"""


@needs_namespace
@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) here")
def test_a_writable_folder_outside_the_tree_with_a_mount_below_stays_writable_in_the_view(tmp_path):
    """/tmp with a tmpfs mounted below it (fault pass 3, row 53): its own files were read-only in
    the view, so a job writing /tmp/x failed under --fix and not bare. Its files now come from a
    private copy bound over it (like the working folder's), the mount below overlaid."""
    proj, scratch = tmp_path / "proj", tmp_path / "scratch"
    (scratch / "vol").mkdir(parents=True)
    (proj / "runs" / "fix" / "A").mkdir(parents=True)
    (scratch / "x.txt").write_text("the user's x\n")
    outer = 'mount -t tmpfs tmpfs "$4/vol" && echo vol > "$4/vol/y.txt" && exec "$0" -c "$1" "$2" "$3" "$4"'
    args = [sys.executable, ABOVE, str(proj), str(proj / "runs" / "fix" / "A"), str(scratch)]
    proc = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", outer, *args],
        cwd=proj,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stderr
    notice, ran, captured = proc.stdout.strip().splitlines()[-3:]
    assert str(scratch) not in notice  # nothing stays read-only there
    assert ran.startswith("0 ['x', 'vol', 'y']"), proc.stdout
    assert captured == str(["vol/y.txt", "x.txt"])
    assert (scratch / "x.txt").read_text() == "the user's x\n" and not (scratch / "vol" / "y.txt").exists()


@needs_namespace
def test_what_runs_before_an_arm_in_its_name_writes_into_its_view_never_the_users_cache(tmp_path):
    """The kernel-cache warm-up of a --fix arm wrote the user's real cache (the one write
    outside the run folder): it runs in the arm's view now, the arm's job sees its kernels, the
    user's cache is unchanged, and the kernels are the arm's outputs (kept on request)."""
    cache, arm = tmp_path / "cache", tmp_path / "fix" / "A"
    cache.mkdir()
    arm.mkdir(parents=True)
    confiner = fix_confine.Confiner(str(tmp_path / "fix"), str(tmp_path))
    runner = confiner.wrap_runner(
        lambda command, run_dir, options: _run(command, None, options).stdout, print
    )
    warm = subprocess.run([*runner.view_for(str(arm)), "sh", "-c", f"echo kernel > {cache}/k.o"])
    assert warm.returncode == 0
    assert runner(["cat", str(cache / "k.o")], str(arm), Options(cwd=str(tmp_path))) == "kernel\n"
    assert os.listdir(cache) == []
    assert [real for real, _ in fix_confine.captured_files(str(arm))] == [str(cache / "k.o")]
