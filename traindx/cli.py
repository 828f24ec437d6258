"""`diagnose`: one module per subcommand (traindx.commands.*), each with prepare_parser/run.

`diagnose [options] -- <command>` runs a job; `diagnose <subcommand> ...` does the rest.
"""
import argparse
import importlib
import sys
import warnings

from traindx.errors import UserError

SUBCOMMANDS = {
    "attach": "attach",
    "analyze": "analyze",
    "report": "report",
    "compare": "compare",
    "card": "card",
    "merge": "merge",
}
DEFAULT = "run"


def _parser_for(name):
    module = importlib.import_module(f"traindx.commands.{name}")
    prog = "diagnose" if name == DEFAULT else f"diagnose {name}"
    parser = argparse.ArgumentParser(prog=prog, description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.prepare_parser(parser)
    return module, parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    name = SUBCOMMANDS.get(argv[0], DEFAULT) if argv else DEFAULT
    if name != DEFAULT:
        argv = argv[1:]
    module, parser = _parser_for(name)
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.formatwarning = lambda msg, *a, **k: f"diagnose: warning: {msg}\n"
            return module.run(args, parser)
    except UserError as exc:
        print(f"diagnose: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("diagnose: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
