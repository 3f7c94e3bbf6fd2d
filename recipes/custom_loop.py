"""A custom training loop (TensorFlow 2's custom-loop style): ``main(strategy)``.

The recipe owns the loop; the strategy owns placement, data sharding and
gradient synchronisation. The same file runs under every strategy:

    distrun train recipes/custom_loop.py --strategy central-storage
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

GLOBAL_BATCH_SIZE = 64
EPOCHS = 3


def main(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = strategy.prepare(model, optimizer)

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(512, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    dataset = strategy.distribute_dataset(TensorDataset(x, y), GLOBAL_BATCH_SIZE)

    def train_step(inputs, targets):
        per_example = (model(inputs) - targets).pow(2).mean(dim=1)
        loss = strategy.compute_average_loss(per_example)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return per_example.mean().detach()

    for epoch in range(EPOCHS):
        total = 0.0
        for inputs, targets in dataset:
            total += float(strategy.run(train_step, inputs, targets))
        mean_loss = strategy.reduce("mean", total / len(dataset))
        strategy.log(epoch=epoch, mean_loss=mean_loss)
        if strategy.is_chief:
            print(f"epoch {epoch}: mean loss {mean_loss:.4f}")
