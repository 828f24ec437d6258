"""Watch a run folder that is still being written (from another terminal or node): the live
status and each stable finding as `diagnose` shows them; exits when the run ends.

usage: diagnose watch RUN
"""

import os
import time

from traindx.common.errors import UserError


def prepare_parser(parser):
    parser.add_argument("run_dir", metavar="RUN", help="the run folder (or a multi-node run)")
    parser.add_argument(
        "--poll", type=float, default=1.0, metavar="S", help="seconds between looks at the folder (default 1)"
    )


def run(args, parser):
    from traindx.analyzers.live import LiveJudge, LiveOptions, run_is_live
    from traindx.report.live_view import LiveView

    run_dir = os.path.abspath(args.run_dir)
    if not os.path.isdir(run_dir):
        raise UserError(f"no such run folder: {args.run_dir}")
    if not (
        os.path.isfile(os.path.join(run_dir, "manifest.json"))
        or os.path.isdir(os.path.join(run_dir, "nodes"))
    ):
        raise UserError(f"{args.run_dir} is not a traindx run (no manifest.json, no nodes/)")
    if not args.poll > 0:
        raise UserError("--poll must be > 0 seconds")
    view = LiveView()
    judge = LiveJudge(
        run_dir, LiveOptions(poll_s=args.poll), on_finding=view.on_finding, on_state=view.on_state
    )
    with view:
        while run_is_live(run_dir):
            judge.step_once()
            time.sleep(args.poll)
        judge.step_once(force=True)  # the finished record, once
    state = judge.state
    print(
        f"diagnose watch: the run ended after {state.step} steps; "
        f"{len(state.stable)} finding(s) shown; report: {os.path.join(run_dir, 'report.html')}"
    )
    return 0
