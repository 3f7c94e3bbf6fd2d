"""A bag-of-words classifier with a big embedding table (fit-style recipe).

The embedding is the kind of parameter the parameter-server strategy splits by
rows across ps tasks (TensorFlow's PartitionedVariable): each batch looks up a
few hundred of its rows, so workers pull and push only those. Adam keeps two
moments per parameter, so checkpoints carry real optimizer state.

    distrun train recipes/embedding.py --strategy ps --ps-tasks 2 --ps-partition-mb 0.1
    distrun train recipes/embedding.py --strategy mirrored      # the same recipe, all-reduce
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

VOCAB, DIM, WORDS = 5000, 16, 12
defaults = {"global_batch_size": 32, "steps": 60}


class BagOfWords(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, 2)

    def forward(self, words):
        return self.head(self.embedding(words).mean(dim=1))


def model():
    return BagOfWords()


def optimizer(params):
    return torch.optim.Adam(params, lr=0.01)


def loss(outputs, batch):
    return nn.functional.cross_entropy(outputs, batch[1])


def _data(n, seed):
    # Label: does the text hold more "positive" words (ids below VOCAB/2) than negative ones?
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(0, VOCAB, (n, WORDS), generator=gen)
    labels = ((words < VOCAB // 2).sum(dim=1) > WORDS // 2).long()
    return TensorDataset(words, labels)


def train_data(ctx):
    return _data(4096, 1)


def eval_data(ctx):
    return _data(512, 2)
