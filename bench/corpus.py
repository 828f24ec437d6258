"""Public training scripts, each with one injected slowdown, run under `diagnose`: does traindx
name the cause at the right line with a prescription a user can apply?

    python bench/corpus.py /work/corpus [--scripts wlm,mingpt,...] [--causes ...] [--steps 24]
                           [--load 2] [--out /tmp/corpus-runs] [--json results.json]
    python bench/corpus.py /work/corpus --fix [--fix-tries 2] ...   # diagnose --fix on each

`/work/corpus` holds the fetched scripts (NOT in this repository; fetch them yourself):
    wlm_main.py wlm_model.py wlm_data.py  pytorch/examples word_language_model/{main,model,data}.py
    minGPT/                                karpathy/minGPT (the whole repository)
    pl_transformer.py                      Lightning examples/pytorch/basics/transformer.py
    fabric_lm.py                           Lightning examples/fabric/language_model/train.py
    timm_train.py                          huggingface/pytorch-image-models train.py (with --site)
    ignite_mnist.py                        pytorch/ignite examples/mnist/mnist.py
Causes inside the model's own work (hook, metric_cb, lr0, outside, badaccum): bench/corpus_model.py.
This file holds none of their code: it copies them to a scratch folder, writes tiny synthetic
data beside them, and injects each cause by inserting a line into the scratch copy at a line
found by a pattern (the training loop's optimizer step, the dataset's __getitem__), so the
injected code sits in the user's own file, as a real slowdown would. The healthy twin is the
same copy with nothing inserted. `--load N` runs N CPU burners (`python -c 'while 1: pass'`)
beside every job. Every job runs with OMP_NUM_THREADS=1 except the thread cause.

`--fix` runs `diagnose --fix` instead and judges what a user keeps: was a candidate applied, the
kept arm's mechanism, speedup (as the loop judged it) and significance, predicted vs measured
step, and whether fix.patch applies with `git apply` to a clean copy of the slowed script.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus_model import MODEL_CAUSES, USABLE_MODEL, _prep_ignite, apply_edits  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# defines the helpers the inserted lines call; one line, so the script's lines move by one only
PRELUDE = "import time as _tdx_time, gc as _tdx_gc; _tdx_n = [0]; _tdx_kept = []\n"
# every 2nd step: a sample-image grid of the model's weights written as a PNG (torch ops and
# Pillow's encoder), repeated for about `s` seconds so its size follows the healthy step
GRID = (
    "import torch as _tdx_torch, PIL.Image as _tdx_img\n"
    "_tdx_t0 = _tdx_time.perf_counter()\n"
    "while _tdx_time.perf_counter() - _tdx_t0 < {s:.4f}:\n"
    "    with _tdx_torch.no_grad():\n"
    "        _tdx_w = _tdx_torch.cat([p.detach().flatten()[:32768] for p in {model}.parameters()])\n"
    "        _tdx_w = ((_tdx_w - _tdx_w.min()) / (_tdx_w.max() - _tdx_w.min() + 1e-8) * 255).to(_tdx_torch.uint8)\n"
    "        _tdx_w = _tdx_torch.nn.functional.pad(_tdx_w, (0, (-len(_tdx_w)) % 256)).reshape(-1, 256)\n"
    "        _tdx_img.fromarray(_tdx_w.repeat_interleave(2, 0).repeat_interleave(2, 1).numpy()).save('samples.png')"
)
BUSY = "_tdx_t0 = _tdx_time.perf_counter()\nwhile _tdx_time.perf_counter() - _tdx_t0 < {s:.4f}: pass"


def _nest(text, by="    "):
    return "\n".join(by + line for line in text.split("\n"))


def _words(n: int, seed: int = 0) -> str:
    import random

    rnd = random.Random(seed)
    vocab = [f"w{i}" for i in range(400)]
    lines = [" ".join(rnd.choice(vocab) for _ in range(12)) for _ in range(n)]
    return "\n".join(lines) + "\n"


@dataclass
class Script:
    name: str
    files: list  # paths under the corpus folder copied into the scratch dir
    main: str  # the file the command runs (in the scratch dir)
    argv: list
    loop_file: str  # the file whose training loop gets the per-step insertions
    loop_anchor: str  # regex of the line after which a per-step line goes
    model: str  # expression for the model at the anchor
    loss: str  # expression for the loss at the anchor
    getitem_file: str | None = None
    getitem_anchor: str | None = None  # line after which the slow __getitem__ goes
    getitem_patch_class: str | None = None  # or: patch this dataset object's class after the anchor
    setup_file: str | None = None  # the file whose set-up (before training) gets a switch turned on
    setup_anchor: str | None = None  # line after which the switch line goes (runs once)
    framework_call: str | None = (
        None  # regex up to the framework's constructor's "(": its switch arguments go there
    )
    env: dict = field(default_factory=dict)
    prepare: Callable | None = None
    flag_causes: dict = field(default_factory=dict)  # cause -> arguments added to the command
    only_causes: tuple = ()  # the causes this script is run with (empty: all)


def _prep_wlm(d):
    os.makedirs(os.path.join(d, "data", "wikitext-2"), exist_ok=True)
    for i, part in enumerate(("train", "valid", "test")):
        with open(os.path.join(d, "data", "wikitext-2", f"{part}.txt"), "w") as f:
            f.write(_words(3000 if part == "train" else 200, i))
    for f in ("main", "model", "data"):
        shutil.move(os.path.join(d, f"wlm_{f}.py"), os.path.join(d, f"{f}.py"))


def _prep_lightning(d):
    os.makedirs(os.path.join(d, "data"), exist_ok=True)
    with open(os.path.join(d, "data", "wikitext-2.txt"), "w") as f:
        f.write(_words(15000))


def _prep_mingpt(d):
    with open(os.path.join(d, "input.txt"), "w") as f:
        # chargpt samples from the context "O God, O God!" every 500 iterations: its characters
        # must be in the vocabulary
        f.write("O God, O God!\n" + _words(400))


def _prep_timm(d):
    """A tiny ImageFolder (2 classes of 200 random 40x40 PNGs, 8 for validation: one epoch is 50
    steps of 8, so --steps 30 ends before the epoch's own checkpoint and validation)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 200), ("validation", 8)):
        for c in ("a", "b"):
            os.makedirs(os.path.join(d, "data", split, c), exist_ok=True)
            for i in range(n):
                img = Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8))
                img.save(os.path.join(d, "data", split, c, f"{i}.png"))
    shutil.move(os.path.join(d, "timm_train.py"), os.path.join(d, "train.py"))


