"""Decoder layers over packed sequences; attention through FlashAttention-4's varlen kernel.

On a GPU the attention is FA4 itself. Without one, FA4 still runs its host code and compiles its
kernels on tensors of a fake device (torch FakeTensorMode), while the values come from PyTorch's
own attention over the same packed sequences, so training numbers stay real.
"""
import os
import queue
import threading
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
warnings.filterwarnings("ignore", message=r"Argument \w+ \(position \d+\) cannot be converted")

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # what FA4 and the CuTe DSL need to build Hopper kernels with no GPU present
    for _k, _v in (("FLASH_ATTENTION_ARCH", "sm_90"), ("CUTE_DSL_ARCH", "sm_90a"),
                   ("FLASH_ATTENTION_NUM_SMS", "132")):
        os.environ.setdefault(_k, _v)

import flash_attn.cute.interface as fa_interface  # noqa: E402
from flash_attn.cute import flash_attn_varlen_func  # noqa: E402


def reference_attention(q, k, v, cu_seqlens):
    """Causal attention inside each packed sequence (tokens, heads, dim)."""
    bounds = cu_seqlens.tolist()
    group = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


class _HostSideFA4(torch.autograd.Function):
    """FA4 compiled on fake device tensors; values from reference_attention."""
    mode = None
    worker = None

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen):
        from torch._subclasses.fake_tensor import FakeTensorMode

        if _HostSideFA4.mode is None:
            _HostSideFA4.mode = FakeTensorMode(allow_non_fake_inputs=True)
        with _HostSideFA4.mode:
            fq, fk, fv = (torch.empty(t.shape, dtype=torch.bfloat16, device="cuda") for t in (q, k, v))
            fcu = torch.tensor(cu_seqlens.tolist(), dtype=torch.int32, device="cuda")
            fout, flse = flash_attn_varlen_func(fq, fk, fv, cu_seqlens_q=fcu, cu_seqlens_k=fcu,
                                                max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                                causal=True, return_lse=True)
        ctx.fake = (fq, fk, fv, fout, flse, fcu, max_seqlen)
        with torch.enable_grad():
            inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
            out = reference_attention(*inputs, cu_seqlens)
        ctx.graph = (inputs, out)
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        fq, fk, fv, fout, flse, fcu, max_seqlen = ctx.fake

        def fa4_backward():  # on its own thread, as autograd runs a GPU backward
            with _HostSideFA4.mode:
                fa_interface._flash_attn_bwd(fq, fk, fv, fout, torch.empty_like(fout), flse,
                                             None, True, cu_seqlens_q=fcu, cu_seqlens_k=fcu,
                                             max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)

        _run_on_worker(fa4_backward)
        inputs, out = ctx.graph
        return (*torch.autograd.grad(out, inputs, dout), None, None)


def _run_on_worker(fn):
    if _HostSideFA4.worker is None:
        jobs = queue.Queue()

        def loop():
            while True:
                f, done = jobs.get()
                try:
                    done.put((f(), None))
                except BaseException as exc:
                    done.put((None, exc))

        threading.Thread(target=loop, name="pt_autograd_0", daemon=True).start()
        _HostSideFA4.worker = jobs
    done = queue.Queue(maxsize=1)
    _HostSideFA4.worker.put((fn, done))
    _, exc = done.get()
    if exc is not None:
        raise exc


class PackedAttention(nn.Module):
    def __init__(self, d, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(d, heads * head_dim, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, d, bias=False)

    def forward(self, x, cu_seqlens, max_seqlen):
        q = self.q(x).view(-1, self.heads, self.head_dim)
        k, v = self.kv(x).view(-1, 2, self.kv_heads, self.head_dim).unbind(1)
        if ON_GPU:
            out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                         max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                         causal=True)
            out = out[0] if isinstance(out, tuple) else out
        else:
            out = _HostSideFA4.apply(q, k, v, cu_seqlens, max_seqlen)
        return self.o(out.reshape(x.shape[0], -1))


class DecoderLayer(nn.Module):
    def __init__(self, d, heads, kv_heads, head_dim):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = PackedAttention(d, heads, kv_heads, head_dim)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, cu_seqlens, max_seqlen):
        x = x + self.attn(self.n1(x), cu_seqlens, max_seqlen)
        return x + self.mlp(self.n2(x))


class PackedDecoder(nn.Module):
    def __init__(self, vocab, d, layers, heads, kv_heads, head_dim, max_positions):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_positions, d)
        self.layers = nn.ModuleList(DecoderLayer(d, heads, kv_heads, head_dim) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, batch):
        x = self.embed(batch["input_ids"]) + self.pos(batch["position_ids"])
        for layer in self.layers:
            x = layer(x, batch["cu_seqlens"], batch["max_seqlen"])
        return self.head(self.norm(x))
