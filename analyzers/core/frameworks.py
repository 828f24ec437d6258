"""Which framework drives the run, and the knob the user owns in it.

A prescription has to name what the user can change: `TrainingArguments(dataloader_num_workers=N)`
for a Hugging Face Trainer job (its DataLoader is built inside transformers/accelerate, which
the user does not edit), `DataLoader(num_workers=N)` at the user's own construction line for
Lightning, Accelerate and hand-written loops, the config key for torchtitan, the flag for
Megatron. Never a file under site-packages.

The verdict comes from evidence in the run record, strongest first: the shim's `data_site`
events (what built the DataLoader, and through which framework), the framework packages in
py-spy's stacks, the job's log format, the command line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from traindx.analyzers.core import evidence as ev

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

# top-level package (as it appears in a path) -> framework
PACKAGES = {
    "transformers": "hf_trainer",
    "trl": "hf_trainer",
    "lightning": "lightning",
    "pytorch_lightning": "lightning",
    "torchtitan": "torchtitan",
    "megatron": "megatron",
    "deepspeed": "deepspeed",
    "swift": "ms-swift",
    "accelerate": "accelerate",
}
# when several show up (a Trainer runs on Accelerate), the one the user drives wins
PRECEDENCE = (
    "ms-swift",
    "hf_trainer",
    "lightning",
    "torchtitan",
    "megatron",
    "deepspeed",
    "accelerate",
    "plain",
)
LOG_FORMATS = {
    "torchtitan": "torchtitan",
    "megatron": "megatron",
    "deepspeed": "deepspeed",
    "lightning": "lightning",
    "dict": "hf_trainer",
}
_PKG_IN_PATH = re.compile(r"[/\\](?:site|dist)-packages[/\\](?P<pkg>[A-Za-z_][\w]*)")
# only a Trainer's own frames say "this is a Trainer job" (transformers alone is a model library)
_HF_TRAINER_FILES = ("transformers/trainer.py", "transformers/trainer_utils.py", "trl/trainer/")
MAX_STACKS = 4000
# a Megatron job in its command: megatron-core's own entry points (pretrain_gpt.py,
# pretrain_mamba.py, ...), Megatron-LM's folder, ms-swift's `megatron` CLI
_MEGATRON_COMMAND = re.compile(r"megatron|(?:^|[/\\])pretrain_\w+\b", re.IGNORECASE)


def runs_megatron(command: Iterable[str] | None) -> bool:
    """Does the command line run Megatron? (the condition for prescribing its flags)"""
    return any(_MEGATRON_COMMAND.search(str(token)) for token in command or [])


def packages_in_stacks(run: RunRecord) -> dict[str, float]:
    """{package: seconds} of py-spy samples whose stack runs through each package's code."""
    seen = {}
    for (_, source), recording in run.pyspy.items():
        if source != "all":
            continue
        for samples in recording.values():
            for stack, weight in list(zip(samples.stacks, samples.weights))[:MAX_STACKS]:
                packages = set()
                for frame in stack:
                    m = _PKG_IN_PATH.search(frame.file or "")
                    if m:
                        packages.add(m["pkg"])
                    if any(p in (frame.file or "").replace("\\", "/") for p in _HF_TRAINER_FILES):
                        packages.add("hf_trainer_files")
                for p in packages:
                    seen[p] = seen.get(p, 0.0) + weight
    return seen


def data_sites(run: RunRecord, rank: str | None = None) -> list[dict[str, Any]]:
    """The shim's data_site events (DataLoader and TrainingArguments constructions), as dicts."""
    rows = ev.events_of_type(run, "data_site")
    if not len(rows):
        return []
    if rank is not None:
        rows = rows[rows["rank"] == rank]
    return [{k: plain(v) for k, v in r.items()} for r in rows.to_dict("records")]


def plain(value: Any) -> Any:
    """pandas' NaN -> None, 4.0 -> 4 (event columns shared with other types become floats)."""
    if isinstance(value, float):
        if value != value:
            return None
        if value.is_integer():
            return int(value)
    return value