def guard_torchvision(site):
    """torchvision from the registry beside the CPU torch (FACTS §9): its two fake-kernel
    registrations of compiled ops guarded by `_has_ops()` in the copy installed at `site` (a
    folder named site-packages, so that timm's files read as a framework's)."""
    path = os.path.join(site, "torchvision", "_meta_registrations.py")
    with open(path) as f:
        text = f.read()
    for op in ("nms", "qnms"):
        text = text.replace(
            f'@torch.library.register_fake("torchvision::{op}")',
            f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f))',
        )
    with open(path, "w") as f:
        f.write(text)


SCRIPTS = {
    "wlm": Script(
        "wlm",
        ["wlm_main.py", "wlm_model.py", "wlm_data.py"],
        "main.py",
        ["--epochs", "1", "--use-optimizer", "--lr", "0.001", "--log-interval", "1000000"],
        "main.py",
        r"^\s+optimizer\.step\(\)",
        "model",
        "loss",
        prepare=_prep_wlm,
    ),
    "mingpt": Script(
        "mingpt",
        ["minGPT"],
        "minGPT/projects/chargpt/chargpt.py",
        [
            "--model.model_type=gpt-nano",
            "--trainer.batch_size=16",
            "--data.block_size=64",
            "--trainer.num_workers=0",
            "--trainer.max_iters=100000",
        ],
        "minGPT/mingpt/trainer.py",
        r"^\s+self\.optimizer\.step\(\)",
        "model",
        "self.loss",
        getitem_file="minGPT/projects/chargpt/chargpt.py",
        getitem_anchor=r"^\s+def __getitem__",
        setup_file="minGPT/projects/chargpt/chargpt.py",
        setup_anchor=r"^\s+set_seed\(config",
        env={"PYTHONPATH": "minGPT"},
        prepare=_prep_mingpt,
    ),
    "pl_trainer": Script(
        "pl_trainer",
        ["pl_transformer.py"],
        "pl_transformer.py",
        [],
        "pl_transformer.py",
        r"^\s+loss = F\.nll_loss",
        "self",
        "loss",
        getitem_file="pl_transformer.py",
        getitem_anchor=r"^\s+dataset = WikiText2\(\)",
        getitem_patch_class="dataset",
        setup_file="pl_transformer.py",
        setup_anchor=r"^\s+dataset = WikiText2\(\)",
        framework_call=r"\bTrainer\(",
        env={"PL_TRAINER_MAX_STEPS": "100000"},
        prepare=_prep_lightning,
    ),
    "timm": Script(
        "timm",
        ["timm_train.py"],
        "train.py",
        [
            "--data-dir=data",
            "--model=resnet10t",
            "--img-size=32",
            "-b=8",
            "--epochs=1",
            "--device=cpu",
            "--workers=0",
            "--log-interval=1000",
            "--no-prefetcher",
            "--num-classes=2",
        ],
        "train.py",
        r"^\s+optimizer\.step\(\)",
        "model",
        "loss",
        prepare=_prep_timm,
        # timm's own flag: a recovery checkpoint every 2nd step, written inside timm's package
        flag_causes={"recovery2": ["--recovery-interval=2"]},
        # its step is a closure (`_backward`): the per-step insertions do not apply
        only_causes=("healthy", "recovery2"),
    ),
    "fabric": Script(
        "fabric",
        ["fabric_lm.py"],
        "fabric_lm.py",
        [],
        "fabric_lm.py",
        r"^\s+optimizer\.step\(\)",
        "model",
        "loss",
        getitem_file="fabric_lm.py",
        getitem_anchor=r"^\s+dataset = WikiText2\(\)",
        getitem_patch_class="dataset",
        setup_file="fabric_lm.py",
        setup_anchor=r"^\s+dataset = WikiText2\(\)",
        prepare=_prep_lightning,
    ),
    "ignite": Script(
        "ignite",
        ["ignite_mnist.py"],
        "ignite_mnist.py",
        ["--epochs", "1", "--batch_size", "64", "--log_interval", "10"],
        "ignite_mnist.py",
        r"^\s+def log_training_loss",
        "model",
        "engine.state.output",
        prepare=_prep_ignite,
    ),
}

