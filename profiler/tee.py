"""The job's output path: a small process of its own between the job's pipes and the terminal
and log.txt, so that the job never writes into a pipe that `diagnose` itself reads.

Why a process of its own: a pipe read by diagnose dies with diagnose (SIGKILL, OOM): the job's
next print raises BrokenPipeError, and a daemon the job started dies the same way once diagnose
stops reading after the job's end. This process runs in its own session (a Ctrl-C or a kill of
diagnose does not reach it), holds the read ends of the job's stdout and stderr, and ends only
when every writer has closed them (the job and whatever it started), as the terminal would.

The job's bytes pass through unchanged: each read of a pipe goes on as it was read (binary
output, invalid UTF-8, a line of any length, a carriage return), never decoded on the way to the
terminal or to whatever the caller pipes diagnose into. While diagnose is there, each read goes
to diagnose over the socket as one frame (diagnose writes it, so the live status line stays
intact); when diagnose says it is done recording, or is gone without saying so, reads go
straight to the terminal (the stdout/stderr this process inherited from diagnose).

log.txt keeps, timestamped and redacted, the lines it can read as text: a line's bytes that are
not UTF-8 are shown as U+FFFD and the line says how many there were; a binary line is one note
of its size; a line past MAX_LINE_BYTES is logged in pieces (the terminal still gets it whole).
A write that fails (a full disk) stops the log with one message to diagnose; the output still
reaches the terminal. Nothing here may raise into the pipes' writers: every error is caught.

usage (by the launcher only): python -m traindx.profiler.tee OUT_FD ERR_FD SOCKET_FD
then one JSON line on the socket: {"log": path, "segment_bytes": n, "cap_bytes": n}
"""

import errno
import json
import os
import queue
import re
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from traindx.profiler import filetail, ownpython
from traindx.profiler.filetail import TAIL_S

if TYPE_CHECKING:  # annotations only: imported where the log opens
    from traindx.profiler.rolling import RollingLines

# a line longer than this without a newline is logged in pieces (memory stays bounded)
MAX_LINE_BYTES = 1 << 20
# frames on the socket, tee -> diagnose: one tag byte, the payload's length (4 bytes, big
# endian), the payload: b"o" / b"e" (the job's bytes as read), b"!" (a problem, UTF-8 text),
# b"=" (every writer has closed the job's pipes: no daemon holds them)
FRAME = struct.Struct(">cI")
PROBLEM = b"!"
CLOSED = b"="
DONE = b"done\n"  # diagnose -> tee: recording is over, print straight to the terminal from now
ENDED = b"ended\n"  # diagnose -> tee: the job has ended: read the files it wrote to one last time
JOB = re.compile(rb"job (\d+)\n")  # diagnose -> tee: the job's pid (files it writes itself are
# read until it ends, even when diagnose is gone: there is no end of pipe to tell)
READY = b"+\n"  # tee -> diagnose, once: reading the pipes from now
# diagnose -> tee: the reader of diagnose's stdout ("o") or stderr ("e") is gone (EPIPE): the
# job's end of that pipe is closed, so its next write fails as it would bare (a `| head`)
GONE = {"o": b"gone o\n", "e": b"gone e\n"}
# a line with more than this share of its characters not text is binary: logged as its size
BINARY_SHARE = 0.5
# lines waiting for the log (redaction costs ~40 us a line): a burst of output is not slowed
# by it; past this many batches (256 MiB at most), reading the pipes waits for the log
LOG_QUEUE_BATCHES = 4096  # each at most one 64 KiB read


