"""A training loop shaped like torchtitan's (its trainer needs CUDA and a process group, so
this is its pattern, not its package): the model split in parts with one optimizer per part
behind an `OptimizersContainer` that is itself a torch Optimizer (torchtitan calls
`Optimizer.__init__(self, all_params, {})` on it), a `[titan]` logger, and its coloured step
line from torchtitan/components/metrics.py. Settings come from a TOML-like config dict whose
keys mirror torchtitan's (`training.steps`, `checkpoint.interval`, `metrics.log_freq`).

--checkpoint-interval N: save a checkpoint every N steps, synchronously (torchtitan's
`checkpoint.interval` with `async_mode = "disabled"`).
"""
import argparse
import atexit
import io
import logging
import os
import shutil
import tempfile
import time

import torch
from torch import nn
from torch.optim import Optimizer

logger = logging.getLogger()


class Color:  # torchtitan/tools/utils.py
    red = "\033[31m"
    green = "\033[32m"
    yellow = "\033[33m"
    blue = "\033[34m"
    magenta = "\033[35m"
    cyan = "\033[36m"
    reset = "\033[39m"
    orange = "\033[38;2;180;60;0m"
    turquoise = "\033[38;2;54;234;195m"


class OptimizersContainer(Optimizer):
    """One optimizer per model part, stepped together (torchtitan/components/optimizer)."""

    def __init__(self, model_parts, lr):
        self.optimizers = [torch.optim.AdamW(part.parameters(), lr=lr) for part in model_parts]
        all_params = [p for part in model_parts for p in part.parameters()]
        Optimizer.__init__(self, all_params, {})

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def build_model_parts(vocab, dim):
    first = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.GELU())
    last = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, vocab))
    return [first, last]


class NetworkFile(io.FileIO):
    """A file on a network file system: every write waits for the server (~2 ms)."""

    def write(self, data):
        time.sleep(0.002)
        return super().write(data)


def save_checkpoint(model_parts, optimizers, step, folder):
    begin = time.monotonic()
    state = {"model": [p.state_dict() for p in model_parts],
             "optim": [o.state_dict() for o in optimizers.optimizers], "step": step}
    path = os.path.join(folder, f"step-{step}.pt")
    with NetworkFile(path, "w") as f:
        torch.save(state, f)
    logger.info(f"Finished saving the checkpoint in {time.monotonic() - begin:.2f} seconds.")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--training.steps", dest="steps", type=int, default=12)
    p.add_argument("--checkpoint.interval", dest="interval", type=int, default=0)
    p.add_argument("--metrics.log_freq", dest="log_freq", type=int, default=1)
    args = p.parse_args()
    logging.basicConfig(format="[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s",
                        level=logging.INFO)
    torch.manual_seed(0)
    vocab, dim, seq, batch = 256, 32, 32, 8
    model_parts = build_model_parts(vocab, dim)
    optimizers = OptimizersContainer(model_parts, lr=1e-3)
    color = Color()
    folder = tempfile.mkdtemp(prefix="titan-ckpt-")
    atexit.register(shutil.rmtree, folder, True)
    logger.info(f"Training starts at step 1, total steps {args.steps}")
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        h = inputs
        for part in model_parts:
            h = part(h)
        loss = nn.functional.cross_entropy(h.flatten(0, 1), labels.flatten())
        optimizers.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for part in model_parts for p in part.parameters()], 1.0)
        optimizers.step()
        if step % args.log_freq == 0:
            tps = batch * seq / (time.perf_counter() - t0)
            logger.info(
                f"{color.red}step: {step:2}  "
                f"{color.green}loss: {loss.item():8.5f}  "
                f"{color.orange}grad_norm: {grad_norm.item():7.4f}  "
                f"{color.turquoise}memory: {0.0:5.2f}GiB({0.0:.2f}%)  "
                f"{color.blue}tps: {round(tps):,}  "
                f"{color.cyan}tflops: {0.0:,.2f}  "
                f"{color.magenta}mfu: N/A{color.reset}")
        if args.interval and step % args.interval == 0:
            save_checkpoint(model_parts, optimizers, step, folder)
    logger.info("Training completed")


if __name__ == "__main__":
    main()
