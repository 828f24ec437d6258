"""Small CPU training jobs that each reproduce one of the usual reasons a training step is slow.

    python examples/pathologies.py --pathology gil          # a helper thread burns the GIL in pure Python
    python examples/pathologies.py --pathology dataloader   # num_workers=0 and a slow collate
    python examples/pathologies.py --pathology gc           # gen-2 collections over a large object graph
    python examples/pathologies.py --pathology sync         # .item() inside the forward, every layer
    python examples/pathologies.py --pathology periodic     # a slow checkpoint write every --every steps
    torchrun --nproc-per-node 2 examples/pathologies.py --pathology straggler   # rank 1 is slow
                                                    # (gloo; NCCL with --device cuda)
    python examples/pathologies.py --pathology none         # healthy

On a GPU (--device cuda), two more that only a GPU shows:
    python examples/pathologies.py --device cuda --pathology launch   # many tiny kernels: launch-bound
    python examples/pathologies.py --device cuda --pathology alloc    # allocator retries, empty_cache

Real AdamW on a small MLP regression task; one Megatron-format log line per step.
"""
import argparse
import gc
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_log import log_line  # noqa: E402

PATHOLOGIES = ("none", "gil", "dataloader", "gc", "sync", "periodic", "straggler", "launch",
               "alloc")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pathology", choices=PATHOLOGIES, default="none")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--every", type=int, default=5, help="periodic: checkpoint every N steps")
    p.add_argument("--checkpoint-seconds", type=float, default=0.3,
                   help="periodic: extra seconds the (slow) storage takes per checkpoint")
    p.add_argument("--slow-seconds", type=float, default=0.25,
                   help="straggler: seconds rank 1 spends outside the collective each step")
    p.add_argument("--gc-freeze", action="store_true",
                   help="the GC prescription: gc.collect(); gc.freeze() after setup")
    p.add_argument("--index-size", type=int, default=150_000,
                   help="gc: objects in the long-lived index")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda (launch and alloc need cuda)")
    p.add_argument("--alloc-fill", type=float, default=0.92,
                   help="alloc: share of free GPU memory the varying blocks fill")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class MLP(nn.Module):
    def __init__(self, width, layers, check_nan=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 1)
        self.check_nan = check_nan

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
            # the pathology: a Python-level check that needs the value on the host (on a GPU each
            # .item() waits for every queued kernel before Python can go on)
            if self.check_nan and torch.isnan(x).any().item():
                raise FloatingPointError("NaN in activations")
        return self.head(x)


# -- data ------------------------------------------------------------------------------------
class Samples(Dataset):
    """Synthetic regression samples: a fixed random linear target plus noise."""

    def __init__(self, n, width, seed):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, width, generator=gen)
        w = torch.randn(width, 1, generator=gen) / width ** 0.5
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def slow_collate(batch):
    """Collate that "normalises" every feature in pure Python (the slow part of the pathology)."""
    rows = []
    for x, y in batch:
        values = x.tolist()
        mean = sum(values) / len(values)
        spread = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 or 1.0
        rows.append(([(v - mean) / spread for v in values], y.item()))
    xs = torch.tensor([r[0] for r in rows])
    ys = torch.tensor([[r[1]] for r in rows])
    return xs, ys


def batches(args, samples):
    if args.pathology == "dataloader":
        loader = DataLoader(samples, batch_size=args.batch_size, shuffle=True, num_workers=0, collate_fn=slow_collate)
    else:
        loader = DataLoader(samples, batch_size=args.batch_size, shuffle=True)
    while True:
        yield from loader


# -- the other pathologies -------------------------------------------------------------------
def count_words_in_python(stop):
    """Pure-Python bookkeeping on a helper thread: it never releases the GIL on its own."""
    text = "the quick brown fox jumps over the lazy dog " * 50
    counts = {}
    while not stop.is_set():
        for word in text.split():
            counts[word] = counts.get(word, 0) + 1
        if len(counts) > 1000:
            counts.clear()


def build_index(n):
    """A large long-lived object graph (a metadata index): every gen-2 collection walks it."""
    return [{"id": i, "tags": [i, str(i)], "parent": None} for i in range(n)]


def record_step_metadata(history, step, n=25_000):
    """Per-step records with reference cycles, kept for a few steps: they survive the young
    generations, get promoted, die there and pile up until a full (gen-2) collection."""
    records = []
    for i in range(n):
        node = {"step": step, "i": i}
        node["self"] = node
        records.append(node)
    history.append(records)
    if len(history) > 3:
        history.pop(0)


_budget = {}


def churn_gpu_memory(device, step, fill):
    """Blocks of a different size every step that together fill most of the GPU: the cached
    blocks of the last step do not fit this step's sizes, cudaMalloc fails, the allocator frees
    its cache and retries (num_alloc_retries); and every 5th step the job empties the cache
    itself (a common 'fix' that makes it worse)."""
    if "bytes" not in _budget:
        _budget["bytes"] = int(torch.cuda.mem_get_info(device)[0] * fill)
    unit = _budget["bytes"] // 40
    blocks = []
    for i in range(5):
        try:
            blocks.append(torch.empty((1 + (step * 7 + i * 13) % 9) * unit, dtype=torch.uint8,
                                      device=device))
        except torch.OutOfMemoryError:
            break
    del blocks
    if step % 5 == 0:
        torch.cuda.empty_cache()


def write_checkpoint(model, step, seconds):
    print(f"saving checkpoint at iteration {step} ...", flush=True)
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        torch.save(model.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
        time.sleep(seconds)  # the slow (network) file system the fake checkpoint stands for


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rank, world = 0, 1
    if args.pathology == "straggler" or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo on the CPU; NCCL with one GPU per rank
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if args.pathology == "launch":  # a deep, narrow model on a tiny batch: µs-long kernels
        args.width, args.layers, args.batch_size = 64, max(args.layers, 48), 4
    model = MLP(args.width, args.layers, check_nan=args.pathology == "sync").to(device)
    samples = Samples(4096, args.width, args.seed + rank)
    data = batches(args, samples)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    stop = threading.Event()
    if args.pathology == "gil":
        threading.Thread(target=count_words_in_python, args=(stop,), name="word-counter",
                         daemon=True).start()
    index = build_index(args.index_size) if args.pathology == "gc" else None
    history = []
    if args.gc_freeze:
        gc.collect()
        gc.freeze()

    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = next(data)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if args.pathology == "alloc" and device.type == "cuda":
            churn_gpu_memory(device, step, args.alloc_fill)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.pathology == "gc":
            record_step_metadata(history, step)
        if world > 1:
            if rank == 1 and args.pathology == "straggler":
                time.sleep(args.slow_seconds)  # stands for a rank that compiles or loads slowly
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if args.pathology == "periodic" and step % args.every == 0:
            write_checkpoint(model, step, args.checkpoint_seconds)
        if rank == 0:
            log_line(step, args.steps, (time.perf_counter() - t0) * 1000, 1e-3,
                     args.batch_size * world, loss.item())
    stop.set()
    if world > 1:
        dist.barrier()  # every rank done with its gloo work before the group is torn down
        dist.destroy_process_group()
    del index
    return 0


if __name__ == "__main__":
    sys.exit(main())
