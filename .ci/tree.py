"""traindx as it is installed, laid out as symlinks in a folder, for tools that walk a package's
folder (grimp for lint-imports, mypy): in the repository its subpackages sit beside traindx/
(profiler/, derive/, analyzers/, ... mapped by setuptools' package-dir in pyproject.toml)."""

import os

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lay_out(folder: str) -> None:
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
