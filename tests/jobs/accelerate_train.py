"""A training loop written for Hugging Face accelerate (`accelerate launch ...`)."""
import time

import torch
from accelerate import Accelerator

accelerator = Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
loader = torch.utils.data.DataLoader(data, batch_size=16)
model, opt, loader = accelerator.prepare(model, opt, loader)
for step, (x, y) in enumerate(loader):
    if step == 6:
        break
    time.sleep(0.3)  # reading a batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    accelerator.print(f"step {step + 1} loss {loss.item():.4f}")
