import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

torch.set_num_threads(1)


class Model(BoringModel):
    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 20000), batch_size=256)


trainer = Trainer(
    max_steps=60,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    accelerator="cpu",
)
trainer.fit(Model())
