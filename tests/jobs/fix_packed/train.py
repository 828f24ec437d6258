"""Train the packed decoder: `python train.py --steps 8`."""
import argparse
import sys
import time

import torch
import torch.nn.functional as F
from packlib.collate import collate_packed, make_samples
from packlib.layers import ON_GPU, PackedDecoder


def to_device(batch, device):
    """Tensors to the device; other values (ints, strings) as they are."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
            for k, v in batch.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=768)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--min-len", type=int, default=144)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if ON_GPU else "cpu"
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = PackedDecoder(args.vocab, args.d_model, args.layers, args.heads, args.kv_heads,
                          args.head_dim, args.max_len + 1).to(device)
    if ON_GPU:
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = collate_packed(make_samples(gen, args.tokens, args.min_len, args.max_len, args.vocab))
        batch = to_device(batch, device)
        logits = model(batch)
        loss = F.cross_entropy(logits.float(), batch["labels"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step: {step}  loss: {loss.item():.4f}  time: {1000 * (time.perf_counter() - t0):.1f}ms",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
