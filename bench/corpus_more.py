"""Two more public training scripts for bench/corpus.py, from libraries the corpus had not used,
each with its own loop and its own gradient accumulation, and each issue-36 cause written as an
edit of its scratch copy (bench/corpus_model.py's `Edit`):

    nanogpt_train.py nanogpt_model.py nanogpt_configurator.py
        karpathy/nanoGPT train.py, model.py, configurator.py (own loop, GradScaler,
        gradient_accumulation_steps, np.memmap batches); synthetic token files in data/synth
    xt_enwik8.py
        lucidrains/x-transformers train_enwik8.py (Hugging Face Accelerate's Accelerator,
        gradient_accumulate_every, fire CLI); x-transformers from the registry, a random
        data/enwik8.gz, wandb replaced by a local no-op module (no account, no network)

Each script is made tiny by its own flags where it has them (nanoGPT's configurator) and by
editing its constants where it has none (x-transformers' model width), as a user shrinking it
for a smoke test would.
"""

import gzip
import os
import pickle
import shutil

import numpy as np
from corpus_model import HOOK, Edit

MORE_CAUSES = ("keep_loss", "eval_grad", "save")  # causes written here as edits of the script
ISSUE36 = (
    "healthy",
    "anomaly",
    "hook",
    "badaccum",
    "lr0",
    "outside",
    "metric_cb",
    "keep_loss",
    "eval_grad",
    "save",
)

WANDB_STUB = (
    "# no-op stand-in for wandb (no account, no network)\n"
    "class _Run:\n    name = None\n\nrun = _Run()\n\n"
    "def init(*args, **kwargs):\n    return run\n\n"
    "def log(*args, **kwargs):\n    pass\n"
)


