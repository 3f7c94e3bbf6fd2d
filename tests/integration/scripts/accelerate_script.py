import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
x = torch.randn(512, 8)
data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
print("ACC", accelerator.num_processes, accelerator.process_index, flush=True)
for step, (inputs, targets) in enumerate(data):
    loss = nn.functional.mse_loss(model(inputs), targets)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if step == 9:
        break
