"""Slowdowns of classes no issue of traindx names, each from a report users of PyTorch, HF, timm
or Lightning filed, each with its fixed twin (same maths, the fast way): issue 46's proof of
generality. They were written and judged before any rule for them existed; nothing in traindx
may key on these names.

  --case ema_loop     an EMA of the weights updated parameter by parameter in a Python loop
                      (mul_/add_ per tensor); twin: one torch._foreach_lerp_ over all tensors.
                      open-mmlab/mmengine PR #281 "Optimize parameter updating speed in
                      AveragedModel"; lucidrains/ema-pytorch #5 "about the training speed";
                      deepmodeling/deepmd-kit #5818 ("launches one interpolation operation per
                      parameter ... scales with the number of parameter tensors")
  --case clip_loop    gradient-norm clipping written as a loop over parameters (norm, square,
                      add, then a multiply per tensor); twin: torch.nn.utils.clip_grad_norm_
                      (foreach). pytorch/pytorch PR #91846 "Foreach gradient clipping";
                      pytorch/pytorch #39988 "clip_grad_norm_ is too slow"; #31474
  --case attn_manual  attention written by hand (q@kᵀ, causal masked_fill, softmax, @v: the
                      T×T scores materialised); twin: F.scaled_dot_product_attention.
                      facebookresearch/multimodal PR #538 "Replace custom SDPA with
                      F.scaled_dot_product_attention"; pytorch/pytorch #98505 (why SDPA is faster:
                      it never materialises the weights)
  --case mha_weights  nn.MultiheadAttention called with its default need_weights=True while the
                      weights are thrown away (`y, _ = attn(x, x, x)`); twin: need_weights=False.
                      lyuwenyu/RT-DETR PR #680 (#678) "Pass need_weights=False to
                      MultiheadAttention"; automl/nanoTabPFN PR #15 "speedup mha without attention
                      weights"
  --case rmsnorm      RMSNorm written as elementwise ops (HF's LlamaRMSNorm: fp32 upcast, pow,
                      mean, rsqrt, mul, downcast, weight mul); twin: F.rms_norm.
                      baidu-baige/LoongForge PR #136 "fuse FastWAM DiT q/k RMSNorm into
                      F.rms_norm"; pytorch/pytorch PR #153666 "Fused RMSNorm implementation"
                      ("around 9x speedup vs unfused")
  --case embed_dense  a bag-of-words model with a huge-vocabulary nn.Embedding and a dense
                      gradient (the whole table zeroed, then updated by SGD each step); twin:
                      sparse=True (SGD without momentum: the same update). pytorch/pytorch #5309
                      "Slow optimization with large vocabulary size embedding matrices"
  --case sample_loss  the loss computed in a Python loop over the batch's samples; twin: one
                      vectorised call (the same mean). Stack Overflow "How can I vectorize this
                      for-loop loss function?" ("50% of the training time is spent computing the
                      loss")
  --case cat_loop     a sequence model that grows its output with torch.cat every time step
                      (quadratic copies); twin: the steps collected in a list, stacked once.
                      ulissigroup/amptorch #12 / PR #13 "torch.cat() bottleneck"; pytorch/audio
                      PR #1850 "Avoid concatenation in loop"

Each step prints `step N loss X ms Y` (the job's own step time). --small: tiny sizes that run
on the CPU (a check of the code; the host-bound cases keep their class there).
"""

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

CASES = (
    "ema_loop",
    "clip_loop",
    "attn_manual",
    "mha_weights",
    "rmsnorm",
    "embed_dense",
    "sample_loss",
    "cat_loop",
)


class Deep(nn.Module):
    """Many small layers: many parameter tensors (an EMA or a clip loop pays per tensor)."""

    def __init__(self, width, depth, classes):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class EMA:
    def __init__(self, model, decay=0.999):
        self.decay = decay
        self.shadow = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update_loop(self, model):
        for e, p in zip(self.shadow, model.parameters()):
            e.mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)

    @torch.no_grad()
    def update_foreach(self, model):
        torch._foreach_lerp_(self.shadow, [p.detach() for p in model.parameters()], 1.0 - self.decay)


