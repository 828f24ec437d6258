"""torch.compile(mode="max-autotune") on a batch size that changes every few steps: each new
size fails dynamo's size guard and recompiles the model (and, on a GPU, re-tunes its kernels).

    python tests/jobs/compile_shape_every_few.py --steps 9 --every 3 [--dynamic]
"""

import argparse
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=9)
p.add_argument("--every", type=int, default=3, help="the batch size changes every this many steps")
p.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (the fixed twin)")
args = p.parse_args()
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
compiled = torch.compile(model, mode="max-autotune", dynamic=bool(args.dynamic))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(args.steps):
    batch = 8 + 4 * (step // args.every)
    x, y = torch.randn(batch, 32, device=device), torch.randn(batch, 8, device=device)
    loss = nn.functional.mse_loss(compiled(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} batch {batch} loss {loss.item():.4f}", flush=True)
