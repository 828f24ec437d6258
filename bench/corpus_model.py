"""Causes inside the model's own work, for bench/corpus.py: each an edit of a public script's
scratch copy (a line inserted after a pattern, or a pattern replaced in its line), so the slow or
wasted work sits in the user's own code as it would in a real job.

| cause | what |
|---|---|
| `hook` | a forward hook on every module: mean/std with .item() and a 100-bin histogram of its output |
| `metric_cb` | a per-batch callback / event handler computing a metric over all of the epoch's batches so far |
| `lr0` | the model's body "frozen" by a learning rate of 0 in the optimizer's param groups |
| `outside` | the model's body left out of the optimizer, requires_grad left on |
| `badaccum` | the loss divided for 4-step accumulation, the optimizer step and clipping run every micro-batch |
| `sum_loss` | the running loss summed as the tensor (`total_loss += loss`, its `.item()` dropped): its graph grows every step |
| `eval_often` | (a healthy twin) epochs of 11 steps, 8 of them: the script's own evaluation, under its `torch.no_grad()`, every 11 steps |
| `eval_grad` | as `eval_often`, the `torch.no_grad()` around the evaluation removed (`with torch.no_grad():` made `if True:`) |

Scripts added here: pytorch/ignite `examples/mnist/mnist.py` as `ignite_mnist.py` (Ignite's
Engine, create_supervised_trainer, event handlers), with torchvision's MNIST replaced by a
synthetic in-memory dataset of the same shape (torchvision cannot load beside the CPU torch).
"""

import os
import re
from dataclasses import dataclass

MODEL_CAUSES = ("hook", "metric_cb", "lr0", "outside", "badaccum", "sum_loss", "eval_often", "eval_grad")
# model causes that are healthy twins of another (nothing to find)
TWIN_CAUSES = ("eval_often",)

# what a usable prescription says for each cause
USABLE_MODEL = {
    "hook": r"hook",
    "metric_cb": r"less often|every|async|cache|callback|handler|DataLoader|worker",
    "lr0": r"requires_grad_\(False\)|freeze",
    "outside": r"requires_grad_\(False\)|freeze",
    "badaccum": r"every \d+|once per \d+|accumulat",
    "sum_loss": r"\.item\(\)|\.detach\(\)",
    "eval_grad": r"no_grad|inference_mode",
}

HOOK = (
    "_tdx_stats = {{}}\n"
    "def _tdx_record(module, inputs, output):\n"
    "    out = output[0] if isinstance(output, tuple) else output\n"
    "    _tdx_stats[module] = (out.float().mean().item(), out.float().std().item(), "
    "torch.histc(out.detach().float(), bins=100))\n"
    "for _tdx_m in {model}.modules():\n"
    "    _tdx_m.register_forward_hook(_tdx_record)"
)

SYNTH_MNIST = (
    "class MNIST(torch.utils.data.TensorDataset):  # synthetic stand-in for torchvision's (no download)\n"
    "    def __init__(self, download=False, root='.', transform=None, train=True):\n"
    "        g = torch.Generator().manual_seed(0 if train else 1)\n"
    "        n = 4096 if train else 512\n"
    "        super().__init__(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))\n"
    "def Compose(transforms): return None\n"
    "def Normalize(mean, std): return None\n"
    "def ToTensor(): return None\n"
)


@dataclass
class Edit:
    file: str  # under the scratch folder
    pattern: str  # regex of the line
    text: str  # inserted after the line (op "after") or replacing the match (op "replace")
    op: str = "after"


def _prep_ignite(d):
    path = os.path.join(d, "ignite_mnist.py")
    with open(path) as f:
        src = f.read()
    src = src.replace("from torchvision.datasets import MNIST\n", "")
    src = src.replace("from torchvision.transforms import Compose, Normalize, ToTensor\n", SYNTH_MNIST)
    with open(path, "w") as f:
        f.write(src)


IGNITE_METRIC_CB = (
    "_tdx_seen = []\n"
    "@trainer.on(Events.ITERATION_COMPLETED)\n"
    "def epoch_metric(engine):  # a metric over all of the epoch's batches, on every batch\n"
    "    x, y = engine.state.batch\n"
    "    _tdx_seen.append((x, y))\n"
    "    xs = torch.cat([a for a, _ in _tdx_seen]).flatten(1)\n"
    "    ys = torch.cat([b for _, b in _tdx_seen])\n"
    "    engine.state.metrics['epoch_class_means'] = torch.stack([xs[ys == c].median(0).values for c in ys.unique()])"
)