def refused(exc: OSError) -> bool:
    """A write error that the job's own write would have met bare: the reader went away
    (EPIPE), or the file or device is full (ENOSPC, EDQUOT, EFBIG)."""
    return exc.errno in (errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def redactor(config: dict[str, Any]) -> Callable[[str], str]:
    """The function every logged line goes through (traindx/common/redact.py: one definition of a
    secret for everything traindx writes): the job's own secret values, sent over the socket
    (never on a command line or in an environment), then every token shape."""
    # imported here: the tee starts (and passes output through) whatever this import costs
    from traindx.common import redact

    return redact.Redactor(config.get("secret_values") or ()).line


def line_stream() -> Callable[[Callable[[str], str]], Callable[[str], str]]:
    """A maker of one stream's line redactor (what spans lines: a private key's body)."""
    # imported here, as in redactor()
    from traindx.common import redact

    return lambda one: redact.LineStream(one).line


def log_text(raw: bytes) -> str:
    """One line of the job's output as log.txt keeps it: its text, where bytes that are not
    UTF-8 and control characters (but tab, carriage return, escape) are shown as U+FFFD with a
    note of how many there were; a binary line (mostly such bytes) as a note of its size."""
    text = raw.decode("utf-8", "replace")
    if text.isprintable() and "\ufffd" not in text:
        return text
    unreadable = 0
    chars = []
    for ch in text:
        if ch.isprintable() and ch != "\ufffd" or ch in "\t\r\x1b":
            chars.append(ch)
        else:
            chars.append("\ufffd")
            unreadable += 1
    if not unreadable:
        return text
    if unreadable > len(text) * BINARY_SHARE:
        return f"[traindx: {len(raw)} bytes of binary output, not kept in log.txt]"
    plural = "s" if unreadable != 1 else ""
    return f"{''.join(chars)} [traindx: {unreadable} byte{plural} not text here, shown as \ufffd]"


class Tee:
    def __init__(self, out_fd: int, err_fd: int, sock: socket.socket | None, config: dict[str, Any]) -> None:
        self.streams = {err_fd: "e", out_fd: "o"}  # one pipe for both (2>&1): "o"
        self.partial = {out_fd: b"", err_fd: b""}
        # files the job writes to itself (tail_from): read fd -> the offset read up to
        tails = config.get("tail")
        tails = tails if isinstance(tails, dict) else {}
        self.files = {int(fd): int(offset) for fd, offset in tails.items() if int(fd) in self.streams}
        self.job: int | None = None  # a pidfd of the job, while files are read (_watch_job)
        self.terminal = {"o": 1, "e": 2}
        self.sock = sock
        self.redact = redactor(config)
        self._line_stream = line_stream()
        self._streams: dict[str, Callable[[str], str]] = {}  # per tag: a key spans lines
        self.cap = int(config.get("cap_bytes") or 0)
        self.unsupervised_bytes = 0  # written to the log with no roller keeping its budget
        self.supervised = sock is not None
        self.gone: set[str] = set()  # streams whose reader is gone (EPIPE)
        self._send_lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, str, list[bytes]] | None] = queue.Queue(LOG_QUEUE_BATCHES)
        self._writer: threading.Thread | None = None
        self.log: RollingLines | None = None
        if config.get("log"):
            try:
                # imported here: a failed import is one problem line; the output still passes
                from traindx.profiler import rolling

                self.log = rolling.RollingLines(config["log"], int(config.get("segment_bytes") or 0))
            except Exception as exc:
                self.problem(f"log.txt was not written: {_reason(exc)}")

    # -- to diagnose -------------------------------------------------------------------------
    def _send(self, tag: bytes, payload: bytes) -> bool:
        with self._send_lock:
            if self.sock is None:
                return False
            try:
                self.sock.sendall(FRAME.pack(tag, len(payload)) + payload)
                return True
            except OSError:
                self._detach_locked()
                return False

    def _detach(self) -> None:
        with self._send_lock:
            self._detach_locked()

    def _detach_locked(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None
        self.supervised = False

    def problem(self, text: str) -> None:
        self._send(PROBLEM, " ".join(text.split()).encode("utf-8", "replace"))

    # -- output --------------------------------------------------------------------------------
    def output(self, tag: str, chunk: bytes) -> None:
        """One read of the job's pipe, as it was read: to diagnose, else to the terminal."""
        if not self._send(tag.encode(), chunk):
            try:
                _write_all(self.terminal[tag], chunk)
            except OSError as exc:
                if refused(exc):  # its reader is gone, or its disk full: the job's next write fails, as bare
                    self.gone.add(tag)
                # else no terminal any more (hung up): the log still gets the lines

    def _drop(self, fd: int, sel: selectors.BaseSelector, t: int) -> None:
        """Stop reading one of the job's pipes (its end, or its reader's): close our end."""
        if self.partial[fd] and self.log is not None:
            self._queue.put((t, self.streams[fd], [self.partial[fd]]))
        self.partial[fd] = b""
        if self.files.pop(fd, None) is None:
            sel.unregister(fd)
        os.close(fd)
        del self.streams[fd]

    def _write_log(self) -> None:
        """The log writer thread: decodes, redacts and writes each queued line, in order."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            t, tag, raws = item
            if self.log is None:
                continue
            try:
                stream = self._streams.setdefault(tag, self._line_stream(self.redact))
                entry = "".join(f"{t} {tag} {stream(log_text(raw))}\n" for raw in raws)
                self.log.write(entry)
                if not self.supervised:
                    self.unsupervised_bytes += len(entry)
                    if self.cap and self.unsupervised_bytes > self.cap:
                        self._close_log()  # nothing rolls it any more: its budget is the end
            except Exception as exc:
                when = time.strftime("%H:%M:%S", time.localtime(t / 1e9))
                self._close_log()
                self.problem(
                    f"log.txt: the job's output from {when} on was not written "
                    f"({_reason(exc)}); it still reached the terminal"
                )

    def _close_log(self) -> None:
        log, self.log = self.log, None
        if log is not None:
            try:
                log.close()
            except Exception:
                pass

    def _read(self, fd: int, sel: selectors.BaseSelector) -> None:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        t = time.time_ns()
        tag = self.streams[fd]
        if not chunk:
            self._drop(fd, sel, t)
            return
        self.output(tag, chunk)
        if tag in self.gone:
            self._drop(fd, sel, t)
        self._log_chunk(fd, tag, chunk, t)

    def _tail(self) -> None:
        """What the job wrote to its files since the last read: to the log (not to the terminal:
        the bytes are where the job put them)."""
        for fd in list(self.files):
            while True:
                try:
                    chunk = os.pread(fd, 65536, self.files[fd])
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                self.files[fd] += len(chunk)
                self._log_chunk(fd, self.streams[fd], chunk, time.time_ns())

    def _end_tails(self, sel: selectors.BaseSelector) -> None:
        """The job has ended (or diagnose is gone): the files read one last time, then let go."""
        self._tail()
        for fd in list(self.files):
            self._drop(fd, sel, time.time_ns())

    def _log_chunk(self, fd: int, tag: str, chunk: bytes, t: int) -> None:
        if self.log is None or fd not in self.streams:
            return
        pending = self.partial[fd] + chunk
        *complete, rest = pending.split(b"\n")
        while len(rest) > MAX_LINE_BYTES:
            complete.append(rest[:MAX_LINE_BYTES])
            rest = rest[MAX_LINE_BYTES:]
        if complete:
            self._queue.put((t, tag, complete))
        self.partial[fd] = rest

    def _watch_job(self, pid: int, sel: selectors.BaseSelector) -> None:
        """Files the job writes itself: its end is seen here (a pidfd turns readable), so that
        they are read to the end though diagnose is killed before the job."""
        if not self.files or self.job is not None:
            return
        try:
            self.job = os.pidfd_open(pid)
        except (OSError, AttributeError):  # an old kernel: diagnose's word (or its end) only
            return
        sel.register(self.job, selectors.EVENT_READ)

    def _job_ended(self, sel: selectors.BaseSelector) -> None:
        assert self.job is not None
        sel.unregister(self.job)
        os.close(self.job)
        self.job = None
        self._end_tails(sel)

    def _control(self, sel: selectors.BaseSelector) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        for tag, message in GONE.items():
            if message in data:
                self.gone.add(tag)
                for fd in [fd for fd, name in self.streams.items() if name == tag]:
                    self._drop(fd, sel, time.time_ns())
        for pid in JOB.findall(data):
            self._watch_job(int(pid), sel)
        if ENDED in data or DONE in data or (not data and self.job is None):
            self._end_tails(sel)
        if not data or DONE in data:  # gone (killed) or done: the terminal directly from now
            sel.unregister(sock)
            self._detach()

    def run(self) -> None:
        # the reader gets the GIL back from the log writer's regexes quickly: the job's pipes
        # are drained at once whatever the redaction costs
        sys.setswitchinterval(0.0005)
        if self.log is not None:
            self._writer = threading.Thread(target=self._write_log, name="log", daemon=True)
            self._writer.start()
        sel = selectors.DefaultSelector()
        for fd in self.streams:
            if fd not in self.files:
                sel.register(fd, selectors.EVENT_READ)
        if self.sock is not None:
            sel.register(self.sock, selectors.EVENT_READ)
        while self.streams:
            for key, _ in sel.select(TAIL_S if self.files else None):
                try:
                    if self.sock is not None and key.fileobj is self.sock:
                        self._control(sel)
                    elif self.job is not None and key.fileobj == self.job:
                        self._job_ended(sel)
                    elif key.fd in self.streams:
                        self._read(key.fd, sel)
                except Exception as exc:  # never stop reading the job's pipes
                    self.problem(f"output relay: {_reason(exc)}")
            try:
                self._tail()
            except Exception as exc:
                self.problem(f"output relay: {_reason(exc)}")
        self._send(CLOSED, b"")
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
        self._close_log()
        self._detach()


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"


def _read_config(sock: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    try:
        config = json.loads(data.decode("utf-8", "replace") or "{}")
        return config if isinstance(config, dict) else {}
    except ValueError:
        return {}


class OutputRelay:
    """diagnose's side: starts the tee, gives the job the write ends of its pipes, hands what
    the tee forwards (the job's bytes, unchanged) to on_output, and lets go once the job has ended (not waiting for a daemon the job left
    holding its output)."""

    # after the job's end, the tee is waited for this long to reach the end of its pipes; past
    # it, whoever still holds them (a daemon the job started) goes on without diagnose
    DRAIN_S = 2.0
    START_TIMEOUT_S = 60.0
    LOG_DRAIN_S = 120.0  # the relay's log writer finishing a burst of output
    module = "traindx.profiler.tee"

    def __init__(
        self,
        log_path: str,
        segment_bytes: int,
        cap_bytes: int,
        on_output: Callable[[str, bytes], object],
        secret_values: Iterable[str] = (),
    ) -> None:
        self.config = {
            "log": log_path,
            "segment_bytes": segment_bytes,
            "cap_bytes": cap_bytes,
            "secret_values": list(secret_values),
        }
        self.on_output = on_output
        self.problems: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._pipes_closed = threading.Event()
        self._gone: set[str] = set()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> tuple[int, int]:
        """(stdout fd, stderr fd) for the job; raises OSError when no tee could start."""
        tails: dict[str, int] = {}  # a file's read end -> where the job's bytes start (filetail)
        out_r, out_w = filetail.channel(1, tails, filetail.channel_for)
        # stdout and stderr into one file or pipe (`2>&1 | tee`): one pipe for the job's both, so
        # that their order is the job's own; into one file: each its own descriptor, read once
        if filetail.same_sink(1, 2):
            err_r, err_w = (out_r, os.dup(2)) if tails else (out_r, out_w)
        else:
            err_r, err_w = filetail.channel(2, tails, filetail.channel_for)
        self.config["tail"] = tails
        mine, theirs = socket.socketpair()
        for end, opt in ((theirs, socket.SO_SNDBUF), (mine, socket.SO_RCVBUF)):
            try:  # room for the job's output while diagnose is busy (its live judge)
                end.setsockopt(socket.SOL_SOCKET, opt, 4 * filetail.PIPE_BYTES)
            except OSError:
                pass
        try:
            self.proc = subprocess.Popen(
                ownpython.module_command(self.module, str(out_r), str(err_r), str(theirs.fileno())),
                pass_fds=tuple({out_r, err_r, theirs.fileno()}),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            for fd in {out_w, err_w}:
                os.close(fd)
            mine.close()
            raise
        finally:
            for fd in {out_r, err_r}:
                os.close(fd)
            theirs.close()
        # the job starts only once the relay runs: a relay that died at start (not importable,
        # say) would leave the job's first print a broken pipe; the caller then lets the job
        # write to diagnose's own stdout/stderr instead
        try:
            mine.sendall(json.dumps(self.config).encode() + b"\n")
            mine.settimeout(self.START_TIMEOUT_S)
            ready = mine.recv(len(READY))
            mine.settimeout(None)
        except OSError:
            ready = b""
        if ready != READY:
            mine.close()
            for fd in {out_w, err_w}:
                os.close(fd)
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            raise OSError(f"the output relay did not start (exit code {self.proc.returncode})")
        self._sock = mine
        self._thread = threading.Thread(target=self._follow, name="traindx-output", daemon=True)
        self._thread.start()
        return out_w, err_w

    def _follow(self) -> None:
        try:
            self._relay()
        except (OSError, ValueError):
            pass  # the socket closed under it by finish(): the tee prints by itself

    def _relay(self) -> None:
        assert self._sock is not None  # start() set it
        with self._sock.makefile("rb") as frames:
            while True:
                head = frames.read(FRAME.size)
                if len(head) < FRAME.size:
                    return
                tag, size = FRAME.unpack(head)
                payload = frames.read(size)
                if tag == PROBLEM:
                    self.problems.append(payload.decode("utf-8", "replace"))
                elif tag == CLOSED:
                    self._pipes_closed.set()
                else:
                    self._pass(tag.decode(), payload)

    def _pass(self, tag: str, data: bytes) -> None:
        try:
            self.on_output(tag, data)
        except OSError as exc:
            if not refused(exc):
                self._write_elsewhere(tag, data)
                return
            # whoever read this stream is gone, or it cannot take more (/dev/full, a full
            # disk): the job hears it as bare, at its next write (as EPIPE)
            if tag not in self._gone:
                self._gone.add(tag)
                try:
                    assert self._sock is not None
                    self._sock.sendall(GONE[tag])
                except (OSError, AssertionError, KeyError):
                    pass
        except Exception:
            self._write_elsewhere(tag, data)

    @staticmethod
    def _write_elsewhere(tag: str, data: bytes) -> None:
        try:
            _write_all(1 if tag == "o" else 2, data)
        except OSError:
            pass

    def job_started(self, pid: int) -> None:
        """The job's pid, for the tee to see its end by itself (files the job writes itself)."""
        if self._sock is not None and self.config.get("tail"):
            try:
                self._sock.sendall(b"job %d\n" % pid)
            except OSError:
                pass

    def finish(self) -> None:
        """The job has ended: its last lines are printed, then the tee goes on by itself."""
        if self._thread is None or self._sock is None:
            return
        try:  # the files the job wrote to itself are read to their end now
            self._sock.sendall(ENDED)
        except OSError:
            pass
        self._pipes_closed.wait(self.DRAIN_S)
        if self._pipes_closed.is_set():  # no one else holds them: log.txt is complete soon
            self._thread.join(self.LOG_DRAIN_S)
        try:
            self._sock.sendall(DONE)
        except OSError:
            pass
        self._thread.join(5)  # the lines already on their way
        try:
            self._sock.close()
        except OSError:
            pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.returncode = 0  # it lives on by design: no "still running" warning


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # a Ctrl-C or a hang-up is for the job (diagnose forwards it); this ends with the pipes
    for name in ("SIGINT", "SIGHUP", "SIGTSTP", "SIGTTOU", "SIGTTIN"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    out_fd, err_fd, sock_fd = (int(a) for a in argv[:3])
    given = socket.socket(fileno=sock_fd)
    sock: socket.socket | None = given
    try:
        config = _read_config(given)
    except OSError:
        config = {}
    if not config.get("log"):  # diagnose died before it said where the log goes: pass through
        given.close()
        sock = None
    if sock is not None:
        try:
            sock.sendall(READY)  # before anything else goes to diagnose
        except OSError:
            sock.close()
            sock = None
    Tee(out_fd, err_fd, sock, config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
