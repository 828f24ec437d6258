"""GPU time spent where the device is slow (issue 37), each case with its fixed twin; run on a GPU
(bench/gpu_device_cases.sh runs every pair under diagnose; `--small` is a CPU check of the code).

    python bench/jobs/gpu_math_cases.py --case fp32            # a matmul-bound MLP in full fp32
    python bench/jobs/gpu_math_cases.py --case fp32 --fixed    # ... its forward under bf16 autocast
    --case tf32_off      the job turns TF32 off (torch.backends.cuda.matmul.allow_tf32 = False);
                         fixed: torch.set_float32_matmul_precision("high")
    --case cudnn_shapes  a conv net with cudnn.benchmark = True and a new image size every step;
                         fixed: sizes padded to three buckets
    --case dtoh_metric   a running accuracy that copies the full logits to the host every step;
                         fixed: argmax and count on the device, one number read
    --case odd_matmul    matmuls of odd sizes (4095 x 4097): fixed: sizes padded to multiples of 64
    --case sdpa_math     attention through SDPA with head size 125 and a float mask (no fused
                         kernel takes it: the math path, bmm + softmax); fixed: head size 128,
                         is_causal (a fused flash kernel)
    (dtoh_metric, odd_matmul, sdpa_math and grow_memory run under bf16 autocast in both arms:
    each case differs from its twin by its one cause)
    --case foreach_off   AdamW with foreach=False over 2,000 small tensors; fixed: fused=True
    --case grow_memory   the step's outputs kept with their graph in a list every step (memory
                         grows); fixed: only their argmax kept

Real training steps (AdamW, cross-entropy or MSE) on synthetic data; each pair runs the same
math for the same number of steps and prints `step N loss L ms T ... tokens per step: N`.
"""

import argparse
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CASES = (
    "fp32",
    "tf32_off",
    "cudnn_shapes",
    "dtoh_metric",
    "odd_matmul",
    "sdpa_math",
    "foreach_off",
    "grow_memory",
)


BF16_BOTH = ("dtoh_metric", "odd_matmul", "sdpa_math", "grow_memory")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=CASES, required=True)
    p.add_argument("--fixed", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny sizes (a CPU check of the code)")
    return p.parse_args(argv)


def mlp(width, layers, d_in, d_out):
    blocks = [nn.Linear(d_in, width), nn.GELU()]
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(width, d_out))


class Attention(nn.Module):
    def __init__(self, dim, heads, causal_fused):
        super().__init__()
        self.heads, self.fused = heads, causal_fused
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def sdpa_dim(a):
    """Head size 125 (no fused kernel takes it: SDPA's math path); fixed: 128."""
    if a.small:
        return 64 if a.fixed else 62
    return 1024 if a.fixed else 1000


def sizes(a):
    """(width, layers, batch) per case; --small divides them."""
    table = {
        "fp32": (4096, 6, 8192),
        "tf32_off": (4096, 6, 8192),
        "dtoh_metric": (2048, 2, 4096),
        "odd_matmul": (4097, 6, 4095),
        "foreach_off": (64, 1000, 64),
        "grow_memory": (4096, 4, 8192),
    }
    width, layers, batch = table.get(a.case, (1024, 2, 64))
    if a.small:
        width, layers, batch = max(8, width // 64), min(layers, 4), max(8, batch // 64)
    if a.case == "odd_matmul" and a.fixed:
        width, batch = -(-width // 64) * 64, -(-batch // 64) * 64
    return width, layers, batch


def build(a, dev):
    width, layers, batch = sizes(a)
    if a.case == "cudnn_shapes":
        ch = 8 if a.small else 64
        model = nn.Sequential(
            nn.Conv2d(3, ch, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(ch, ch, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(ch, 10),
        )
    elif a.case == "sdpa_math":
        dim = sdpa_dim(a)
        model = nn.Sequential(Attention(dim, 8 if not a.small else 2, a.fixed), nn.Linear(dim, 256))
    elif a.case == "dtoh_metric":
        model = mlp(width, layers, 256, 32000 if not a.small else 100)  # a vocabulary-sized head
    else:
        model = mlp(width, layers, width, width if a.case != "foreach_off" else 1)
    return model.to(dev), batch


def batch_for(a, step, dev, batch, width):
    if a.case == "cudnn_shapes":
        side = (32 if a.small else 96) + step % 61  # a new image size every step
        if a.fixed:
            side = next(b for b in (64, 128, 160, 256) if b >= side)  # three buckets (pad)
        n = 4 if a.small else 64
        return torch.randn(n, 3, side, side, device=dev), torch.randint(0, 10, (n,), device=dev)
    if a.case == "sdpa_math":
        t = 16 if a.small else 2048
        x = torch.randn(4 if a.small else 8, t, sdpa_dim(a), device=dev)
        return x, torch.randint(0, 256, (x.shape[0], t), device=dev)
    if a.case == "dtoh_metric":
        x = torch.randn(batch, 256, device=dev)
        return x, torch.randint(0, 32000 if not a.small else 100, (batch,), device=dev)
    x = torch.randn(batch, width, device=dev)
    return x, x.sum(-1, keepdim=True) if a.case == "foreach_off" else x.roll(1, -1)


def loss_of(a, out, y):
    if a.case in ("cudnn_shapes", "dtoh_metric"):
        return F.cross_entropy(out.float(), y)
    if a.case == "sdpa_math":
        return F.cross_entropy(out.float().flatten(0, 1), y.flatten())
    return F.mse_loss(out.float(), y.float())


def setup(a, cuda):
    if a.case == "tf32_off":
        if a.fixed:
            torch.set_float32_matmul_precision("high")
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
    if a.case == "cudnn_shapes":
        torch.backends.cudnn.benchmark = True


def main(argv=None):
    a = parse_args(argv)
    dev = a.device if torch.cuda.is_available() or a.device == "cpu" else "cpu"
    cuda = dev.startswith("cuda")
    setup(a, cuda)
    torch.manual_seed(0)
    model, batch = build(a, dev)
    width = sizes(a)[0]
    many = a.case == "foreach_off"
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=1e-4,
        foreach=False if many and not a.fixed else None,
        fused=True if many and a.fixed and cuda else None,
    )
    # one cause per case: the cases whose cause is not the precision run bf16 autocast in both arms
    autocast = (a.case == "fp32" and a.fixed) or a.case in BF16_BOTH
    kept, correct, seen = [], 0, 0
    tokens = batch if a.case != "sdpa_math" else None
    t_prev = time.perf_counter()
    for step in range(a.steps):
        x, y = batch_for(a, step, dev, batch, width)
        with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=autocast and cuda):
            out = model(x)
        loss = loss_of(a, out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if a.case == "dtoh_metric":
            if a.fixed:
                correct += int((out.argmax(-1) == y).sum())
            else:
                logits = out.detach().cpu()  # the whole logits to the host for a running accuracy
                correct += int((logits.argmax(-1) == y.cpu()).sum())
            seen += y.numel()
        if a.case == "grow_memory":
            # the step's predictions kept for an epoch metric: with their graph (memory grows by
            # an activation a step); fixed: the predicted classes only
            kept.append(out.detach().argmax(-1) if a.fixed else out)
        value = loss.item()
        now = time.perf_counter()
        acc = f" acc {correct / max(seen, 1):.3f}" if a.case == "dtoh_metric" else ""
        print(
            f"step {step} loss {value:.4f} ms {(now - t_prev) * 1000:.2f}{acc} tokens per step: {tokens or y.numel()}",
            flush=True,
        )
        t_prev = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
