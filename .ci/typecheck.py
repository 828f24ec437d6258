"""Run mypy (pyproject.toml [tool.mypy]) over the whole traindx package as it is installed (the
symlinked tree of .ci/tree.py), so that imports between its subpackages are followed and checked.
Extra arguments go to mypy. Exit code: mypy's own."""

import os
import re
import sys
import tempfile

import tomllib
from mypy import api
from tree import ROOT, lay_out


def package_dirs() -> dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return dict(sorted(mapping.items(), key=lambda kv: -len(kv[0])))  # the longest first


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="traindx-types-") as folder:
        lay_out(folder)
        os.chdir(folder)
        out, err, code = api.run(
            ["--config-file", os.path.join(ROOT, "pyproject.toml"), "-p", "traindx", *sys.argv[1:]]
        )
        # paths as the repository has them, not the temporary tree's
        out = out.replace(folder + os.sep, "")
        for package, where in package_dirs().items():
            out = re.sub(rf"(?m)^{re.escape(package.replace('.', '/'))}/", where + "/", out)
        sys.stdout.write(out)
        sys.stderr.write(err)
        return code


if __name__ == "__main__":
    sys.exit(main())
