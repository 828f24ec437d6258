"""An Accelerate training loop as its README shows one: `Accelerator()`, `prepare`,
`accelerator.backward`, a GPT-2 built from a config, one process on the CPU.

--logger-thread: a metrics thread that serialises the run's history in pure Python every few
milliseconds, holding the GIL the training loop needs.
"""
import argparse
import json
import threading

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel


def metrics_logger(history, stop):
    """Serialises every metric recorded so far, again and again (a chatty metrics exporter)."""
    while not stop.is_set():
        text = json.dumps(history)
        total = 0
        for ch in text:
            total += ord(ch)
        history["checksum"] = total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--logger-thread", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (512, 32))
    loader = DataLoader(TensorDataset(ids), batch_size=8, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    history = {"loss": [float(i) for i in range(2000)]}
    stop = threading.Event()
    if args.logger_thread:
        threading.Thread(target=metrics_logger, args=(history, stop), name="metrics",
                         daemon=True).start()
    model.train()
    step = 0
    while step < args.steps:
        for (batch,) in loader:
            out = model(input_ids=batch, labels=batch)
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            accelerator.print(f"step {step}/{args.steps} | train_loss {out.loss.item():.4f}")
            if step >= args.steps:
                break
    stop.set()


if __name__ == "__main__":
    main()
