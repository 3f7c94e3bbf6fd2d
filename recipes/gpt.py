"""A small decoder-only transformer (GPT) that learns Shakespeare byte by byte.

    distrun train recipes/gpt.py                                  # one device
    distrun train recipes/gpt.py --strategy sharded --replicas 2  # FSDP2, each block a unit
    distrun train recipes/gpt.py -- --layers 12 --width 768       # GPT-2 small's shape (85M + embeddings)
    distrun train recipes/gpt.py -s mirrored --tp 2               # each layer split over 2 ranks (tp_plan below)
    distrun train recipes/gpt.py -s mirrored --tp 2 --sequence-parallel  # and the activations between them
    distrun train recipes/gpt.py -s sharded --pp 2 --tp 2         # 2 pipeline stages of 2 ranks (pp_chain below)

The text ships with the repository (``data/shakespeare.txt``, 300 KB of Shakespeare's plays,
public domain): nothing is downloaded. ``include`` below sends it with the recipe to a
cluster's hosts (`--cluster` needs no `--include`). Tokens are bytes (a vocabulary of 256), so there is no
tokenizer to agree on across hosts. The last tenth of the text is held out for evaluation.

distrun reports tokens/s from ``tokens_per_sample`` and, on a GPU, MFU (model FLOPs per second
over the devices' peak) from ``flops_per_token``, in the live view and the summary.

The learning rate warms up linearly over ``--warmup`` steps, then follows a cosine down to a
tenth of ``--lr`` at ``--decay-steps`` (the default run's 200 steps), and stays there: GPT-2's
and nanoGPT's schedule. distrun steps ``scheduler`` once per optimizer step, under every
strategy, and keeps its place in the checkpoints; pass ``-- --decay-steps N`` with ``--steps N``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

_parser = argparse.ArgumentParser(prog="gpt.py")
_parser.add_argument("--layers", type=int, default=4)
_parser.add_argument("--width", type=int, default=128, help="the model dimension")
_parser.add_argument("--heads", type=int, default=4)
_parser.add_argument("--context", type=int, default=128, help="tokens per sample")
_parser.add_argument("--lr", type=float, default=1e-3, help="the peak learning rate, after the warm-up")
_parser.add_argument("--warmup", type=int, default=10, help="steps of linear warm-up")
_parser.add_argument("--decay-steps", type=int, default=200, help="the step the cosine decay ends at")
ARGS = _parser.parse_args(sys.argv[1:])

VOCAB = 256
TEXT = Path(__file__).resolve().parent / "data" / "shakespeare.txt"

defaults = {"global_batch_size": 32, "steps": 200, "seed": 0}
include = ["data/shakespeare.txt"]  # goes into the code bundle with the recipe (docs/recipes.md)
#: What distrun multiplies samples/s by for tokens/s.
tokens_per_sample = ARGS.context


class Block(nn.Module):
    """Attention and an MLP, each a colwise-then-rowwise pair under ``--tp`` (``tp_plan``).

    Tensor parallel gives each rank some of the heads: q, k and v are separate layers (a fused
    qkv layer split by columns would hand one rank all of q and part of k), and the forward
    works out how many heads it holds from the shapes (``view(..., -1, head_dim)``), never
    from ``heads``.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.norm1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm1(x)
        q, k, v = (layer(normed) for layer in (self.q, self.k, self.v))
        batch, length = q.shape[:2]  # x holds a slice of the positions under --sequence-parallel; q all
        q, k, v = (z.view(batch, length, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, -1))
        return x + self.mlp(self.norm2(x))


class Embeddings(nn.Module):
    """Each byte's embedding plus its position's: the first link of the chain ``--pp`` cuts."""

    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, length]: a batch of one
        return self.tokens(tokens) + self.positions(positions)


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, context: int) -> None:
        super().__init__()
        self.context = context
        self.embed = Embeddings(width, context)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        for name, param in self.named_parameters():  # GPT-2's initialisation, residual projections scaled
            if param.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(param, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def model() -> nn.Module:
    return GPT(ARGS.layers, ARGS.width, ARGS.heads, ARGS.context)


def shard_units(gpt: GPT) -> nn.ModuleList:
    """Under --strategy sharded, each transformer block is one FSDP unit (as torchtitan shards)."""
    return gpt.blocks


def tp_plan(gpt: GPT) -> dict[str, str]:
    """Under --tp: Megatron's split. q, k, v and the MLP's first layer by output features (each
    rank some heads, some hidden units), the projections back by input features (one all-reduce
    each); the embeddings by rows (each rank some bytes), the head by output features, gathered
    for the loss. The norms work on each position alone ("sequence"): whole on every rank, or,
    under --sequence-parallel, each rank on its slice of the positions."""
    return {"embed.tokens": "rowwise", "embed.positions": "rowwise", "blocks.*.norm[12]": "sequence",
            "blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise", "blocks.*.proj": "rowwise",
            "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise", "norm": "sequence", "head": "output"}


def pp_chain(gpt: GPT) -> list[nn.Module]:
    """Under --pp: the forward as a chain of modules, each feeding the next (distrun cuts it into
    stages balanced by parameters, and checks on the first batch that it composes to forward)."""
    return [gpt.embed, *gpt.blocks, gpt.norm, gpt.head]


def flops_per_token(gpt: GPT) -> float:
    """Training FLOPs per token: 6 per weight (forward 2, backward 4) plus attention's scores
    and weighted sum (PaLM's appendix B: 12 x layers x width x context)."""
    weights = sum(p.numel() for name, p in gpt.named_parameters() if not name.startswith("embed."))
    return 6 * weights + 12 * len(gpt.blocks) * gpt.embed.tokens.embedding_dim * gpt.context


def optimizer(params):
    return torch.optim.AdamW(params, lr=ARGS.lr, betas=(0.9, 0.95), weight_decay=0.1)


def _lr_factor(step: int) -> float:
    """The multiple of ``--lr`` at ``step`` (from 0): linear warm-up, cosine decay to 0.1, then flat."""
    if step < ARGS.warmup:
        return (step + 1) / ARGS.warmup
    progress = min(1.0, (step - ARGS.warmup) / max(1, ARGS.decay_steps - ARGS.warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor)


def loss(outputs: torch.Tensor, batch) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, VOCAB), batch[1].reshape(-1))


def _windows(data: torch.Tensor) -> TensorDataset:
    """Every ``context + 1`` bytes from a stride of half a context: inputs and next-byte targets."""
    stride = max(1, ARGS.context // 2)
    starts = torch.arange(0, len(data) - ARGS.context - 1, stride)
    rows = torch.stack([data[s: s + ARGS.context + 1] for s in starts.tolist()]).long()
    return TensorDataset(rows[:, :-1], rows[:, 1:])


def _text() -> torch.Tensor:
    return torch.frombuffer(bytearray(TEXT.read_bytes()), dtype=torch.uint8)


def train_data(ctx) -> TensorDataset:
    data = _text()
    return _windows(data[: len(data) * 9 // 10])


def eval_data(ctx) -> TensorDataset:
    data = _text()
    return _windows(data[len(data) * 9 // 10:])
