"""A PyTorch reference of Medusa-1's heads, as `medusa/model/medusa_model.py` (FasterDecoding/Medusa)
builds and runs them: head i = Sequential(*[ResBlock(H)] * L, Linear(H, V, bias=False)), the list
repeating one ResBlock object, fed the base model's last hidden state after its final norm."""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), as Medusa's (its weight zero-initialised; `random_heads` fills it)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        torch.nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_head(hidden_size: int, vocab_size: int, num_heads: int, num_layers: int) -> nn.ModuleList:
    """Medusa's `medusa_head`, exactly as its model class makes it."""
    return nn.ModuleList([nn.Sequential(*([ResBlock(hidden_size)] * num_layers),
                                        nn.Linear(hidden_size, vocab_size, bias=False))
                          for _ in range(num_heads)])


def random_heads(hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, seed: int = 0) -> nn.ModuleList:
    """`medusa_head` with every weight random (a trained head's blocks are not zero), in eval mode."""
    torch.manual_seed(seed)
    heads = medusa_head(hidden_size, vocab_size, num_heads, num_layers)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return heads.eval()


def head_logits(heads: nn.ModuleList, hidden_normed: torch.Tensor) -> torch.Tensor:
    """Medusa's forward over the heads: [K, ..., V] from hidden_normed [..., H]."""
    with torch.no_grad():
        return torch.stack([head(hidden_normed) for head in heads])
