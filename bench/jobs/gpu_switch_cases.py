"""Process-wide switches left on, on a GPU (issue 36 item 1): what each one costs a mid-sized
transformer step, so the switches analyzer's predicted fractions can be checked against measured
ones (bench/gpu_switch_cases.sh runs each case under diagnose beside the healthy job).

    python bench/jobs/gpu_switch_cases.py --case healthy          # bf16 autocast, nothing left on
    --case anomaly          torch.autograd.set_detect_anomaly(True)
    --case deterministic    torch.use_deterministic_algorithms(True)
    --case memory_history   torch.cuda.memory._record_memory_history()
    --case launch_blocking  CUDA_LAUNCH_BLOCKING=1 set by the job before torch's import
    --case no_caching       PYTORCH_NO_CUDA_MEMORY_CACHING=1 set by the job before torch's import
    --case float64          torch.set_default_dtype(torch.float64)
    --small                 tiny sizes (a CPU check of the code)

Each step prints `step N loss L ms T tokens per step: N`.
"""

import os
import sys

CASES = ("healthy", "anomaly", "deterministic", "memory_history", "launch_blocking", "no_caching", "float64")
_case = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--case"), "healthy")
# the variables must be set before torch (and CUDA) start, as a job that sets them would
if _case == "launch_blocking":
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
if _case == "no_caching":
    os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
if _case == "deterministic":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=CASES, default="healthy")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true")
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main(argv=None):
    a = parse_args(argv)
    dev = a.device if torch.cuda.is_available() or a.device == "cpu" else "cpu"
    cuda = dev.startswith("cuda")
    if a.case == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    if a.case == "deterministic":
        torch.use_deterministic_algorithms(True)
    if a.case == "memory_history" and cuda:
        torch.cuda.memory._record_memory_history(max_entries=100000)
    if a.case == "float64":
        torch.set_default_dtype(torch.float64)
    vocab, dim, layers, heads, seq, batch = (256, 32, 2, 2, 16, 4) if a.small else (8192, 768, 8, 12, 512, 16)
    torch.manual_seed(0)
    model = GPT(vocab, dim, layers, heads, seq).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    t_prev = time.perf_counter()
    for step in range(a.steps):
        idx = torch.randint(0, vocab, (batch, seq + 1), device=dev)
        with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=cuda):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        now = time.perf_counter()
        print(
            f"step {step} loss {value:.4f} ms {(now - t_prev) * 1000:.2f} tokens per step: {batch * seq}",
            flush=True,
        )
        t_prev = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
