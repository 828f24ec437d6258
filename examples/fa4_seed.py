"""The seed case on a CPU: FlashAttention-4 recompiling its backward kernel every step.

A small decoder trained on packed variable-length batches (real AdamW, real loss, one
Megatron-format log line per step). Its attention calls the REAL `flash_attn.cute` package under
torch's FakeTensorMode, so FA4 runs its real host code and compiles its real kernels with the
CuTe DSL on the CPU, exactly as it would on a Hopper/Blackwell GPU; the numbers of training come
from an ordinary PyTorch computation of the same varlen causal attention (the kernels FA4 builds
cannot run without a GPU). `--attention-backend sdpa` uses that PyTorch computation alone:
nothing compiles, and the losses are identical to the fa4 backend's.

`--max-seqlen-as tensor` reproduces the framework bug of the seed report: `max_seqlen` is passed
as a 0-dim tensor (`cu_seqlens.diff().max()` without `.item()`). flash-attn-4 up to 4.0.0b21
puts values derived from it into the backward compile key, so the backward kernel compiles again
on every call; with `--max-seqlen-as int` it compiles once.

On a GPU, PyTorch runs the backward of CUDA tensors on its autograd device thread; the CPU
engine runs backward on the caller's thread, so (like the GPU engine) this example runs FA4's
backward on a thread of its own while the main thread waits (`--backward-thread main` to not).

    python examples/fa4_seed.py --steps 4 --max-seqlen-as tensor
    diagnose --steps 4 -- python examples/fa4_seed.py --max-seqlen-as tensor
"""
import argparse
import itertools
import os
import queue
import re
import sys
import threading
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_log import log_line  # noqa: E402  (one log format for every example)

# Known, harmless under fake mode: FA4 asks fake tensors for data pointers, and the CuTe DSL
# notes an argument it keeps as a Python object. Not the job's business.
warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
warnings.filterwarnings("ignore", message=r"Argument \w+ \(position \d+\) cannot be converted")

# FACTS.md §1: what FA4 and the CuTe DSL need to compile for a GPU that is not there
FAKE_GPU_ENV = {
    "sm_90": {"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a",
              "FLASH_ATTENTION_NUM_SMS": "132"},
    "sm_100": {"FLASH_ATTENTION_ARCH": "sm_100", "CUTE_DSL_ARCH": "sm_100a",
               "FLASH_ATTENTION_NUM_SMS": "148"},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-seqlen-as", choices=["int", "tensor"], default="int",
                   help="how max_seqlen reaches flash_attn (tensor: the framework bug)")
    p.add_argument("--attention-backend", choices=["fa4", "sdpa"], default="fa4",
                   help="fa4: flash_attn.cute (compiles); sdpa: plain PyTorch, nothing compiles")
    p.add_argument("--arch", choices=["auto", *sorted(FAKE_GPU_ENV)], default="auto",
                   help="the GPU FA4 compiles for, unless FLASH_ATTENTION_ARCH is set (auto: "
                        "sm_90 for flash-attn-4 < 4.0.0b22, sm_100 for newer releases, which "
                        "reject a tensor max_seqlen_k on sm_90)")
    p.add_argument("--backward-thread", choices=["autograd", "main"], default="autograd",
                   help="run FA4's backward on an autograd-like worker thread, as on a GPU")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    # sequences longer than one 128-row tile: with an int max_seqlen FA4 then builds one kernel
    # (a batch whose longest sequence fits one tile is a second, legitimate variant)
    p.add_argument("--tokens", type=int, default=768, help="packed tokens per step")
    p.add_argument("--min-len", type=int, default=144)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    return p.parse_args(argv)


# -- data: packed variable-length sequences ------------------------------------------------------
class Packing:
    """Where the packed sequences start and end, built once per batch on the host (as a data
    loader does): cu_seqlens (int32), each token's position in its sequence, and the causal
    block-diagonal mask of the reference attention. Nothing here reads tensor data back."""

    def __init__(self, lengths):
        self.lengths = list(lengths)
        self.cu_list = [0, *itertools.accumulate(self.lengths)]
        self.cu_seqlens = torch.tensor(self.cu_list, dtype=torch.int32)
        total = self.cu_list[-1]
        seq_id = torch.repeat_interleave(torch.arange(len(self.lengths)),
                                         torch.tensor(self.lengths), output_size=total)
        self.positions = torch.cat([torch.arange(n) for n in self.lengths])
        self.mask = (seq_id[:, None] == seq_id[None, :]) & \
            (self.positions[:, None] >= self.positions[None, :])


def packed_batch(gen, table, tokens, min_len, max_len, vocab):
    """Token ids of several sequences packed into one row, and their Packing."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(min_len, max_len + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - tokens
    if lengths[-1] < 2:
        lengths[-2] += lengths.pop()
    ids = torch.randint(vocab, (tokens + 1,), generator=gen)
    for t in range(3, tokens + 1):  # a noisy order-3 Markov chain: something to learn
        if float(torch.rand(1, generator=gen)) > 0.1:
            ids[t] = table[(ids[t - 1] * 31 + ids[t - 2] * 7 + ids[t - 3]) % table.numel()]
    return ids[:-1], ids[1:], Packing(lengths)


# -- attention -----------------------------------------------------------------------------------
def varlen_attention_reference(q, k, v, packing):
    """Causal attention within each packed sequence: (tokens, heads, dim) in and out."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=packing.mask)
    return out.transpose(0, 1)