PL_METRIC_CB = (
    "class EpochMetric(L.Callback):  # a metric over all of the epoch's batches, on every batch\n"
    "    def __init__(self):\n"
    "        self.seen = []\n"
    "    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):\n"
    "        with torch.no_grad():\n"
    "            self.seen.append(pl_module.model.embedding(batch[0]).flatten(0, 1))\n"
    "        trainer.epoch_embedding_median = torch.cat(self.seen).median(0).values"
)
# the script's own evaluation inside the recorded steps: short epochs (11 steps of 35 tokens), 8 of them
WLM_SHORT_EPOCHS = [
    Edit("main.py", r"^args = parser\.parse_args\(\)", "args.epochs = 8"),
    Edit("main.py", r"^train_data = batchify\(corpus\.train", "train_data = train_data[:385]"),
]
WLM_BODY = "[*model.encoder.parameters(), *model.rnn.parameters()]"
EDITS = {
    "ignite": {
        "hook": [Edit("ignite_mnist.py", r"^\s+model\.to\(device\)", HOOK.format(model="model"))],
        "metric_cb": [Edit("ignite_mnist.py", r"^\s+trainer\.logger = setup_logger", IGNITE_METRIC_CB)],
        "lr0": [
            Edit(
                "ignite_mnist.py",
                r"SGD\(model\.parameters\(\), ",
                "SGD([{'params': [*model.conv1.parameters(), *model.conv2.parameters()], 'lr': 0.0}, "
                "{'params': [*model.fc1.parameters(), *model.fc2.parameters()]}], ",
                "replace",
            )
        ],
        "outside": [
            Edit(
                "ignite_mnist.py",
                r"SGD\(model\.parameters\(\), ",
                "SGD([*model.fc1.parameters(), *model.fc2.parameters()], ",
                "replace",
            )
        ],
    },
    "pl_trainer": {
        "metric_cb": [
            Edit("pl_transformer.py", r"^\s+# Trainer", PL_METRIC_CB),
            Edit(
                "pl_transformer.py",
                r"max_epochs=20\)",
                "max_epochs=20, callbacks=[EpochMetric()])",
                "replace",
            ),
        ],
        "hook": [Edit("pl_transformer.py", r"^\s+model = LanguageModel\(", HOOK.format(model="model"))],
    },
    "wlm": {
        "hook": [Edit("main.py", r"^criterion = nn\.NLLLoss\(\)", HOOK.format(model="model"))],
        "lr0": [
            Edit(
                "main.py",
                r"AdamW\(model\.parameters\(\), ",
                f"AdamW([{{'params': {WLM_BODY}, 'lr': 0.0}}, {{'params': model.decoder.parameters()}}], ",
                "replace",
            )
        ],
        "outside": [
            Edit(
                "main.py", r"AdamW\(model\.parameters\(\), ", "AdamW(model.decoder.parameters(), ", "replace"
            )
        ],
        "sum_loss": [Edit("main.py", r"total_loss \+= loss\.item\(\)", "total_loss += loss", "replace")],
        "eval_often": WLM_SHORT_EPOCHS,
        "eval_grad": [
            Edit("main.py", r"^\s+with torch\.no_grad\(\):", "    if True:", "replace"),
            *WLM_SHORT_EPOCHS,
        ],
        "badaccum": [
            Edit(
                "main.py",
                r"^\s+loss = criterion\(output, targets\)",
                "grad_accum_steps = 4  # micro-batches per update\nloss = loss / grad_accum_steps",
            )
        ],
    },
    "mingpt": {
        "badaccum": [
            Edit(
                "minGPT/mingpt/trainer.py",
                r"^\s+logits, self\.loss = model\(x, y\)",
                "grad_accum_steps = 4  # micro-batches per update\nself.loss = self.loss / grad_accum_steps",
            )
        ],
        "hook": [Edit("minGPT/mingpt/trainer.py", r"^\s+model\.train\(\)", HOOK.format(model="model"))],
    },
}
# where the right finding names the cause (else: the inserted lines): the lines that build the
# modules nobody updates, the optimizer step of the micro-batch loop
EXPECT = {
    ("ignite", "lr0"): ("ignite_mnist.py", r"self\.conv[12] = "),
    ("ignite", "outside"): ("ignite_mnist.py", r"self\.conv[12] = "),
    ("wlm", "lr0"): ("model.py", r"self\.(encoder|rnn) = "),
    ("wlm", "outside"): ("model.py", r"self\.(encoder|rnn) = "),
    ("wlm", "eval_grad"): ("main.py", r"^def evaluate\(|^    return total_loss / \(len\(data_source\)"),
    ("wlm", "badaccum"): ("main.py", r"optimizer\.step\(\)|clip_grad_norm_"),
    ("mingpt", "badaccum"): ("minGPT/mingpt/trainer.py", r"self\.optimizer\.step\(\)|clip_grad_norm_"),
}


def _more():
    """The edits of bench/corpus_more.py's scripts (imported here, late: it imports this module)."""
    import corpus_more  # noqa: PLC0415 -- late: corpus_more imports this module

    return corpus_more.EDITS, corpus_more.EXPECT


def _apply(d, edit):
    """Apply one edit; returns the 1-based lines it inserted or changed (first, last)."""
    path = os.path.join(d, edit.file)
    with open(path) as f:
        src = f.read().splitlines(keepends=True)
    rx = re.compile(edit.pattern)
    for i, line in enumerate(src):
        if not rx.search(line):
            continue
        if edit.op == "replace":
            src[i] = rx.sub(lambda _m: edit.text, line, count=1)
            first = last = i + 1
        else:
            indent = line[: len(line) - len(line.lstrip())]
            block = "".join(indent + t + "\n" for t in edit.text.split("\n"))
            src.insert(i + 1, block)
            first, last = i + 2, i + 1 + len(edit.text.split("\n"))
        with open(path, "w") as f:
            f.write("".join(src))
        return first, last
    raise SystemExit(f"pattern {edit.pattern!r} not found in {path}")


def _expected(d, script, cause):
    spec = EXPECT.get((script, cause)) or _more()[1].get((script, cause))
    if spec is None:
        return None
    path, pattern = spec
    with open(os.path.join(d, path)) as f:
        hits = [i + 1 for i, line in enumerate(f) if re.search(pattern, line)]
    return f"{path}:{hits[0]}-{hits[-1]}" if hits else None


def apply_edits(d, script, cause):
    """The cause's edits made in the scratch copy `d`; "file:first-last" of the lines a right
    finding names, or None when the script has no such cause."""
    edits = EDITS.get(script, {}).get(cause) or _more()[0].get(script, {}).get(cause)
    if not edits:
        return None
    where = None
    for edit in edits:
        first, last = _apply(d, edit)
        where = where or f"{edit.file}:{first}-{last}"
    return _expected(d, script, cause) or where
