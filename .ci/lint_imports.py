"""Run import-linter (pyproject.toml [tool.importlinter]) on traindx as it is installed (the
symlinked tree of .ci/tree.py: grimp walks a package's folder). Exit code: lint-imports' own."""

import os
import sys
import tempfile

from tree import ROOT, lay_out


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="traindx-imports-") as folder:
        lay_out(folder)
        sys.path.insert(0, folder)
        os.chdir(folder)  # lint-imports puts the working folder first on sys.path
        from importlinter.cli import lint_imports_command

        sys.argv = ["lint-imports", "--no-cache", os.path.join(ROOT, "pyproject.toml"), *sys.argv[1:]]
        try:
            lint_imports_command()
        except SystemExit as exc:
            return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
