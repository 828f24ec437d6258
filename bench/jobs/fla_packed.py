"""flash-linear-attention's gated delta rule (`chunk_gated_delta_rule`, forward) on packed batches
whose total length changes every step: the layer of Qwen3-Next / Qwen3.5's linear-attention
blocks, fed the way a padding-free packing collator feeds it (one row, `cu_seqlens`).

The FLA op runs forward only (its backward refuses Triton < 3.7.1 on Hopper); a small readout on
its output is trained with AdamW so every iteration is an optimizer step with a loss. One
Megatron-format log line per step. On a fresh machine the first step pays for Triton autotuning
every FLA kernel on the path; `kernel-cache warm --from-run` moves that before training.

  python bench/jobs/fla_packed.py --steps 8 --tokens 8192
"""
import argparse
import time

import torch
import torch.nn.functional as F


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="mean packed tokens per step")
    p.add_argument("--jitter", type=int, default=1024, help="the total length varies by up to this")
    p.add_argument("--min-doc", type=int, default=128)
    p.add_argument("--max-doc", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def packed_lengths(gen, total, lo, hi):
    lengths, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    return lengths


def main(argv=None):
    args = parse_args(argv)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # the job's own import

    device = "cuda"
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    H, D = args.heads, args.head_dim
    readout = torch.nn.Linear(H * D, 1, device=device)
    opt = torch.optim.AdamW(readout.parameters(), lr=1e-3)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        total = args.tokens + int(torch.randint(-args.jitter, args.jitter + 1, (1,), generator=gen))
        lengths = packed_lengths(gen, total, args.min_doc, args.max_doc)
        cu_seqlens = torch.tensor([0] + lengths, device=device).cumsum(0)
        q = torch.randn(1, total, H, D, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, total, H, D, device=device, dtype=torch.bfloat16)
        v = torch.randn(1, total, H, D, device=device, dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(1, total, H, device=device, dtype=torch.float32))
        beta = torch.randn(1, total, H, device=device, dtype=torch.bfloat16).sigmoid()
        with torch.no_grad():
            out, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens,
                                            use_qk_l2norm_in_kernel=True)
        target = v.float().mean(dim=(2, 3))[..., None]
        loss = F.mse_loss(readout(out.float().reshape(1, total, H * D)), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = float(loss)  # syncs: the step is done on the GPU
        ms = (time.perf_counter() - start) * 1000
        print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {step:8d}/{args.steps:8d} | "
              f"consumed samples: {step:12d} | elapsed time per iteration (ms): {ms:.1f} | "
              f"learning rate: 1.000000E-03 | global batch size:     1 | tokens per step: {total} | "
              f"lm loss: {value:.6E} | documents: {len(lengths)} |", flush=True)


if __name__ == "__main__":
    main()
