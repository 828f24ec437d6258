"""The public scripts of bench/corpus.py: where each is fetched from, how its scratch copy is made
tiny on synthetic data, and where its causes go (the per-step anchor, the set-up line, the
dataset's __getitem__). The causes' lists live here too."""

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

from corpus_model import _prep_ignite
from corpus_more import script_fields


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
    "running_sum",
    "grid2",
    "recovery2",
    "eval_grad",
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


# scripts from libraries the corpus had not used (bench/corpus_more.py)
SCRIPTS.update({name: Script(name, **kw) for name, kw in script_fields().items()})
