"""Run import-linter (pyproject.toml [tool.importlinter]) on traindx as it is installed.

traindx's subpackages live beside traindx/ in the repository (profiler/, analyzers/, ... mapped
by setuptools' package-dir), where grimp cannot find them from traindx/ itself. So this lays out
the installed tree as symlinks in a temporary folder, puts it first on sys.path and runs
lint-imports there. Exit code: lint-imports' own."""
import os
import sys
import tempfile

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lay_out(folder):
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    top = os.path.join(folder, "traindx")
    os.makedirs(top)
    for name in os.listdir(os.path.join(ROOT, package_dir["traindx"])):
        if name != "__pycache__":
            os.symlink(os.path.join(ROOT, package_dir["traindx"], name), os.path.join(top, name))
    for package, where in package_dir.items():
        if package != "traindx":  # traindx.profiler -> <folder>/traindx/profiler
            os.symlink(os.path.join(ROOT, where), os.path.join(folder, *package.split(".")))


def main():
    with tempfile.TemporaryDirectory(prefix="traindx-imports-") as folder:
        lay_out(folder)
        sys.path.insert(0, folder)
        os.chdir(folder)  # lint-imports puts the working folder first on sys.path
        from importlinter.cli import lint_imports_command

        sys.argv = ["lint-imports", "--no-cache", "--config", os.path.join(ROOT, "pyproject.toml"),
                    *sys.argv[1:]]
        try:
            lint_imports_command()
        except SystemExit as exc:
            return exc.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
