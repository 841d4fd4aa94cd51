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


class Decoder(torch.nn.Module):
    """A written-out decoder block (embedding, LayerNorm, causal attention over `heads` heads, GELU MLP,
    LM head) taking token ids: the model of issue 32's shape-class measurement (hidden 32, 4 heads) and
    of the compile benchmarks' recorded workloads."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.emb(ids)
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(y)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


def train_decoder(model: torch.nn.Module, lengths: tuple[int, ...], vocab: int, steps: int = 2,
                  batch: int = 2, on_length: object = None) -> None:
    """`steps` AdamW steps at each sequence length on random tokens (`on_length(t)` after each length)."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for t in lengths:
        for _ in range(steps):
            ids = torch.randint(0, vocab, (batch, t), device=device)
            loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, vocab), ids.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if callable(on_length):
            on_length(t)


def block() -> tuple[torch.nn.Module, tuple[int, ...]]:
    return Block(), (4, 16, 64)


MAKERS = {"mlp": mlp, "transformer_block": block}


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with this directory first on PYTHONPATH (a `python -c` child imports `_models`)."""
    here = __file__.rsplit("/", 1)[0]
    return dict(env, PYTHONPATH=here + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
