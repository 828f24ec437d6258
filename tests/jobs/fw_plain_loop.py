"""A hand-written loop in the style of pytorch/examples (word_language_model/main.py): a small
LSTM language model, batches cut from one long token tensor, clipping, and its log line
`| epoch   1 |    10/  100 batches | lr 20.00 | ms/batch 36.80 | loss  7.51 | ppl  1829.72`.

--save-every N: save the model every N batches (a "keep the best model" save inside the loop).
"""
import argparse
import atexit
import io
import math
import os
import shutil
import tempfile
import time

import torch
import torch.nn as nn


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, x):
        output, _ = self.rnn(self.encoder(x))
        return self.decoder(output)


class NetworkFile(io.FileIO):
    """A file on a network file system: every write waits for the server (~2 ms)."""

    def write(self, data):
        time.sleep(0.002)
        return super().write(data)


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--log-interval", type=int, default=1)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--lr", type=float, default=20.0)
    args = p.parse_args()
    torch.manual_seed(0)
    ntokens, bptt, bsz = 200, 16, 8
    train_data = torch.randint(0, ntokens, (bptt * (args.batches + 1) + 1, bsz))
    model = RNNModel(ntokens, 32, 32, 2)
    criterion = nn.NLLLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    save_dir = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, save_dir, True)
    save_path = os.path.join(save_dir, "model.pt")
    n_batches = (len(train_data) - 1) // bptt
    epoch, total_loss, start_time = 1, 0.0, time.time()
    model.train()
    for batch, i in enumerate(range(0, bptt * args.batches, bptt)):
        data, targets = get_batch(train_data, i, bptt)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(torch.log_softmax(output.view(-1, ntokens), dim=-1), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        total_loss += loss.item()
        if args.save_every and (batch + 1) % args.save_every == 0:
            with NetworkFile(save_path, "w") as f:
                torch.save(model, f)
        if (batch + 1) % args.log_interval == 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(f'| epoch {epoch:3d} | {batch + 1:5d}/{n_batches:5d} batches | lr {args.lr:02.2f} | ms/batch {elapsed * 1000 / args.log_interval:5.2f} | '
                  f'loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):8.2f}')
            total_loss, start_time = 0.0, time.time()


if __name__ == "__main__":
    main()