FLAG_CAUSES = ("recovery2",)  # a script's own flag set on its command line
# cause -> (what the table expects, inserted per-step code or None)
CAUSES = (
    "healthy",
    "read150",
    "odd_host",
    "threads16",
    "save",
    "slow_getitem",
    "gc_collect",
    "item",
    "keep_loss",
    "grid2",
    "recovery2",
)
# switches left on after debugging, turned on once in the script's set-up (not in the default run);
# where the script builds a framework's trainer, its own argument turns the switch on instead
SWITCH_ARGUMENTS = {"anomaly": "detect_anomaly=True"}
SWITCH_CAUSES = {
    # hunting a NaN: anomaly detection, forgotten there
    "anomaly": "import torch as _tdx_torch; _tdx_torch.autograd.set_detect_anomaly(True)",
    # a numerics check in double precision, forgotten there
    "float64": "import torch as _tdx_torch; _tdx_torch.set_default_dtype(_tdx_torch.float64)",
}


def _insert_after(path, pattern, lines_of_indent, first_only=True):
    """Insert lines after the first line matching `pattern`; `lines_of_indent(indent)` gives
    the text (indent: the matched line's leading whitespace; for a `def` line one level more).
    Returns "first-last": the 1-based line numbers of the inserted lines."""
    with open(path) as f:
        src = f.read().splitlines(keepends=True)
    rx = re.compile(pattern)
    for i, line in enumerate(src):
        if rx.search(line):
            indent = line[: len(line) - len(line.lstrip())]
            if line.lstrip().startswith("def "):
                indent += "    "
            text = lines_of_indent(indent)
            block = "".join(indent + t + "\n" for t in text.split("\n"))
            src.insert(i + 1, block)
            with open(path, "w") as f:
                f.write("".join(src))
            return f"{i + 2}-{i + 1 + len(text.split(chr(10)))}"
    raise SystemExit(f"pattern {pattern!r} not found in {path}")


def _add_argument(path, call, argument):
    """Pass `argument` first to the first call matching `call` (a regex ending at its "("); returns
    the line's number as "n-n"."""
    with open(path) as f:
        src = f.read().splitlines(keepends=True)
    rx = re.compile(call)
    for i, line in enumerate(src):
        m = rx.search(line)
        if m:
            src[i] = line[: m.end()] + argument + ", " + line[m.end() :]
            with open(path, "w") as f:
                f.write("".join(src))
            return f"{i + 1}-{i + 1}"
    raise SystemExit(f"pattern {call!r} not found in {path}")


def _prelude(path):
    with open(path) as f:
        src = f.read()
    with open(path, "w") as f:
        f.write(PRELUDE + src)


