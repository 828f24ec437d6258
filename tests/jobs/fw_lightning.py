"""A Lightning job as its README shows one: a LightningModule, `train_dataloader()` building
the DataLoader, `L.Trainer(max_steps=..., accelerator="cpu", devices=1)`.

--slow-getitem S: every sample takes S seconds to load, on the training process (num_workers=0).
--side-read S: every training step also reads a file and waits S seconds for a slow store, its
result unused (host work on the training thread that nothing in the step needs).
"""
import argparse
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __init__(self, n, width, slow_s=0.0):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, width, generator=gen)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.slow_s = slow_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.slow_s:
            time.sleep(self.slow_s)  # reading the sample from a slow disk
        return self.x[i], self.y[i]


class Regressor(L.LightningModule):
    def __init__(self, width=32, slow_s=0.0, side_read_s=0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 1))
        self.width = width
        self.slow_s = slow_s
        self.side_read_s = side_read_s

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.side_read_s:
            blob = open(__file__, "rb").read(); time.sleep(self.side_read_s)  # noqa: E702, F841
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(Samples(512, self.width, self.slow_s), batch_size=16, shuffle=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--slow-getitem", type=float, default=0.0)
    p.add_argument("--side-read", type=float, default=0.0)
    args = p.parse_args()
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        log_every_n_steps=1)
    trainer.fit(Regressor(slow_s=args.slow_getitem, side_read_s=args.side_read))


if __name__ == "__main__":
    main()
