"""What the --fix test modules share: a finding with prescriptions, a line of a file, diagnose in this process."""

from traindx.analyzers.core.findings import Finding


def _finding(id_, *prescriptions, severity="high"):
    return Finding(id=id_, title=id_, severity=severity, analyzer="test", prescriptions=tuple(prescriptions))


def _line_of(path, text):
    with open(path, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def _cli(*argv):
    """`diagnose <argv>` run in this process, as a CompletedProcess (returncode, stdout, stderr):
    a subcommand that reads run folders (compare, card) needs no Python start of its own."""
    import contextlib
    import io
    import subprocess

    from traindx.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return subprocess.CompletedProcess(["diagnose", *argv], code, out.getvalue(), err.getvalue())