class FakeGPU:
    """flash_attn.cute on tensors that live on a GPU that is not there (FakeTensorMode)."""

    def __init__(self):
        import flash_attn.cute.interface as fa4_interface
        from flash_attn.cute import flash_attn_varlen_func
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode()
        self.flash_attn_varlen_func = flash_attn_varlen_func
        self.flash_attn_bwd = fa4_interface._flash_attn_bwd

    def like(self, t, dtype=torch.bfloat16):
        return torch.empty(t.shape, dtype=dtype, device="cuda")

    def on_device(self, value, data=None):
        """A real CPU value as the job would hold it on the GPU (`data`: its values, when the
        caller has them on the host). A 0-dim tensor becomes a tensor whose value fake mode can
        read, as a GPU would after a sync: FA4 reads it on the host."""
        if not torch.is_tensor(value):
            return value
        data = value.tolist() if data is None else data
        with self.mode:
            if value.dim() == 0:
                return torch.tensor(data, dtype=value.dtype)
            return torch.tensor(data, dtype=value.dtype, device="cuda")


class BackwardThread:
    """One worker that runs backward work and hands back its result, as PyTorch's autograd device
    thread does for CUDA tensors; the main thread waits meanwhile (GIL released)."""

    def __init__(self):
        self.jobs = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="pt_autograd_0", daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            fn, done = self.jobs.get()
            try:
                done.put((fn(), None))
            except BaseException as exc:  # handed back to the waiting thread
                done.put((None, exc))

    def run(self, fn):
        done = queue.Queue(maxsize=1)
        self.jobs.put((fn, done))
        result, exc = done.get()
        if exc is not None:
            raise exc
        return result


class FA4VarlenAttention(torch.autograd.Function):
    """Forward and backward through FA4 (compiling its kernels in fake mode), values from the
    PyTorch reference so the training numbers are real and identical to the sdpa backend."""

    @staticmethod
    def forward(ctx, q, k, v, packing, max_seqlen, runtime):
        gpu, backward_thread = runtime
        fcu = gpu.on_device(packing.cu_seqlens, packing.cu_list)
        max_seqlen = gpu.on_device(max_seqlen)
        with gpu.mode:
            fq, fk, fv = gpu.like(q), gpu.like(k), gpu.like(v)
            fout, flse = gpu.flash_attn_varlen_func(fq, fk, fv, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                                    cu_seqlens_q=fcu, cu_seqlens_k=fcu, causal=True, return_lse=True)
        with torch.enable_grad():
            inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
            out = varlen_attention_reference(*inputs, packing)
        ctx.fake = (fq, fk, fv, fout, flse, fcu, max_seqlen)
        ctx.graph = (inputs, out)
        ctx.runtime = runtime
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        gpu, backward_thread = ctx.runtime
        fq, fk, fv, fout, flse, fcu, max_seqlen = ctx.fake

        def fa4_backward():
            with gpu.mode:
                return gpu.flash_attn_bwd(fq, fk, fv, fout, gpu.like(dout), flse, None, True,
                                          cu_seqlens_q=fcu, cu_seqlens_k=fcu,
                                          max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)

        if backward_thread is not None:
            backward_thread.run(fa4_backward)
        else:
            fa4_backward()
        inputs, out = ctx.graph
        dq, dk, dv = torch.autograd.grad(out, inputs, dout)
        return dq, dk, dv, None, None, None


# -- model ---------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, heads * head_dim, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, packing, max_seqlen, runtime):
        h = self.ln1(x)
        q = self.q(h).view(-1, self.heads, self.head_dim)
        k, v = self.kv(h).view(-1, 2, self.kv_heads, self.head_dim).unbind(1)
        if runtime is None:
            a = varlen_attention_reference(q, k, v, packing)
        else:
            a = FA4VarlenAttention.apply(q, k, v, packing, max_seqlen, runtime)
        x = x + self.proj(a.reshape(x.shape[0], -1))
        return x + self.mlp(self.ln2(x))


class PackedLM(nn.Module):
    def __init__(self, args):
        super().__init__()
        d = args.d_model
        self.tok = nn.Embedding(args.vocab, d)
        self.pos = nn.Embedding(args.tokens, d)
        self.blocks = nn.ModuleList(Block(d, args.heads, args.kv_heads, args.head_dim)
                                    for _ in range(args.layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, args.vocab, bias=False)

    def forward(self, ids, packing, max_seqlen, runtime):
        x = self.tok(ids) + self.pos(packing.positions)
        for block in self.blocks:
            x = block(x, packing, max_seqlen, runtime)
        return self.head(self.ln(x))


def fa4_release():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return None


def set_fake_gpu_env(arch):
    if arch == "auto":
        release = fa4_release() or ""
        match = re.match(r"4\.0\.0b(\d+)$", release)
        arch = "sm_90" if match and int(match.group(1)) < 22 else "sm_100"
    for name, value in FAKE_GPU_ENV[arch].items():
        os.environ.setdefault(name, value)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.head_dim * args.heads % args.kv_heads or args.heads % args.kv_heads:
        raise SystemExit("--heads must be a multiple of --kv-heads")
    runtime = None
    if args.attention_backend == "fa4":
        set_fake_gpu_env(args.arch)
        backward_thread = BackwardThread() if args.backward_thread == "autograd" else None
        runtime = (FakeGPU(), backward_thread)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    table = torch.randint(args.vocab, (4096,), generator=gen)
    model = PackedLM(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        ids, labels, packing = packed_batch(gen, table, args.tokens, args.min_len,
                                            args.max_len, args.vocab)
        cu_seqlens = packing.cu_seqlens
        if args.max_seqlen_as == "tensor":
            max_seqlen = cu_seqlens.diff().max()  # the framework bug: a 0-dim tensor, no .item()
        else:
            max_seqlen = int(cu_seqlens.diff().max())
        logits = model(ids, packing, max_seqlen, runtime)
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log_line(step, args.steps, (time.perf_counter() - t0) * 1000, args.lr, 1,
                 loss.item(), args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
