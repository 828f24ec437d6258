"""A Lightning classifier with a user Callback that scores the model on the whole training set
(the way a job tracks a metric sklearn would compute): every --every-th batch its
`on_train_batch_end` predicts every row under no_grad and computes an accuracy and a rank AUC
with a plain-Python loop over the rows. --every 0 is the healthy twin: the same metric once an
epoch.

    python tests/jobs/fw_lightning_metric_cb.py --max-steps 60 --every 5
"""
import argparse

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def rank_auc(scores, labels):
    """Mann-Whitney AUC, one row at a time (what a metric library does under its API)."""
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    pos = rank_sum = 0
    for rank, i in enumerate(order, start=1):
        if labels[i]:
            pos += 1
            rank_sum += rank
    neg = len(labels) - pos
    return (rank_sum - pos * (pos + 1) / 2) / max(1, pos * neg)


class WholeSetMetric(L.Callback):
    def __init__(self, x, y, every):
        self.x, self.y, self.every = x, y, every

    def score(self, pl_module):
        with torch.no_grad():
            logits = torch.cat([pl_module(xb) for xb in self.x.split(512)]).squeeze(1)
        scores, labels = logits.tolist(), self.y.int().tolist()
        acc = float(np.mean([(s > 0) == bool(t) for s, t in zip(scores, labels)]))
        return acc, rank_auc(scores, labels)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.every and trainer.global_step % self.every == 0:
            acc, auc = self.score(pl_module)
            print(f"step {trainer.global_step} train acc {acc:.3f} auc {auc:.3f}", flush=True)

    def on_train_epoch_end(self, trainer, pl_module):
        if not self.every:
            acc, auc = self.score(pl_module)
            print(f"epoch {trainer.current_epoch} train acc {acc:.3f} auc {auc:.3f}", flush=True)


class Classifier(L.LightningModule):
    def __init__(self, width):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.binary_cross_entropy_with_logits(self(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="score the training set every N batches; 0: each epoch")
    p.add_argument("--rows", type=int, default=20000)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    width = 32
    x = torch.randn(args.rows, width)
    y = (x[:, :4].sum(dim=1) > 0).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False, callbacks=[WholeSetMetric(x, y, args.every)])
    trainer.fit(Classifier(width), loader)


if __name__ == "__main__":
    main()
