"""kernel-cache: precompile FlashAttention-4 kernels into FA4's own persistent cache, and manage it.

  kernel-cache warm --spec hd=128,hq=16,hkv=4,causal,varlen --arch sm_90   compile before training
  kernel-cache warm --model path/config.json --varlen --arch sm_100
  kernel-cache warm --from-run runs/<id>                 replay the FA4 compiles a run recorded
  kernel-cache env                                       the two exports a job needs
  kernel-cache ls | verify | pack FILE | unpack FILE | clear

On a machine without a GPU, compiles run under torch's FakeTensorMode for the --arch given; on a
GPU, for that GPU. A job uses the cache with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 (and the
same FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, if one was given here).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from traindx.common import argtypes, stdfds
from traindx.common.errors import UserError
from traindx.common.termsafe import safe_std_streams
from traindx.kernel_cache.cli import manage, triton_warm
from traindx.kernel_cache.cli import spec as specs
from traindx.kernel_cache.cli.output import PROG
from traindx.kernel_cache.cli.warm_command import run_warm_all
from traindx.kernel_cache.store import cache as store


def _arch_argument(text: str) -> str:
    """--arch: an arch FA4 builds for (kernel_cache.spec.arch_number decides); one line else."""
    try:
        specs.arch_number(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# -- warm ------------------------------------------------------------------------------------------
def prepare_warm(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("what to compile (any combination)")
    src.add_argument("--from-run", metavar="RUN", help="replay the FA4 compiles a `diagnose` run recorded")
    src.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="FIELDS",
        help="attention shape, e.g. hd=128,hq=16,hkv=4,dtype=bf16,causal,varlen (repeatable; see below)",
    )
    src.add_argument(
        "--model",
        type=argtypes.existing_file,
        metavar="CONFIG",
        help="an HF config.json (Llama, Qwen3, Qwen3-MoE, Qwen3.5 hybrid, ...)",
    )
    src.add_argument(
        "--int-max-seqlen",
        action="store_true",
        help="--from-run: replay a max_seqlen the run passed as a tensor as a Python int "
        "(tokens / sequences), i.e. compile for the job once it is fixed",
    )
    shp = p.add_argument_group("shape options")
    shp.add_argument(
        "--seqlens",
        metavar="N,LO-HI",
        help="sequence lengths and ranges (default 4096; varlen: 8-4096; see below)",
    )
    shp.add_argument("--varlen", action="store_true", help="--model: packed sequences (varlen)")
    shp.add_argument("--no-causal", action="store_true", help="--model: bidirectional attention")
    shp.add_argument(
        "--dtype", choices=["bf16", "fp16"], help="--model: attention dtype (default: the config's)"
    )
    shp.add_argument("--deterministic", action="store_true", help="--model: deterministic backward")
    shp.add_argument(
        "--batch", type=argtypes.positive_int, metavar="N", help="--model: sequences per (packed) batch"
    )
    shp.add_argument(
        "--tp",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="--model: tensor-parallel size (splits heads)",
    )
    shp.add_argument("--fwd-only", action="store_true", help="--model: forward kernels only (inference)")
    tgt = p.add_argument_group("target")
    tgt.add_argument(
        "--arch",
        type=_arch_argument,
        help="GPU arch the cache is for: sm_90 (H100/H200), sm_100 (B200), sm_103 (B300), ... "
        "(default: the run's, else this machine's GPU)",
    )
    tgt.add_argument(
        "--num-sms",
        type=argtypes.positive_int,
        metavar="N",
        help="SM count of the target GPU (default: by arch/GPU)",
    )
    tgt.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="cpu: compile under FakeTensorMode; cuda: with real tensors on this GPU "
        "(auto: cuda when a GPU of the target arch is visible)",
    )
    tgt.add_argument(
        "--jobs",
        "-j",
        type=argtypes.positive_int,
        metavar="N",
        help="compiler processes (default: CPUs, at most 8)",
    )
    tgt.add_argument(
        "--dry-run", action="store_true", help="list the work items and the target; compile nothing"
    )
    triton_warm.add_arguments(p)
    p.epilog = specs.SPEC_HELP + "\n\n" + (specs.__doc__ or "").split("\n\n", 2)[2]


Prepare = Callable[[argparse.ArgumentParser], object]
Run = Callable[[argparse.Namespace], "int | None"]

COMMANDS: dict[str, tuple[Prepare, Run, str]] = {
    "warm": (prepare_warm, run_warm_all, "precompile FA4 kernels into FA4's persistent cache"),
    "env": (
        lambda p: p.add_argument("--dir", action="store_true", help="print only the cache dir"),
        manage.run_env,
        "print the exports that make a job use the cache",
    ),
    "ls": (
        lambda p: p.add_argument("--entries", action="store_true", help="list every entry"),
        manage.run_ls,
        "list cache folders, entries, sizes and which environment each serves",
    ),
    "verify": (
        lambda p: p.add_argument("--delete-bad", action="store_true", help="delete entries that do not load"),
        manage.run_verify,
        "load every entry the way FA4 does; report the bad ones",
    ),
    "pack": (
        lambda p: (
            p.add_argument("tarball", type=argtypes.output_file, help="output .tar.gz"),
            p.add_argument("--all", action="store_true", help="also folders for other environments"),
        ),
        manage.run_pack,
        "write the cache for this environment into a tarball",
    ),
    "unpack": (
        lambda p: p.add_argument("tarball", type=argtypes.existing_file),
        manage.run_unpack,
        "extract a tarball from `pack` into the cache dir",
    ),
    "clear": (
        lambda p: p.add_argument(
            "--stale", action="store_true", help="only folders that do not serve this environment"
        ),
        manage.run_clear,
        "delete cache folders",
    ),
}


WRITES_CACHE = {"warm", "unpack", "clear"}


def build_parser() -> argtypes.ArgumentParser:
    parser = argtypes.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (prepare, _, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        # the commands that write into the cache dir need one they can create files in
        p.add_argument(
            "--cache-dir",
            metavar="DIR",
            type=argtypes.output_folder if name in WRITES_CACHE else argtypes.folder_path,
            help=f"the cache dir (default: ${store.DIR_VAR}, else FA4's default)",
        )
        prepare(p)
    return parser


def main(argv: list[str] | None = None) -> int | None:
    with safe_std_streams():  # no control sequence from a run or a pack reaches the terminal
        code = _main(argv)
    if argv is None:  # kernel-cache is the program: a reader that left ends it quietly
        stdfds.quiet_if_reader_left()
    return code


def _main(argv: list[str] | None) -> int | None:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.command:  # the help on stdout, and the one line that says what was wrong
        parser.print_help()
        print(f"{PROG}: error: a command is needed: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command][1](args)
    except UserError as exc:
        print(f"{PROG}: error: {argtypes.one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of traindx: one line (TRAINDX_DEBUG=1 shows the traceback)
        if os.environ.get("TRAINDX_DEBUG"):
            raise
        print(
            f"{PROG}: internal error: {type(exc).__name__}: {argtypes.one_line(exc)} "
            "(a bug of traindx; TRAINDX_DEBUG=1 shows where)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
