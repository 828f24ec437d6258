"""Fault rows of issue 48, Security: a run folder, a node's part and a kernel cache folder are
untrusted input (received from someone else, or on storage others can write), and what the job
prints is the job's. Nothing of theirs may become a path outside the folder, be written through
a planted link, run as native code from a folder someone else controls, reach the terminal as a
control sequence, or keep a secret in a file traindx writes. Inputs are built in code."""

import contextlib
import fcntl
import io
import json
import os
import pty
import shutil
import struct
import subprocess
import tarfile
import termios

import pytest
import test_kernel_cache
import test_multinode
from helpers import PY

from traindx.cli import main as cli
from traindx.common import atomic
from traindx.kernel_cache.cli import main as kernel_cache_cli
from traindx.kernel_cache.store import cache as store


def _diagnose(argv):
    """(exit code, stdout, stderr) of diagnose run in this process (fast: no interpreter start)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def _kernel_cache(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kernel_cache_cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _two_node_run(tmp_path, rank="0"):
    """RUN/nodes/{alpha,beta}: alpha's rank label is `rank`, with a py-spy file of its own."""
    run = tmp_path / "shared" / "run"
    run.mkdir(parents=True)
    alpha = test_multinode.write_node(run, "alpha", 0, [True, False], rank="0")
    events = alpha / "events" / "p4242.jsonl"
    events.write_text(events.read_text().replace('"rank": "0"', f'"rank": "{rank}"'))
    (alpha / "pyspy" / "p4242-evil.pth").write_text("import os; os.system('echo pwned')\n")
    test_multinode.write_node(run, "beta", 0, [False, True], rank="1", pid=77)
    return run


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_nodes_rank_label_that_is_a_path_writes_nothing_outside_the_run(tmp_path):
    # was: pyspy/../../outside/x-evil.pth, a .pth that ran at the next Python start
    run = _two_node_run(tmp_path, rank="../../outside/x")
    outside = tmp_path / "shared" / "outside"
    outside.mkdir()
    code, _, err = _diagnose(["merge", str(run), "--no-report"])
    assert code == 0, err
    assert os.listdir(outside) == [] and _files(tmp_path / "shared") == sorted(
        ["outside", "run", *(f"run/{p}" for p in _files(run))]
    )
    merged = os.listdir(run / "pyspy")
    assert len(merged) == 3 and all("/" not in n and not n.startswith(".") for n in merged), merged
    ranks = json.loads((run / "manifest.json").read_text())["ranks"]
    assert sorted(ranks) == ["1", "_.._outside_x"]