def clip_by_loop(params, max_norm):
    total = None
    for p in params:
        sq = p.grad.norm() ** 2
        total = sq if total is None else total + sq
    coef = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef)


class Attention(nn.Module):
    def __init__(self, width, heads, manual):
        super().__init__()
        self.heads, self.manual = heads, manual
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.manual:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class RMSNorm(nn.Module):
    def __init__(self, width, fused, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.fused, self.eps = fused, eps

    def forward(self, x):
        if self.fused:
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        dtype = x.dtype  # transformers' LlamaRMSNorm, as written there
        x = x.float()
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        return self.weight * x.to(dtype)


class Block(nn.Module):
    """A pre-norm transformer block: attention (by hand or SDPA), an MLP, norms of a kind."""

    def __init__(self, width, heads, manual_attn=False, rms=None):
        super().__init__()
        self.norm1 = RMSNorm(width, fused=rms == "fused") if rms else nn.LayerNorm(width)
        self.norm2 = RMSNorm(width, fused=rms == "fused") if rms else nn.LayerNorm(width)
        self.attn = Attention(width, heads, manual_attn)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, vocab, width, heads, depth, **kw):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, **kw) for _ in range(depth))
        self.out = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class EncoderBlock(nn.Module):
    """A ViT-style block around nn.MultiheadAttention, whose weights the caller throws away."""

    def __init__(self, width, heads, need_weights):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.need_weights = need_weights

    def forward(self, x):
        h = self.norm1(x)
        y, _ = self.attn(h, h, h, need_weights=self.need_weights)
        x = x + y
        return x + self.mlp(self.norm2(x))


class Encoder(nn.Module):
    def __init__(self, width, heads, depth, classes, need_weights):
        super().__init__()
        self.blocks = nn.Sequential(*(EncoderBlock(width, heads, need_weights) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(x).mean(1))


class BagOfWords(nn.Module):
    def __init__(self, vocab, dim, width, classes, sparse):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, sparse=sparse)
        self.mlp = nn.Sequential(
            nn.Linear(dim, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, classes)
        )

    def forward(self, idx):
        return self.mlp(self.embed(idx).mean(1))


class Stepper(nn.Module):
    """A step-by-step sequence model (an RNN-style decoder): one cell per time step, the
    outputs grown with torch.cat (the cause) or collected and stacked once (the twin)."""

    def __init__(self, width, classes, grow):
        super().__init__()
        self.cell = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, classes)
        self.grow = grow

    def forward(self, x):
        h = torch.zeros_like(x[:, 0])
        if self.grow:
            out = x.new_zeros(x.shape[0], 0, x.shape[2])
            for t in range(x.shape[1]):
                h = self.cell(x[:, t] + h)
                out = torch.cat([out, h[:, None]], dim=1)
        else:
            steps = []
            for t in range(x.shape[1]):
                h = self.cell(x[:, t] + h)
                steps.append(h)
            out = torch.stack(steps, dim=1)
        return self.head(out.mean(1))


def per_sample_loss(out, y):
    losses = []
    for i in range(out.shape[0]):
        losses.append(F.cross_entropy(out[i : i + 1], y[i : i + 1]))  # noqa: PERF401 (the case: a loop over samples)
    return torch.stack(losses).mean()


def _tokens(dev, vocab, batch, seq):
    def make():
        idx = torch.randint(0, vocab, (batch, seq + 1), device=dev)
        return idx[:, :-1], idx[:, 1:]

    return make


def _vectors(dev, shape, classes):
    def make():
        return torch.randn(*shape, device=dev), torch.randint(0, classes, (shape[0],), device=dev)

    return make


