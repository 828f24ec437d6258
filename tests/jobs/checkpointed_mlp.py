"""A tiny CPU job whose blocks run through activation checkpointing (torch.utils.checkpoint), or
(--direct) its twin that calls them directly. The forward of every block is run again inside
backward; memory is no constraint at this size.
"""

import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

DIRECT = "--direct" in sys.argv
STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 40
torch.manual_seed(0)
torch.set_num_threads(1)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if DIRECT else checkpoint(block, x, use_reentrant=False)
        return self.head(x)


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(128, 256)
y = torch.randint(0, 10, (128,))
for step in range(STEPS):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
