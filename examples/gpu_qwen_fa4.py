"""A small Qwen3.5-style decoder on one GPU: the seed case's shape, for real.

Packed variable-length batches (padding-free), GQA attention through FlashAttention-4's
varlen kernel (head_dim 128 or 256), RMSNorm, SwiGLU MLP, bf16 weights, AdamW, and one
Megatron-format log line per step. `--max-seqlen-as tensor` passes max_seqlen the way the
seed's framework did (`cu_seqlens.diff().max()`, a 0-dim CUDA tensor); with flash-attn-4
<= 4.0.0b21 that makes every backward recompile. `--attention-backend sdpa` runs the same
model through PyTorch's SDPA, one packed document at a time (nothing to compile).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_log import log_line  # noqa: E402

try:  # imported up front, as training frameworks do: the import costs seconds
    from flash_attn.cute import flash_attn_varlen_func
except ImportError:  # --attention-backend sdpa needs no FA4
    flash_attn_varlen_func = None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=16384, help="packed tokens per step")
    p.add_argument("--min-doc", type=int, default=256)
    p.add_argument("--max-doc", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128, choices=[64, 128, 256])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seqlen-as", choices=["int", "tensor"], default="int")
    p.add_argument("--attention-backend", choices=["fa4", "sdpa"], default="fa4")
    return p.parse_args(argv)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope(x, positions, base=10000.0):
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(q, k, v, cu_seqlens, max_seqlen, backend):
    if backend == "fa4":
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                     max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=True)
        return out[0] if isinstance(out, tuple) else out
    outs = []
    rep = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 1),
                                                   vs.repeat_interleave(rep, 1),
                                                   is_causal=True)[0].transpose(0, 1))
    return torch.cat(outs)


class Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        hd = a.head_dim
        self.norm1 = RMSNorm(a.hidden)
        self.q = nn.Linear(a.hidden, a.heads * hd, bias=False)
        self.kv = nn.Linear(a.hidden, 2 * a.kv_heads * hd, bias=False)
        self.q_norm, self.k_norm = RMSNorm(hd), RMSNorm(hd)
        self.o = nn.Linear(a.heads * hd, a.hidden, bias=False)
        self.norm2 = RMSNorm(a.hidden)
        self.up = nn.Linear(a.hidden, 2 * 4 * a.hidden // 2, bias=False)
        self.down = nn.Linear(4 * a.hidden // 2, a.hidden, bias=False)

    def forward(self, x, positions, cu_seqlens, max_seqlen):
        a = self.a
        h = self.norm1(x)
        q = self.q_norm(self.q(h).view(-1, a.heads, a.head_dim))
        k, v = self.kv(h).view(-1, 2, a.kv_heads, a.head_dim).unbind(1)
        k = self.k_norm(k)
        q, k = rope(q, positions), rope(k, positions)
        att = attention(q, k.contiguous(), v.contiguous(), cu_seqlens, max_seqlen,
                        a.attention_backend)
        x = x + self.o(att.reshape(-1, a.heads * a.head_dim))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden)
        self.head = nn.Linear(a.hidden, a.vocab, bias=False)

    def forward(self, tokens, positions, cu_seqlens, max_seqlen):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions, cu_seqlens, max_seqlen)
        return self.head(self.norm(x))


def packed_batch(step, a, device):
    """Documents of random length packed into `a.tokens` tokens; targets follow a fixed rule
    of the current token 90 % of the time, so the loss has something to learn."""
    g = torch.Generator().manual_seed(a.seed * 100003 + step)
    lens = []
    while sum(lens) < a.tokens:
        lens.append(int(torch.randint(a.min_doc, a.max_doc + 1, (1,), generator=g)))
    lens[-1] -= sum(lens) - a.tokens
    lens = [n for n in lens if n > 1]
    tokens = torch.randint(a.vocab, (a.tokens,), generator=g)
    noise = torch.randint(a.vocab, (a.tokens,), generator=g)
    follow = torch.rand(a.tokens, generator=g) < 0.9
    targets = torch.where(follow, (tokens * 17 + 3) % a.vocab, noise)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])
    return (tokens.to(device), targets.to(device), positions.to(device), cu.to(device),
            max(lens))


def main(argv=None):
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    device = "cuda"
    model = Model(a).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f} M parameters, {a.layers} layers, head_dim {a.head_dim}, "
          f"backend {a.attention_backend}, max_seqlen as {a.max_seqlen_as}", flush=True)
    for step in range(1, a.steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens, targets, positions, cu_seqlens, max_len = packed_batch(step, a, device)
        # the framework bug of the seed case: a 0-dim CUDA tensor instead of a Python int
        max_seqlen = cu_seqlens.diff().max() if a.max_seqlen_as == "tensor" else max_len
        logits = model(tokens, positions, cu_seqlens, max_seqlen)
        loss = F.cross_entropy(logits.float(), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - t0) * 1000
        log_line(step, a.steps, elapsed_ms, a.lr, 1, loss_value, a.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