def prep_nanogpt(d):
    for f in ("train", "model", "configurator"):
        shutil.move(os.path.join(d, f"nanogpt_{f}.py"), os.path.join(d, f"{f}.py"))
    data = os.path.join(d, "data", "synth")
    os.makedirs(data, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 200_000), ("val", 20_000)):
        rng.integers(0, 65, n, dtype=np.uint16).tofile(os.path.join(data, f"{split}.bin"))
    with open(os.path.join(data, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": 65}, f)


def prep_xt(d):
    os.makedirs(os.path.join(d, "data"), exist_ok=True)
    rng = np.random.default_rng(0)
    with gzip.open(os.path.join(d, "data", "enwik8.gz"), "wb") as f:
        f.write(rng.integers(32, 127, 300_000, dtype=np.uint8).tobytes())
    with open(os.path.join(d, "wandb.py"), "w") as f:
        f.write(WANDB_STUB)
    path = os.path.join(d, "xt_enwik8.py")
    with open(path) as f:
        src = f.read()
    # the smoke-test size: a narrow 2-layer decoder, the split at 90 % of the (small) file
    for old, new in (
        ("dim = 512", "dim = 64"),
        ("depth = 6", "depth = 2"),
        ("heads = 8", "heads = 2"),
        ("[int(90e6)]", "[int(len(data) * 0.9)]"),
    ):
        src = src.replace(old, new)
    with open(path, "w") as f:
        f.write(src)


def script_fields():
    """Keyword arguments of corpus.Script for each new script (corpus.py builds them)."""
    return {
        "nanogpt": {
            "files": ["nanogpt_train.py", "nanogpt_model.py", "nanogpt_configurator.py"],
            "main": "train.py",
            "argv": [
                "--dataset=synth",
                "--device=cpu",
                "--compile=False",
                "--dtype=float32",
                "--n_layer=2",
                "--n_head=2",
                "--n_embd=64",
                "--block_size=64",
                "--batch_size=8",
                "--gradient_accumulation_steps=4",
                "--eval_interval=1000000",  # nanoGPT's default (2000) is past the run: one eval, at 0
                "--eval_iters=2",
                "--max_iters=100000",
                "--warmup_iters=10",
                "--always_save_checkpoint=False",
            ],
            "loop_file": "train.py",
            "loop_anchor": r"^\s+scaler\.update\(\)",
            "model": "raw_model",
            "loss": "loss",
            "setup_file": "train.py",
            "setup_anchor": r"^torch\.manual_seed\(",
            "prepare": prep_nanogpt,
            # grad left on in an evaluation run every 5th iteration (its own flag; the edit below)
            "flag_causes": {"eval_grad": ["--eval_interval=5"]},
            "only_causes": ISSUE36,
        },
        "xt": {
            "files": ["xt_enwik8.py"],
            "main": "xt_enwik8.py",
            "argv": [
                "--seq_len=64",
                "--batch_size=4",
                "--gradient_accumulate_every=4",
                "--validate_every=4",
                "--generate_every=1000000",
                "--generate_length=8",
                "--cpu=True",
            ],
            "loop_file": "xt_enwik8.py",
            "loop_anchor": r"^\s+optim\.zero_grad\(\)",
            "model": "model",
            "loss": "loss",
            "setup_file": "xt_enwik8.py",
            "setup_anchor": r"^\s+device = accelerator\.device",
            "prepare": prep_xt,
            "only_causes": ISSUE36,
        },
    }


NANO_STEP_IN_LOOP = (
    "if grad_clip != 0.0:\n"
    "    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n"
    "scaler.step(optimizer)\n"
    "scaler.update()\n"
    "optimizer.zero_grad(set_to_none=True)"
)
NANO_METRIC = (
    "_tdx_seen.append(logits.detach())  # the epoch's predictions so far, judged on every step\n"
    "epoch_score_ranks = torch.cat(_tdx_seen).softmax(-1).flatten().argsort()  # an AUROC's ranks"
)
NANO_BODY = "model.transformer.h.parameters()"
NANO_REST = "[model.transformer.wte.weight, *model.transformer.wpe.parameters(), *model.transformer.ln_f.parameters()]"
XT_METRIC = (
    "with torch.no_grad():  # the epoch's predictions so far, judged on every step\n"
    "    _tdx_seen.append(model.net(batch))\n"
    "epoch_score_ranks = torch.cat(_tdx_seen).softmax(-1).flatten().argsort()  # an AUROC's ranks"
)
XT_REST = "[p for n, p in model.named_parameters() if '.attn_layers.' not in n]"
XT_BODY = "[p for n, p in model.named_parameters() if '.attn_layers.' in n]"
NANO_OPT = r"^optimizer = model\.configure_optimizers\(.*$"
XT_OPT = r"torch\.optim\.Adam\(model\.parameters\(\), "

EDITS = {
    "nanogpt": {
        "hook": [Edit("train.py", r"^model\.to\(device\)", HOOK.format(model="model"))],
        "badaccum": [Edit("train.py", r"^\s+scaler\.scale\(loss\)\.backward\(\)", NANO_STEP_IN_LOOP)],
        "lr0": [
            Edit(
                "train.py",
                NANO_OPT,
                f"optimizer = torch.optim.AdamW([{{'params': {NANO_BODY}, 'lr': 0.0, 'frozen': True}}, "
                f"{{'params': {NANO_REST}}}], lr=learning_rate, betas=(beta1, beta2))",
                "replace",
            ),
            Edit(
                "train.py",
                r"param_group\['lr'\] = lr$",
                "param_group['lr'] = 0.0 if param_group.get('frozen') else lr",
                "replace",
            ),
        ],
        "outside": [
            Edit(
                "train.py",
                NANO_OPT,
                f"optimizer = torch.optim.AdamW({NANO_REST}, lr=learning_rate, betas=(beta1, beta2))",
                "replace",
            )
        ],
        "metric_cb": [
            Edit("train.py", r"^running_mfu = -1\.0", "_tdx_seen = []"),
            Edit("train.py", r"^\s+scaler\.update\(\)", NANO_METRIC),
        ],
        "keep_loss": [
            Edit("train.py", r"^running_mfu = -1\.0", "total_loss = 0.0"),
            Edit("train.py", r"^\s+scaler\.scale\(loss\)\.backward\(\)", "total_loss += loss"),
        ],
        "eval_grad": [Edit("train.py", r"^@torch\.no_grad\(\)\n", "", "replace")],
    },
    "xt": {
        "hook": [
            Edit("xt_enwik8.py", r"^\s+model = AutoregressiveWrapper\(model\)", HOOK.format(model="model"))
        ],
        "badaccum": [
            Edit(
                "xt_enwik8.py",
                r"^\s+accelerator\.backward\(loss / gradient_accumulate_every\)",
                "accelerator.clip_grad_norm_(model.parameters(), 0.5)\noptim.step()\noptim.zero_grad()",
            )
        ],
        "lr0": [
            Edit(
                "xt_enwik8.py",
                XT_OPT,
                f"torch.optim.Adam([{{'params': {XT_BODY}, 'lr': 0.0}}, {{'params': {XT_REST}}}], ",
                "replace",
            )
        ],
        "outside": [Edit("xt_enwik8.py", XT_OPT, f"torch.optim.Adam({XT_REST}, ", "replace")],
        "metric_cb": [
            Edit("xt_enwik8.py", r"^\s+# training$", "_tdx_seen = []"),
            Edit(
                "xt_enwik8.py",
                r"loss = model\(next\(train_loader\)\)",
                "batch = next(train_loader); loss = model(batch)",
                "replace",
            ),
            Edit("xt_enwik8.py", r"^\s+optim\.zero_grad\(\)", XT_METRIC),
        ],
        "keep_loss": [
            Edit("xt_enwik8.py", r"^\s+# training$", "total_loss = 0."),
            Edit(
                "xt_enwik8.py",
                r"^\s+accelerator\.backward\(loss / gradient_accumulate_every\)",
                "total_loss += loss",
            ),
        ],
        "eval_grad": [
            Edit("xt_enwik8.py", r"with torch\.no_grad\(\):", "with accelerator.autocast():", "replace")
        ],
    },
}
# where a right finding names the cause when it is not the edited line
EXPECT = {
    ("nanogpt", "lr0"): ("model.py", r"h = nn\.ModuleList"),
    ("nanogpt", "outside"): ("model.py", r"h = nn\.ModuleList"),
    # the evaluation's function, from its def to its forward call
    ("nanogpt", "eval_grad"): ("train.py", r"^def estimate_loss|^ {16}logits, loss = model\(X, Y\)"),
    ("xt", "lr0"): ("xt_enwik8.py", r"attn_layers = Decoder\("),
    ("xt", "outside"): ("xt_enwik8.py", r"attn_layers = Decoder\("),
    ("xt", "keep_loss"): ("xt_enwik8.py", r"total_loss \+= loss"),
    ("nanogpt", "keep_loss"): ("train.py", r"total_loss \+= loss"),
    ("nanogpt", "metric_cb"): ("train.py", r"_tdx_seen\.append|epoch_score_ranks = "),
    ("xt", "metric_cb"): ("xt_enwik8.py", r"_tdx_seen\.append|epoch_score_ranks = "),
}


def has_edits(script, cause):
    return bool(EDITS.get(script, {}).get(cause))