def test_merge_writes_through_no_planted_link_and_reads_none_of_a_part(tmp_path):
    run = _two_node_run(tmp_path)
    victim = tmp_path / "bashrc"
    victim.write_text("precious\n")
    (run / "log.txt").symlink_to(victim)  # was: the nodes' log lines appended to it
    (run / "nodes" / "alpha" / "log.txt").write_text("1800000000000000000 0 echo hacked\n")
    code, _, err = _diagnose(["merge", str(run), "--no-report"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "symbolic link" in err, err
    assert victim.read_text() == "precious\n"
    # a planted pyspy/ folder link is neither emptied nor written into
    (run / "log.txt").unlink()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep").write_text("kept")
    (run / "pyspy").symlink_to(theirs)
    code, _, err = _diagnose(["merge", str(run), "--no-report"])
    assert code == 2 and "symbolic link" in err and os.listdir(theirs) == ["keep"], err
    # a part's log.txt linked to a file of whoever merges is not copied into the merged log
    (run / "pyspy").unlink()
    secret = tmp_path / "id_rsa"
    secret.write_text("1800000000000000000 0 PRIVATE-KEY\n")
    (run / "nodes" / "beta" / "log.txt").symlink_to(secret)
    code, _, err = _diagnose(["merge", str(run), "--no-report"])
    assert code == 0, err
    assert "PRIVATE-KEY" not in (run / "log.txt").read_text()


def test_the_atomic_writer_refuses_links_and_paths_leaving_its_root(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True)
    (run / "out.txt").symlink_to(victim)
    (run / "linked").symlink_to(tmp_path)
    for path, root in (
        (run / "out.txt", None),
        (run / "linked" / "victim", run),
        (run / "sub" / ".." / ".." / "victim", run),
    ):
        try:
            atomic.write_text(path, "written", root=root)
        except atomic.LinkRefused:
            pass
        assert victim.read_text() == "precious", path
    # a link planted at the writer's temporary name is replaced, not written through
    target = run / "sub" / "f.txt"
    tmp = atomic._temporary_path(str(target))
    os.symlink(victim, tmp)
    atomic.write_text(target, "mine", root=run)
    assert victim.read_text() == "precious" and target.read_text() == "mine"
    assert sorted(os.listdir(run / "sub")) == ["f.txt"]


FP = "a" * 64  # a fingerprint folder (not this environment's: `--all` packs it, unpack takes it)


def _cache(folder):
    folder.mkdir(mode=0o700)
    return test_kernel_cache.fake_folder(folder, FP, versions={"python": "3.99"}, n=2)


def test_unpack_writes_no_kernel_through_a_planted_link(tmp_path):
    src = _cache(tmp_path / "src").parent
    tarball = tmp_path / "k.tar.gz"
    assert _kernel_cache(["pack", tarball, "--all", "--cache-dir", src])[0] == 0
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "libc.so").write_text("precious")
    for planted, target in ((f"{FP}/fwd", victim), (f"{FP}/fwd/{0:064x}.o", victim / "libc.so")):
        dst = tmp_path / f"dst{len(planted)}"
        dst.mkdir(mode=0o700)
        os.makedirs(dst / os.path.dirname(planted), exist_ok=True)
        os.symlink(target, dst / planted)
        code, _, err = _kernel_cache(["unpack", tarball, "--cache-dir", dst])
        assert code == 2 and len(err.strip().splitlines()) == 1 and "symbolic link" in err, err
        assert os.listdir(victim) == ["libc.so"] and (victim / "libc.so").read_text() == "precious"


def test_a_cache_folder_someone_else_controls_is_refused_in_one_line(tmp_path):
    cache = _cache(tmp_path / "cache").parent
    assert _kernel_cache(["ls", "--cache-dir", cache])[0] == 0
    os.chmod(cache, 0o777)  # anyone could plant a kernel there (FA4 loads them as native code)
    code, _, err = _kernel_cache(["ls", "--cache-dir", cache])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "writable by others" in err, err
    os.chmod(cache, 0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # a folder above it, writable by all and not sticky
    os.rename(cache, shared / "cache")
    code, _, err = _kernel_cache(["ls", "--cache-dir", shared / "cache"])
    assert code == 2 and "writable by others" in err and str(shared) in err, err
    if os.geteuid() != 0:
        pytest.skip("a folder owned by another user needs root to make")
    os.chown(shared / "cache", 65534, 65534)  # made first by another user (as in /tmp/<user>)
    os.chmod(shared, 0o755)
    code, _, err = _kernel_cache(["env", "--cache-dir", shared / "cache"])
    assert code == 2 and "owned by another user" in err, err


def test_pack_ships_only_kernels_and_round_trips_deduplicated_entries(tmp_path):
    folder = _cache(tmp_path / "src")
    (folder / ".env").write_text("HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123\n")
    (folder / "fwd" / "notes.txt").write_text("private")
    one, two = (folder / "fwd" / f"{i:064x}.o" for i in (0, 1))
    two.unlink()
    os.link(one, two)  # a deduplicated cache (hardlink, rdfind): one inode, two entries
    tarball = tmp_path / "k.tar.gz"
    code, _, err = _kernel_cache(["pack", tarball, "--all", "--cache-dir", folder.parent])
    assert code == 0, err
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
    names = sorted(m.name for m in members)
    assert names == sorted([f"{FP}/{store.METADATA_FILE}", f"{FP}/fwd/{0:064x}.o", f"{FP}/fwd/{1:064x}.o"]), (
        names
    )
    assert all(m.isfile() for m in members)
    dst = tmp_path / "dst"
    dst.mkdir(mode=0o700)
    code, _, err = _kernel_cache(["unpack", tarball, "--cache-dir", dst])
    assert "error" not in err, err
    assert (dst / FP / "fwd" / f"{1:064x}.o").read_bytes() == one.read_bytes()
    # a pack an earlier version made, with a link member for the deduplicated entry, is taken
    old = tmp_path / "old.tar.gz"
    with tarfile.open(old, "w:gz") as tar:
        tar.add(one, arcname=f"{FP}/fwd/{0:064x}.o")
        tar.add(two, arcname=f"{FP}/fwd/{1:064x}.o")
    with tarfile.open(old) as tar:
        assert tar.getmembers()[1].islnk()
    again = tmp_path / "again"
    again.mkdir(mode=0o700)
    code, _, err = _kernel_cache(["unpack", old, "--cache-dir", again])
    assert "error" not in err and (again / FP / "fwd" / f"{1:064x}.o").read_bytes() == one.read_bytes(), err
    # a pack that ships anything else is not taken
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        tar.add(folder / ".env", arcname=f"{FP}/.env")
    code, _, err = _kernel_cache(["unpack", evil, "--cache-dir", dst])
    assert code == 2 and "not a kernel-cache pack" in err and not (dst / FP / ".env").exists()


# -- what the job names and prints, shown and written by diagnose -----------------------------------
TOKEN = "hf_QwErTyUiOpAsDfGhJkLzXcVbNm123456"
PAYLOADS = (b"\x1b]52", b"\x1b]0;", b"\x1b[2J", b"\x9b")  # clipboard write, window title, clear screen
# the hot function's name holds OSC 52, OSC 0 and CSI 2J; its hot line a token and escape bytes
ESCAPE_JOB = (
    "import time\nimport torch\n\n\ndef work(seconds):\n    t0 = time.perf_counter()\n"
    f'    while time.perf_counter() - t0 < seconds: hub_token = "{TOKEN}"; bell = "\x1b]0;src\x07\x1b[2J"\n\n\n'
    '_n = "work\\x1b]52;c;cHduZWQ=\\x07\\x1b]0;owned\\x07\\x1b[2J"\n'
    "work.__code__ = work.__code__.replace(co_name=_n, co_qualname=_n)\n"
    "model = torch.nn.Linear(64, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    "for step in range(40):\n    loss = model(torch.randn(8, 64)).pow(2).mean()\n    opt.zero_grad()\n"
    "    loss.backward()\n    opt.step()\n    work(0.1)\n"
)


def _in_a_terminal(argv, cwd):
    """(exit code, every byte diagnose wrote to its terminal): stdout and stderr on one pty."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "TRAINDX_RUN_DIR"}
    proc = subprocess.Popen(
        [PY, "-m", "traindx", *argv], cwd=cwd, env=env, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(timeout=300), out


def _file_texts(folder):
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                yield os.path.join(root, name), f.read()


@pytest.mark.slow  # a real diagnose run of a job in a terminal, with py-spy
def test_the_jobs_control_sequences_and_token_reach_no_terminal_and_no_file(tmp_path):
    """Issue 48: OSC 52 / OSC 0 / CSI 2J in the hot function's name reached the live finding,
    the status, the verdict and the table raw; the token on the hot line stayed verbatim in
    findings.json and the live lines. One real job in a terminal."""
    (tmp_path / "job.py").write_text(ESCAPE_JOB)
    code, out = _in_a_terminal(["--run-dir", "run", "--no-nvml", "--", PY, "job.py"], tmp_path)
    assert code == 0, out[-3000:]
    assert b"work" in out and b"job.py:7" in out, out[-3000:]  # the finding is there, made safe
    assert not [p for p in PAYLOADS if p in out], out[-3000:]
    assert TOKEN.encode() not in out
    leaked = [path for path, data in _file_texts(tmp_path / "run") if TOKEN.encode() in data]
    assert leaked == []
    # a received folder's command, shown by `compare`
    for arm in ("a", "b"):
        shutil.copytree(tmp_path / "run", tmp_path / arm)
        manifest = json.loads((tmp_path / arm / "manifest.json").read_text())
        manifest["command"] = ["python", f"train_{arm}.py\x1b]52;c;cHduZWQ=\x07\x1b[2J", f"--token={TOKEN}"]
        manifest["start_ns"] += arm == "b"
        (tmp_path / arm / "manifest.json").write_text(json.dumps(manifest))
    code, out = _in_a_terminal(["compare", "a", "b"], tmp_path)
    assert code == 0 and b"train_a.py" in out, out[-3000:]
    assert not [p for p in PAYLOADS if p in out] and TOKEN.encode() not in out, out[-3000:]


def test_live_lines_status_and_plain_prints_are_made_safe_and_rich_keeps_its_colours():
    from traindx.report import live_view  # its Finding and LiveState wherever analyzers keep them

    name = "work\x1b]52;c;cHduZWQ=\x07\x1b]0;owned\x07\x1b[2J\x9b2J()"
    finding = live_view.Finding(
        id="host_work.loop",
        title=f"Host work in the training loop: {name}",
        severity="high",
        analyzer="host_work",
        evidence={"line": f'job.py:7 hub_token = "{TOKEN}"'},
    )
    state = live_view.LiveState(step=3, top=finding, analyses=1)
    shown = io.StringIO()
    view = live_view.LiveView(stream=shown, live=False)
    view.on_state(state)  # the status line
    view.on_finding(finding, state)  # the live finding
    text = shown.getvalue()
    assert "Host work in the training loop: work" in text and "job.py:7" in text, text
    assert not [p for p in PAYLOADS if p.decode("latin-1") in text] and TOKEN not in text, repr(text)
    # diagnose's own plain lines (warnings, paths) go through the same function
    from traindx.common.termsafe import safe_std_streams

    out = io.StringIO()
    with contextlib.redirect_stdout(out), safe_std_streams():
        print(f"diagnose: warning: {name} --token={TOKEN}")
    assert out.getvalue().startswith("diagnose: warning: work") and "\x1b" not in out.getvalue()
    assert TOKEN not in out.getvalue()
    # rich's own styles still reach a terminal
    coloured = io.StringIO()
    live_view.Console(file=coloured, force_terminal=True, color_system="standard").print(f"[bold]{name}[/]")
    assert coloured.getvalue().startswith("\x1b[1") and "work" in coloured.getvalue()  # bold, as asked
    assert "\x1b]" not in coloured.getvalue()


def test_every_json_and_text_file_written_is_redacted_by_the_one_writer(tmp_path):
    finding = {"evidence": {"source": f'hub_token = "{TOKEN}"'}, "steps": [1, 2], "lost": 0.02}
    atomic.write_json(tmp_path / "findings.json", [finding], indent=2)
    atomic.write_text(tmp_path / "card.yaml", f"name: x\nurl: https://user:{TOKEN}@example.com/x\n")
    for name in ("findings.json", "card.yaml"):
        assert TOKEN not in (tmp_path / name).read_text(), name
    assert json.loads((tmp_path / "findings.json").read_text())[0]["steps"] == [1, 2]


def test_a_received_folders_planted_tables_link_is_neither_emptied_nor_written(tmp_path, monkeypatch):
    # was: the event cache's rmtree + rename went through RUN/tables -> the reader's folder,
    # deleting what was there (tables/events/) and leaving our Parquet files in its place
    import traindx

    monkeypatch.setenv("TRAINDX_CACHE", "1")  # the cache is written for large runs only
    folder = test_multinode.write_node(tmp_path, "alpha", 0, [True, False], rank="0")
    victim = tmp_path / "victim"
    (victim / "events").mkdir(parents=True)
    (victim / "events" / "thesis.tex").write_text("four years")
    (folder / "tables").symlink_to(victim)
    # a folder holding a link is refused as a whole (common/untrusted.py), before any cache
    from traindx.common.errors import UserError

    with pytest.raises(UserError, match="symbolic link"):
        traindx.load_run(str(folder))
    assert os.listdir(victim / "events") == ["thesis.tex"]


def test_the_verdicts_diff_shows_the_hot_line_without_its_escapes_or_token():
    from traindx.report import terminal

    hot = f'-    while busy(): hub_token = "{TOKEN}"; bell = "\x1b]0;src\x07\x1b[2J"'
    verdict = {
        "kind": "change",
        "headline": "Move the work out of the loop",
        "gain_s": None,
        "text": f"--- a/job.py\n+++ b/job.py\n{hot}\n+    pass",
        "finding_title": "Host work in the training loop: work\x1b]52;c;cHduZWQ=\x07()",
    }
    shown = io.StringIO()
    terminal._print_verdict(terminal.Console(file=shown, width=200), verdict)
    text = shown.getvalue()
    assert "while busy(): hub_token" in text and "Host work in the training loop: work" in text, text
    assert not [p for p in PAYLOADS if p.decode("latin-1") in text] and TOKEN not in text, repr(text)


def test_a_fix_arm_never_runs_with_a_cache_folder_someone_else_controls(tmp_path):
    from types import SimpleNamespace

    from traindx.fixing.run import arm as fix_arm  # the --fix arm's warm-up

    cache = _cache(tmp_path / "cache").parent
    os.chmod(cache, 0o777)
    plan, said = SimpleNamespace(warnings=[]), []
    cand_env = {store.ENABLE_VAR: "1", store.DIR_VAR: str(cache)}
    got = fix_arm._precompile(plan, str(tmp_path / "run"), cand_env, lambda *a: said.append(a), [])
    assert cand_env[store.ENABLE_VAR] == "0" and got["exit_code"] is None
    assert len(plan.warnings) == 1 and "writable by others" in plan.warnings[0]
