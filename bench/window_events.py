"""Print the torch.profiler window's own record of a run (what it cost, why it stood down) and
the run's median step: `python bench/window_events.py RUN [RUN ...]`."""

import os
import sys

import traindx


def main(paths):
    for path in paths:
        run = traindx.load_run(path)
        ev = run.events
        steps = run.steps
        median = float(steps["duration_s"].iloc[1:].median()) if len(steps) > 1 else None
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        print(
            f"{os.path.basename(path)}: {len(steps)} steps, median step "
            f"{median if median is None else round(median, 4)} s, folder {size / 1e6:.2f} MB"
        )
        for row in ev[ev["type"].astype(str).str.startswith("torch_profile")].itertuples():
            fields = {
                k: v
                for k, v in row._asdict().items()
                if k
                in (
                    "type",
                    "step",
                    "first_step",
                    "last_step",
                    "cost_s",
                    "budget_s",
                    "stood_down",
                    "reason",
                    "bytes",
                    "window_cost_s",
                    "duration_s",
                )
                and v == v
                and v is not None
            }
            print("   ", fields)


if __name__ == "__main__":
    main(sys.argv[1:])
