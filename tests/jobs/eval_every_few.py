"""A tiny GPT-2 (built from a config: no download) trained on random tokens; every --every-th
step, after the optimizer step, an evaluation: `model.generate(...)` (HF's generation loop) or a
forward under torch.no_grad(). --eval none is the twin without it.

    python tests/jobs/eval_every_few.py --steps 12 --every 3 --eval generate
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--every", type=int, default=3)
p.add_argument("--eval", choices=["none", "generate", "no_grad"], default="generate")
p.add_argument("--new-tokens", type=int, default=48)
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)
config = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=2)
model = GPT2LMHeadModel(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
prompt = torch.randint(0, 256, (2, 8))
held_out = torch.randint(0, 256, (16, 64))


def evaluate(step):
    model.eval()
    if args.eval == "generate":
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        print(f"step {step} sample {out[0, -4:].tolist()}", flush=True)
    else:
        with torch.no_grad():
            for _ in range(6):
                loss = model(held_out, labels=held_out).loss
        print(f"step {step} eval loss {loss.item():.4f}", flush=True)
    model.train()


for step in range(args.steps):
    x = torch.randint(0, 256, (8, 64))
    loss = model(x, labels=x).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if args.eval != "none" and step % args.every == args.every - 1:
        evaluate(step)
