"""The models the fusion, compile and distributed benchmarks train (imported by their child processes,
which get this directory on PYTHONPATH): each maker returns (model, input shape)."""

from __future__ import annotations

import torch


def mlp(width: int = 128) -> tuple[torch.nn.Module, tuple[int, ...]]:
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                               torch.nn.GELU(), torch.nn.Linear(width, 10)), (32, 64)


class Block(torch.nn.Module):
    """A pre-norm transformer block: LayerNorm, multi-head attention, LayerNorm, GELU MLP."""

    def __init__(self, d: int = 64, h: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, h, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def block() -> tuple[torch.nn.Module, tuple[int, ...]]:
    return Block(), (4, 16, 64)


MAKERS = {"mlp": mlp, "transformer_block": block}


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with this directory first on PYTHONPATH (a `python -c` child imports `_models`)."""
    here = __file__.rsplit("/", 1)[0]
    return dict(env, PYTHONPATH=here + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
