"""A tiny job whose model does work nobody uses, or (--healthy) its twin that does not.

Sick: the encoder "frozen" by a learning rate of 0 in the optimizer's param groups, a forward hook
on every module computing statistics with .item() and a histogram, and an optimizer that steps
(and clips) after every micro-batch although the loss is divided for 4-step accumulation.
Healthy: the encoder frozen with requires_grad_(False) where it is built, no hook, and the step
taken every 4th micro-batch.
"""

import sys

import torch
from torch import nn

HEALTHY = "--healthy" in sys.argv
torch.manual_seed(0)
torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(*[nn.Sequential(nn.Linear(192, 192), nn.GELU()) for _ in range(4)])
        if HEALTHY:
            self.encoder.requires_grad_(False)
        self.head = nn.Linear(192, 10)

    def forward(self, x):
        return self.head(self.encoder(x))


model = Net()
stats = {}


def record(module, inputs, output):
    stats[module] = (output.mean().item(), output.std().item(), torch.histc(output, bins=200))


if not HEALTHY:
    for m in model.modules():
        m.register_forward_hook(record)
    opt = torch.optim.AdamW(
        [{"params": model.encoder.parameters(), "lr": 0.0}, {"params": model.head.parameters()}], lr=1e-3
    )
else:
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
grad_accum_steps = 4
batches = [(torch.randn(256, 192), torch.randint(0, 10, (256,))) for _ in range(8)]
model.head.weight.register_hook(lambda grad: grad)  # a cheap tensor hook: timed, no finding
for i in range(48):
    x, y = batches[i % 8]
    loss = nn.functional.cross_entropy(model(x), y) / grad_accum_steps
    loss.backward()
    if not HEALTHY or (i + 1) % grad_accum_steps == 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    if i % 8 == 0:
        print(f"step {i} loss {loss.item():.4f}", flush=True)