def prepare(corpus, script, cause, work, busy_s, at=None):
    """Scratch copy of the script with the cause inserted: (dir, env, injected "file:line").
    `at`: the folder to write it in (re-creating a run's sources for --rejudge)."""
    if at:
        os.makedirs(at, exist_ok=True)
        d = at
    else:
        d = tempfile.mkdtemp(prefix=f"{script.name}-{cause}-", dir=work)
    for item in script.files:
        src = os.path.join(corpus, item)
        dst = os.path.join(d, os.path.basename(item))
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy(src, dst)
    if script.prepare:
        script.prepare(d)
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.update(script.env)
    where = None
    loop = os.path.join(d, script.loop_file)
    per_step = {
        # a read from slow storage: 150 ms blocked per step
        "read150": lambda i: "_tdx_blob = open(__file__, 'rb').read(); _tdx_time.sleep(0.15)",
        # CPU work on every other step (pure Python, +50 % of the healthy step)
        "odd_host": lambda i: "_tdx_n[0] += 1\nif _tdx_n[0] % 2:\n" + _nest(BUSY.format(s=busy_s)),
        "save": lambda i: (
            "_tdx_n[0] += 1\nif _tdx_n[0] % 4 == 0:\n"
            + _nest(f"import torch as _tdx_torch; _tdx_torch.save({script.model}.state_dict(), 'ckpt.pt')")
        ),
        "gc_collect": lambda i: "_tdx_gc.collect()",
        "item": lambda i: f"_tdx_loss_value = {script.loss}.item()",
        # the loss kept with its autograd graph (its graph nodes stay alive, step after step)
        "keep_loss": lambda i: f"_tdx_kept.append({script.loss})",
        # a sample-image grid written every 2nd step (+68 % on those steps, +34 % on average)
        "grid2": lambda i: (
            "_tdx_n[0] += 1\nif _tdx_n[0] % 2 == 0:\n"
            + _nest(GRID.format(s=busy_s * 1.36, model=script.model))
        ),
    }
    if cause in MODEL_CAUSES:
        where = apply_edits(d, script.name, cause)
        if where is None:
            return None
        return d, env, where
    if (cause in FLAG_CAUSES and cause not in script.flag_causes) or (
        script.only_causes and cause not in script.only_causes
    ):
        return None  # another script's own flag, or a cause this script is not run with
    if cause in script.flag_causes:
        env["TRAINDX_CORPUS_ARGS"] = json.dumps(script.flag_causes[cause])
    elif cause in per_step:
        _prelude(loop)
        where = (script.loop_file, _insert_after(loop, script.loop_anchor, per_step[cause]))
    elif cause in SWITCH_CAUSES:
        if not script.setup_file:
            return None
        path = os.path.join(d, script.setup_file)
        if script.framework_call and cause in SWITCH_ARGUMENTS:
            where = (script.setup_file, _add_argument(path, script.framework_call, SWITCH_ARGUMENTS[cause]))
        else:
            text = SWITCH_CAUSES[cause]
            where = (script.setup_file, _insert_after(path, script.setup_anchor, lambda i: text))
    elif cause == "threads16":
        env.update(OMP_NUM_THREADS="16", MKL_NUM_THREADS="16")
    elif cause == "slow_getitem":
        if not script.getitem_file:
            return None
        path = os.path.join(d, script.getitem_file)
        _prelude(path)
        per_item = busy_s / 16  # a batch of 16-20 items: about the healthy step again
        if script.getitem_patch_class:
            obj = script.getitem_patch_class
            text = (
                f"_tdx_get = type({obj}).__getitem__\n"
                "def _tdx_slow_getitem(self, i):\n"
                + _nest(BUSY.format(s=per_item) + "\nreturn _tdx_get(self, i)")
                + "\n"
                f"type({obj}).__getitem__ = _tdx_slow_getitem"
            )
        else:
            text = BUSY.format(s=per_item)
        where = (script.getitem_file, _insert_after(path, script.getitem_anchor, lambda i: text))
    return d, env, (f"{where[0]}:{where[1]}" if where else None)


def _job_env(d, env):
    """The environment a job of the corpus runs with: ours, its own settings, its PYTHONPATH
    (relative to its scratch folder) first."""
    full_env = dict(os.environ)
    full_env.update(env)
    if "PYTHONPATH" in env:
        full_env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(d, env["PYTHONPATH"])]
            + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        )
    return full_env


