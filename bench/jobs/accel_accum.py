"""A tiny job driven through accelerate's public API: Accelerator(gradient_accumulation_steps=4)
scales the loss in accelerator.backward; the sick job steps every micro-batch (no accumulate()),
--healthy steps under `with accelerator.accumulate(model):`. Issue 36 item 2: the accumulation
setting is the framework's argument, read by the shim from the object.

    diagnose --fix --steps 24 -- python bench/jobs/accel_accum.py
"""

import sys

import torch
from accelerate import Accelerator
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(2048, 256), torch.randint(0, 10, (2048,)))
loader = torch.utils.data.DataLoader(data, batch_size=8)
model, opt, loader = accelerator.prepare(model, opt, loader)
for step, (x, y) in enumerate(loader):
    if "--healthy" in sys.argv:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    else:
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    if step % 8 == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
