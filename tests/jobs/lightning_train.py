"""A LightningModule trained with DDP on CPU: Lightning re-runs this script for rank 1."""
import time

import lightning as L
import torch


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        time.sleep(0.3)  # reading a batch
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=16))
