"""A Lightning regressor whose user Callback logs a histogram of every parameter's gradient to
TensorBoard (tensorboardX's SummaryWriter.add_histogram) from `on_after_backward`, every
--every-th iteration: --every 1 is the cause (each iteration), --every 100 its healthy twin.

    python tests/jobs/fw_lightning_grad_hist.py --max-steps 60 --every 1 --logdir tb
"""
import argparse

import lightning as L
import torch
from tensorboardX import SummaryWriter
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class GradHistograms(L.Callback):
    def __init__(self, logdir, every):
        self.writer, self.every = SummaryWriter(logdir), every

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step % self.every == 0:
            for name, p in pl_module.named_parameters():
                self.writer.add_histogram(f"grad/{name}", p.grad, trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        self.writer.close()


class Regressor(L.LightningModule):
    def __init__(self, width, depth):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--every", type=int, default=1, help="log the gradient histograms every N iterations")
    p.add_argument("--logdir", default="tb-grad-hist")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(4096, 64)
    y = x[:, :8].sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False, callbacks=[GradHistograms(args.logdir, args.every)])
    trainer.fit(Regressor(64, 6), loader)


if __name__ == "__main__":
    main()