def build(a, dev):
    """(model, batch maker, sizes) of one case and arm; sizes: what the loop needs to know."""
    bad, s = not a.fixed, a.small
    if a.case in ("ema_loop", "clip_loop", "sample_loss"):
        width, depth, classes, batch = (32, 24, 10, 64) if s else (256, 200, 1000, 1024)
        if a.case == "sample_loss":
            width, depth, classes, batch = (32, 2, 10, 128) if s else (1024, 8, 1000, 1024)
        return Deep(width, depth, classes), _vectors(dev, (batch, width), classes)
    if a.case in ("attn_manual", "rmsnorm"):
        vocab, width, heads, depth, batch, seq = (
            (128, 64, 4, 2, 2, 64) if s else (8192, 1024, 16, 6, 8, 2048 if a.case == "rmsnorm" else 1024)
        )
        kw = {"manual_attn": bad} if a.case == "attn_manual" else {"rms": "eager" if bad else "fused"}
        return LM(vocab, width, heads, depth, **kw), _tokens(dev, vocab, batch, seq)
    if a.case == "mha_weights":
        width, heads, depth, classes, batch, seq = (
            (64, 4, 2, 10, 4, 64) if s else (768, 12, 6, 1000, 16, 1024)
        )
        return Encoder(width, heads, depth, classes, need_weights=bad), _vectors(
            dev, (batch, seq, width), classes
        )
    if a.case == "embed_dense":
        vocab, dim, width, classes, batch, seq = (
            (200_000, 64, 64, 10, 64, 16) if s else (4_000_000, 256, 4096, 1000, 8192, 64)
        )
        return BagOfWords(vocab, dim, width, classes, sparse=not bad), _tokens_bow(
            dev, vocab, batch, seq, classes
        )
    width, classes, batch, seq = (64, 10, 16, 64) if s else (4096, 1000, 256, 256)
    return Stepper(width, classes, grow=bad), _vectors(dev, (batch, seq, width), classes)


def _tokens_bow(dev, vocab, batch, seq, classes):
    def make():
        idx = torch.randint(0, vocab, (batch, seq), device=dev)
        return idx, torch.randint(0, classes, (batch,), device=dev)

    return make


def optimizers(a, model, dev):
    """The job's optimizers: AdamW (fused on CUDA), and plain SGD for a sparse-able embedding
    (without momentum a dense and a sparse gradient make the same update)."""
    fused = dev == "cuda"
    if a.case == "embed_dense":
        rest = [p for n, p in model.named_parameters() if not n.startswith("embed.")]
        return [
            torch.optim.SGD(model.embed.parameters(), lr=0.1),
            torch.optim.AdamW(rest, lr=1e-4, fused=fused),
        ]
    return [torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=CASES, required=True)
    p.add_argument("--fixed", action="store_true")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--small", action="store_true", help="tiny sizes (runs on the CPU)")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):  # parameters made on the device: a 4M-row table initialised there
        model, make = build(a, dev)
    opts = optimizers(a, model, dev)
    ema = EMA(model) if a.case == "ema_loop" else None
    params = [q for q in model.parameters() if q.requires_grad]
    t_prev = time.perf_counter()
    for step in range(a.steps):
        x, y = make()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            out = model(x)
        logits, target = out.reshape(-1, out.shape[-1]).float(), y.reshape(-1)
        if a.case == "sample_loss" and not a.fixed:
            loss = per_sample_loss(logits, target)
        else:
            loss = F.cross_entropy(logits, target)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.case == "clip_loop":
            if a.fixed:
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            else:
                clip_by_loop(params, 1.0)
        for opt in opts:
            opt.step()
        if ema is not None:
            (ema.update_foreach if a.fixed else ema.update_loop)(model)
        value = loss.item()
        now = time.perf_counter()
        print(f"step {step} loss {value:.4f} ms {(now - t_prev) * 1000:.2f}", flush=True)
        t_prev = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
