import os
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
    trainer = L.Trainer(max_steps=20, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        strategy="ddp", num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    print("ENV", type(trainer.strategy.cluster_environment).__name__, trainer.world_size, flush=True)
    trainer.fit(Model(), data)