def detect(run: RunRecord) -> dict[str, Any]:
    """{"name": framework, "evidence": [why...], "strong": bool, "also": [...]}; "plain" when no
    framework shows. Strong: the framework's code in the record, or the command runs it."""
    votes, weak = {}, {}

    def vote(name: Any, why: Any, strong: Any = True) -> None:
        (votes if strong else weak).setdefault(name, []).append(why)

    for site in data_sites(run):
        if site.get("kind") == "TrainingArguments":
            vote("hf_trainer", "the job built TrainingArguments")
        via = (site.get("via") or {}).get("package") if isinstance(site.get("via"), dict) else None
        if via in PACKAGES:
            vote(PACKAGES[via], f"its DataLoader is built inside {via}")
    stacks = packages_in_stacks(run)
    for package, seconds in sorted(stacks.items(), key=lambda kv: -kv[1]):
        if package == "hf_trainer_files":
            vote("hf_trainer", f"py-spy: {seconds:.1f} s of samples in transformers' Trainer")
        elif package in PACKAGES and package not in ("transformers", "trl"):
            vote(PACKAGES[package], f"py-spy: {seconds:.1f} s of samples in {package}")
    log = run.log_steps
    if len(log):
        for fmt, n in log["format"].value_counts().items():
            if fmt in LOG_FORMATS:
                # weak: any script can print a framework's line (traindx's own examples print
                # Megatron's); a flag or config key is prescribed only on strong evidence
                vote(LOG_FORMATS[fmt], f"{n} log line(s) in {fmt}'s format", strong=False)
    command = " ".join(str(t) for t in run.command)
    if re.search(r"\btorchtitan\b", command):
        vote("torchtitan", "the command runs torchtitan")
    if runs_megatron(run.command):
        vote("megatron", "the command runs Megatron")
    if re.search(r"(^|[\s/])(accelerate)\s+launch\b", command):
        vote("accelerate", "the command is `accelerate launch`")
    for name in PRECEDENCE:
        if name in votes:
            return {
                "name": name,
                "evidence": votes[name] + weak.get(name, []),
                "strong": True,
                "also": sorted((set(votes) | set(weak)) - {name}),
            }
    for name in PRECEDENCE:
        if name in weak:
            return {"name": name, "evidence": weak[name], "strong": False, "also": sorted(set(weak) - {name})}
    return {
        "name": "plain",
        "evidence": ["no framework's code or log format in the evidence"],
        "strong": False,
        "also": [],
    }


def knob_owner(run: RunRecord) -> str:
    """The framework whose knobs a prescription may name: detect()'s verdict on strong evidence
    (its code ran, or the command runs it), else "plain" (the job's own code and torch's API)."""
    found = detect(run)
    return found["name"] if found["strong"] else "plain"


def user_site(site: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The construction's site when it is the job's own code (never a file under site-packages)."""
    where: dict[str, Any] | None = (
        (site or {}).get("site") if isinstance((site or {}).get("site"), dict) else None
    )
    if not where or not where.get("file") or ev.is_library_path(where["file"]):
        return None
    return where


# -- the DataLoader knob of each framework ----------------------------------------------------------
def dataloader_knob(framework: str) -> tuple[str, dict[str, str]]:
    """(what to set, in the framework's terms; the setting's name per key) for num_workers."""
    if framework == "hf_trainer" or framework == "ms-swift":
        return (
            "TrainingArguments",
            {
                "num_workers": "dataloader_num_workers",
                "persistent_workers": "dataloader_persistent_workers",
                "prefetch_factor": "dataloader_prefetch_factor",
                "pin_memory": "dataloader_pin_memory",
            },
        )
    if framework == "torchtitan":
        return (
            "torchtitan config",
            {
                "num_workers": "dataloader.num_workers",
                "persistent_workers": "dataloader.persistent_workers",
                "prefetch_factor": "dataloader.prefetch_factor",
                "pin_memory": "dataloader.pin_memory",
            },
        )
    if framework == "megatron":
        return ("Megatron flag", {"num_workers": "--num-workers"})
    return (
        "DataLoader",
        {
            "num_workers": "num_workers",
            "persistent_workers": "persistent_workers",
            "prefetch_factor": "prefetch_factor",
            "pin_memory": "pin_memory",
        },
    )
