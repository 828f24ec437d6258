"""A training loop inside a function that keeps each step's outputs for an epoch metric in a list
local to the function, with their autograd graph (every step's activations stay alive).
tests/test_memprice.py runs it under diagnose."""

import sys

import torch


def train(steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    predictions = []
    for step in range(steps):
        x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        predictions.append(out)
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    accuracy = sum(float((p.argmax(-1) == 0).float().mean()) for p in predictions) / steps
    print(f"share of class 0 {accuracy:.3f}")


if __name__ == "__main__":
    train(int(sys.argv[1]))
