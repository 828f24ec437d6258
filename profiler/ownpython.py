"""The command line of a Python process of traindx's own (the output relay): the interpreter
diagnose runs on, its site set up as usual (site-packages, .pth files, so traindx imports), but
no `sitecustomize` or `usercustomize`. Those are the job's start-up code (a PYTHONPATH folder of
the job's, a user's site): run in the relay, their output would land in the job's stdout."""

from __future__ import annotations

import sys

# -S: site not imported at start; it is then run by hand with both customize modules already
# present (empty), so `import sitecustomize` inside it finds ours and runs nothing
_BOOT = (
    "import sys, types\n"
    "for _name in ('sitecustomize', 'usercustomize'):\n"
    "    sys.modules[_name] = types.ModuleType(_name)\n"
    "import site\n"
    "site.main()\n"
    "import runpy\n"
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n"
)


# -P: not the working folder first on sys.path (a job's token.py or json.py there is the job's,
# never ours); Python 3.10 has no -P
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


def module_command(module: str, *args: str) -> list[str]:
    """`python -m module args` as a process of traindx's own (no customize module of the job's,
    no module of the job's folder)."""
    return [sys.executable, "-S", *SAFE_PATH, "-c", _BOOT, module, *args]
