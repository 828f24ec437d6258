"""What the --fix test modules share: a finding with prescriptions, a line of a file."""

from traindx.analyzers.core.findings import Finding


def _finding(id_, *prescriptions, severity="high"):
    return Finding(id=id_, title=id_, severity=severity, analyzer="test", prescriptions=tuple(prescriptions))


def _line_of(path, text):
    with open(path, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if text in line)
