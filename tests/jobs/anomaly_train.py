"""A tiny transformer language model trained on random tokens, as a NaN hunt leaves it:
`--anomaly` turns autograd anomaly detection on before the loop (and forgets it there);
`--eval-every N` evaluates every N steps without torch.no_grad(). Logs `step N loss X` every step."""

import argparse

import torch
import torch.nn as nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--anomaly", action="store_true")
    p.add_argument("--eval-every", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(0)
    vocab, dim, seq, batch = 256, 64, 32, 8
    layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=128, batch_first=True)
    model = nn.Sequential(nn.Embedding(vocab, dim), nn.TransformerEncoder(layer, 2), nn.Linear(dim, vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.anomaly:
        torch.autograd.set_detect_anomaly(True)
    for step in range(args.steps):
        x = torch.randint(0, vocab, (batch, seq))
        loss = nn.functional.cross_entropy(model(x).reshape(-1, vocab), x.roll(1, 1).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        if args.eval_every and step % args.eval_every == 0:
            model.eval()
            x = torch.randint(0, vocab, (batch, seq))
            val = nn.functional.cross_entropy(model(x).reshape(-1, vocab), x.roll(1, 1).reshape(-1))
            print(f"step {step} val_loss {val.item():.4f}", flush=True)
            model.train()


if __name__ == "__main__":
    main()