def _run(d, script, env, run_dir, options, timeout):
    """`diagnose <options> --run-dir run_dir -- python <script>` in the scratch copy; returns the
    folder and the wall seconds (a run past the timeout keeps what it wrote)."""
    cmd = (
        [
            sys.executable,
            "-m",
            "traindx",
            *options,
            "--run-dir",
            run_dir,
            "--",
            sys.executable,
            script.main,
        ]
        + script.argv
        + json.loads(env.get("TRAINDX_CORPUS_ARGS") or "[]")
    )
    t0 = time.time()
    try:
        subprocess.run(
            cmd,
            cwd=d,
            env=_job_env(d, env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pass
    return run_dir, time.time() - t0


def run_diagnose(d, script, env, steps, out_dir, timeout):
    return _run(
        d,
        script,
        env,
        os.path.join(out_dir, os.path.basename(d)),
        ["--quiet", "--steps", str(steps)],
        timeout,
    )


def run_fix(d, script, env, steps, out_dir, timeout, tries):
    """`diagnose --fix` on the slowed copy, as a user runs it; returns its folder."""
    return _run(
        d,
        script,
        env,
        os.path.join(out_dir, os.path.basename(d) + "-fix"),
        ["--fix", "--quiet", "--steps", str(steps), "--fix-tries", str(tries)],
        timeout,
    )


def judge_fix(corpus, script, cause, fix_dir, busy_s, reproduce=None):
    """What --fix kept, and whether its patch applies to a clean copy of the slowed script.
    `reproduce` = (env, steps, out_dir, timeout): the patched clean copy is also run under plain
    `diagnose` and its median step set beside the kept arm's."""
    try:
        with open(os.path.join(fix_dir, "fix.json")) as f:
            fix = json.load(f)
    except (OSError, ValueError):
        return {"applied": False, "kept": "(no fix.json)", "ok": False}
    arms = fix.get("arms") or []
    kept = fix.get("kept") or {}
    row = {
        "applied": bool(arms),
        "arms": [f"{a.get('mechanism')}:{a.get('finding')}={_num(a.get('judged_speedup'))}x" for a in arms],
        "kept": (f"{kept.get('mechanism')}:{kept.get('finding')}" if kept else "-"),
        "speedup": kept.get("judged_speedup"),
        "significant": kept.get("significant"),
        "parity": kept.get("loss_parity"),
        "predicted_s": kept.get("predicted_step_time_s"),
        "measured_s": kept.get("measured_mean_step_s") or kept.get("measured_step_time_s"),
        "apply": fix.get("apply") or [],
        "patch_applies": None,
    }
    patch = os.path.join(fix_dir, "fix.patch")
    if kept and os.path.isfile(patch):
        with tempfile.TemporaryDirectory() as tmp:
            clean = prepare(corpus, script, cause, tmp, busy_s or 0.05)[0]
            subprocess.run(["git", "init", "-q"], cwd=clean, check=True)
            proc = subprocess.run(["git", "apply", patch], cwd=clean, capture_output=True, text=True)
            row["patch_applies"] = proc.returncode == 0
            if reproduce and row["patch_applies"]:
                env, steps, out_dir, timeout = reproduce
                run_dir, _ = run_diagnose(clean, script, env, steps, out_dir, timeout)
                row["patched_median_s"] = _healthy_step(run_dir)
                row["kept_median_s"] = kept.get("measured_step_time_s")
    pred, meas = row["predicted_s"], row["measured_s"]
    row["error"] = (pred - meas) / meas if pred and meas else None
    row["ok"] = bool(
        kept
        and kept.get("significant")
        and (row["speedup"] or 0) >= 1.5
        and row["parity"] is not False
        and row["patch_applies"] is not False
    )
    if cause == "healthy":  # the healthy twin: nothing to change, no arm run
        row["ok"] = not arms
    return row


def _num(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def fix_table(rows):
    out = [
        "| script | cause | arms tried (mechanism:finding=speedup) | kept | speedup | significant "
        "| predicted vs measured step | error | fix.patch applies | patched copy vs kept arm, median step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = "-" if r.get("error") is None else f"{r['error']:+.0%}"
        again = (
            f"{_num(r.get('patched_median_s'), 3)} vs {_num(r.get('kept_median_s'), 3)} s"
            if r.get("patched_median_s")
            else ("; ".join(r.get("apply") or [])[-60:] or "-")
        )
        out.append(
            f"| {r['script']} | {r['cause']} | {', '.join(r.get('arms') or []) or '-'} | "
            f"{r.get('kept')} | {_num(r.get('speedup'))}x | {_yn(r.get('significant'))} | "
            f"{_num(r.get('predicted_s'), 3)} vs {_num(r.get('measured_s'), 3)} s | {err} | "
            f"{_yn(r.get('patch_applies'))} | {again} |"
        )
    out.append(
        f"\n{sum(1 for r in rows if r.get('ok'))} of {len(rows)} right: a significant change "
        ">= 1.5x kept with parity, its patch (if any) applying to a clean copy; a healthy twin: no arm"
    )
    return "\n".join(out)


def _root_findings(run_dir):
    try:
        with open(os.path.join(run_dir, "findings.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    items = data.get("findings", data) if isinstance(data, dict) else data
    return [
        f
        for f in items
        if isinstance(f, dict)
        and not f.get("cause")
        and not str(f.get("id", "")).startswith(("verdict.", "traindx.", "analysis."))
    ]


def _top(findings):
    above = [f for f in findings if f.get("severity") != "info"]
    return above[0] if above else None


def _lines_of(finding):
    text = (
        f"{finding.get('title')} {finding.get('summary')} "
        + json.dumps(finding.get("evidence") or {})
        + " "
        + json.dumps([p.get("change") for p in finding.get("prescriptions") or []])
    )
    return set(re.findall(r"([\w./-]+\.py)[\"']?[:, ]+(?:\"line\": )?(\d+)", text))


# what a usable prescription says for each cause
USABLE = {
    "read150": r"DataLoader|worker|async|cache|less often|prefetch",
    "odd_host": r"DataLoader|worker|async|cache|less often|GPU",
    "threads16": r"OMP_NUM_THREADS|set_num_threads",
    "save": r"less often|async|interval|every",
    "slow_getitem": r"num_workers",
    "anomaly": r"set_detect_anomaly\(False\)|switch_off:anomaly",
    "float64": r"set_default_dtype|switch_off:default_dtype",
    "gc_collect": r"gc\.collect|gc\.freeze|remove",
    "item": r"item",
    "keep_loss": r"\.item\(\)|\.detach\(\)",
    "grid2": r"less often|async|every|thread",
    "recovery2": r"--recovery-interval",
    **USABLE_MODEL,
}


def judge(cause, run_dir, injected):
    """(top finding id, its line, right line?, usable prescription?) for one run."""
    found = _root_findings(run_dir)
    if found is None:
        return {"top": "(no findings.json)", "line": "", "line_ok": False, "usable": False, "ok": False}
    top = _top(found)
    if top is None:
        # .item() costs nothing on a CPU tensor; a save below 3 % of the step is worth no finding
        ok = cause in ("healthy", "item") or (cause == "save" and _io_share(run_dir) < 0.03)
        return {"top": "-", "line": "", "line_ok": ok, "usable": ok, "ok": ok}
    lines = _lines_of(top)
    line = ""
    line_ok = False
    if injected:
        f, span = injected.rsplit(":", 1)
        first, _, last = span.partition("-")
        base = os.path.basename(f)
        hits = [(p, ln) for p, ln in lines if os.path.basename(p) == base]
        line_ok = any(int(first) - 1 <= int(ln) <= int(last or first) + 1 for _, ln in hits)
        line = ", ".join(f"{os.path.basename(p)}:{ln}" for p, ln in sorted(hits)[:2])
    elif lines:
        p, ln = sorted(lines)[0]
        line = f"{os.path.basename(p)}:{ln}"
    pres = " ".join(
        f"{p.get('summary', '')} {p.get('command') or ''} {json.dumps(p.get('change'))}"
        for p in top.get("prescriptions") or []
    )
    gains = [p.get("expected_gain_s_per_step") for p in top.get("prescriptions") or []]
    positive = all(g is None or g > 0 for g in gains)
    usable = bool(cause in USABLE and re.search(USABLE[cause], pres)) and positive
    if cause == "recovery2":  # a setting: the job's flag, never a file under site-packages
        pres_text = json.dumps([p.get("change") for p in top.get("prescriptions") or []][:1])
        line_ok = "--recovery-interval" in pres_text and "site-packages" not in str(
            (top.get("prescriptions") or [{}])[0].get("summary")
        )
    if cause in ("threads16", "slow_getitem", "save") and not injected:
        line_ok = True  # a setting, not a line: the prescription says which
    if cause == "slow_getitem" and not line_ok:
        # the DataLoader's construction line is the place of the fix: the train loader's
        befores = [
            ((p.get("change") or {}).get("code") or {}).get("before") or ""
            for p in top.get("prescriptions") or []
        ]
        line_ok = any("DataLoader(" in b and not re.search(r"\b(val|test|eval)", b) for b in befores)
    if cause == "healthy":
        usable = line_ok = False
    ok = line_ok and usable
    return {
        "top": top.get("id"),
        "line": line,
        "line_ok": line_ok,
        "usable": usable,
        "ok": ok,
        "severity": top.get("severity"),
        "seconds": top.get("seconds_lost_per_step"),
    }


def live_shown(run_dir):
    """What the live judgement printed while the job ran: {finding id: step on screen}, and
    the passes that ran (trigger, step), from live.json."""
    try:
        with open(os.path.join(run_dir, "live.json")) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return {
        "shown": {k: v.get("step") for k, v in (doc.get("findings") or {}).items()},
        "passes": [(p.get("trigger"), p.get("step")) for p in doc.get("passes") or []],
        "cpu_s": doc.get("analysis_cpu_s"),
    }


def _live_text(r):
    live = r.get("live")
    if not live:
        return ""
    shown = live["shown"]
    return ", ".join(f"{k} at step {v}" for k, v in shown.items()) or "nothing"


def _io_share(run_dir):
    try:
        import traindx
        from traindx.derive import ledger

        led = ledger.steady_rows(traindx.load_run(run_dir))
        return float(led["io_s"].sum() / led["wall_s"].sum()) if len(led) else 1.0
    except Exception:
        return 1.0


def _healthy_step(run_dir):
    try:
        sys.path.insert(0, REPO)
        import traindx

        run = traindx.load_run(run_dir)
        led = run.ledger
        return float(led["wall_s"].median()) if len(led) else None
    except Exception:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus")
    ap.add_argument("--scripts", default=",".join(SCRIPTS))
    ap.add_argument("--causes", default=",".join(CAUSES))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--load", type=int, default=0, help="CPU burners beside each job")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "traindx-corpus"))
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--site",
        help="a folder named site-packages holding torchvision and timm (pip install --no-deps "
        "--target DIR/site-packages torchvision==0.28.0 timm): put first on the jobs' PYTHONPATH, "
        "torchvision's compiled-op registrations guarded (FACTS §9); the timm script needs it",
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies")
    ap.add_argument("--fix", action="store_true", help="run diagnose --fix on each slowed copy")
    ap.add_argument("--fix-tries", type=int, default=2)
    ap.add_argument(
        "--reproduce",
        action="store_true",
        help="with --fix: run the patched clean copy too (its median step vs the kept arm's)",
    )
    ap.add_argument(
        "--rejudge",
        metavar="ROWS_JSON",
        help="no new runs: re-analyse the runs of an earlier --json with this "
        "checkout (diagnose report --reanalyze) and judge them again",
    )
    ap.add_argument(
        "--judge-only",
        action="store_true",
        help="with --rejudge: judge the findings.json already there (no reanalysis)",
    )
    a = ap.parse_args(argv)
    if a.site:
        guard_torchvision(os.path.abspath(a.site))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(a.site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        )
    if a.rejudge:
        return rejudge(a.rejudge, a.json, os.path.abspath(a.corpus), not a.judge_only)
    corpus = os.path.abspath(a.corpus)
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="corpus-src-", dir=a.out)
    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(a.load)]
    rows = []
    try:
        for name in a.scripts.split(","):
            script = SCRIPTS[name]
            busy_s = None
            for cause in a.causes.split(","):
                if cause != "healthy" and busy_s is None:
                    # the healthy step sets the size of the injected host work
                    prep = prepare(corpus, script, "healthy", work, 0.0)
                    run_dir, _ = run_diagnose(prep[0], script, prep[1], a.steps, a.out, a.timeout)
                    busy_s = 0.5 * (_healthy_step(run_dir) or 0.1)
                prep = prepare(corpus, script, cause, work, busy_s or 0.05)
                if prep is None:
                    rows.append(
                        {
                            "script": name,
                            "cause": cause,
                            "top": "n/a (not this script's cause)"
                            if cause != "slow_getitem"
                            else "n/a (no DataLoader)",
                            "line": "",
                            "line_ok": None,
                            "usable": None,
                            "ok": None,
                        }
                    )
                    continue
                d, env, injected = prep
                if a.fix:
                    fix_dir, wall = run_fix(d, script, env, a.steps, a.out, a.timeout, a.fix_tries)
                    row = {
                        "script": name,
                        "cause": cause,
                        "injected": injected,
                        "run": fix_dir,
                        "wall_s": round(wall, 1),
                        "busy_s": busy_s,
                    }
                    row.update(
                        judge_fix(
                            corpus,
                            script,
                            cause,
                            fix_dir,
                            busy_s,
                            reproduce=((env, a.steps, a.out, a.timeout) if a.reproduce else None),
                        )
                    )
                    rows.append(row)
                    print(
                        f"{name:<11} {cause:<12} kept {row['kept']} {_num(row.get('speedup'))}x "
                        f"patch {_yn(row.get('patch_applies'))} ({row['wall_s']} s)",
                        flush=True,
                    )
                    continue
                run_dir, wall = run_diagnose(d, script, env, a.steps, a.out, a.timeout)
                if cause == "healthy":
                    busy_s = 0.5 * (_healthy_step(run_dir) or 0.1)
                row = {
                    "script": name,
                    "cause": cause,
                    "injected": injected,
                    "run": run_dir,
                    "wall_s": round(wall, 1),
                    "busy_s": busy_s,
                    "source_dir": d,
                }
                row.update(judge(cause, run_dir, injected))
                row["live"] = live_shown(run_dir)
                rows.append(row)
                print(_fmt(row), flush=True)
    finally:
        for b in burners:
            os.kill(b.pid, signal.SIGTERM)
            b.wait()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(fix_table(rows) if a.fix else table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _restore_sources(corpus, r):
    """The run's scratch copy where the job ran (its manifest's cwd), when it is gone: the
    analyzers read the job's source lines, as they would on the user's machine."""
    try:
        with open(os.path.join(r["run"], "manifest.json")) as f:
            cwd = json.load(f).get("cwd")
    except (OSError, ValueError):
        return
    if cwd and not os.path.isdir(cwd) and r["script"] in SCRIPTS:
        prepare(corpus, SCRIPTS[r["script"]], r["cause"], None, r.get("busy_s") or 0.05, at=cwd)


def _injected_lines(corpus, r):
    """The inserted lines as "file:first-last" (rows of an older corpus.py name the first only)."""
    if not corpus or r["script"] not in SCRIPTS or "-" in str(r.get("injected") or "-"):
        return r.get("injected")
    with tempfile.TemporaryDirectory() as tmp:
        prep = prepare(corpus, SCRIPTS[r["script"]], r["cause"], tmp, r.get("busy_s") or 0.05)
    return prep[2] if prep else r.get("injected")


def rejudge(rows_json, out_json=None, corpus=None, reanalyze=True):
    """The same runs judged by the analyzers of this checkout (before/after a change)."""
    with open(rows_json) as f:
        rows = json.load(f)
    out = []
    for r in rows:
        if r.get("run") and os.path.isdir(r["run"]):
            r = dict(r)
            r["injected"] = _injected_lines(corpus, r)
            if corpus:
                _restore_sources(corpus, r)
            if reanalyze:
                subprocess.run(
                    [sys.executable, "-m", "traindx", "report", r["run"], "--reanalyze", "--quiet"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            r.update(judge(r["cause"], r["run"], r.get("injected")))
            print(_fmt(r), flush=True)
        out.append(r)
    print()
    print(table(out))
    if out_json:
        with open(out_json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _yn(v):
    return "-" if v is None else ("yes" if v else "no")


def _fmt(r):
    return (
        f"{r['script']:<11} {r['cause']:<12} {str(r['top']):<34} {r.get('line') or '':<22} "
        f"{_yn(r.get('line_ok')):<5} {_yn(r.get('usable')):<5}"
    )


def table(rows):
    head = (
        "| script | cause | top finding | its line | right line | usable prescription | "
        "printed while it ran |"
    )
    out = [head, "|---|---|---|---|---|---|---|"]
    out.extend(
        f"| {r['script']} | {r['cause']} | {r['top']} | {r.get('line') or ''} | "
        f"{_yn(r.get('line_ok'))} | {_yn(r.get('usable'))} | {_live_text(r)} |"
        for r in rows
    )
    ok = [r for r in rows if r.get("ok") is not None]
    out.append(
        f"\n{sum(1 for r in ok if r['ok'])} of {len(ok)} right (cause named at its line or "
        "setting, with a usable prescription; healthy twins and .item() on CPU: silent)"
    )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
