"""Finding a job's Python rank processes in /proc as they start (torchrun workers included)."""
import os

LAUNCHER_MARKERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def _read(path, mode="r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def children_map():
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        if not stat:
            continue
        # comm may contain spaces and parentheses: ppid follows the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def cmdline(pid):
    raw = _read(f"/proc/{pid}/cmdline", "rb")
    return [] if not raw else [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def environ(pid):
    raw = _read(f"/proc/{pid}/environ", "rb")
    env = {}
    for item in (raw or b"").split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def is_python(pid):
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False
    return exe.startswith("python") or exe.startswith("pypy")


def is_launcher(argv):
    joined = " ".join(argv)
    return any(m in joined for m in LAUNCHER_MARKERS)


def rank_processes(root_pid):
    """{pid: rank} for the Python processes under root_pid that run a rank: the top-most Python
    process on each branch, skipping torchrun-style launchers (their workers carry RANK)."""
    children = children_map()
    found = {}
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        if is_python(pid):
            argv = cmdline(pid)
            if not is_launcher(argv):
                found[pid] = environ(pid).get("RANK", "0")
                continue  # its own children are DataLoader workers and the like
        stack.extend(children.get(pid, []))
    return found
