"""LSTM and GRU cells on `neuron`.

PyTorch sends RNN cells on any PrivateUse1 device to the fused `_thnn_fused_{lstm,gru}_cell` ops, which
only CUDA implements. We register them at the AutogradPrivateUse1 key as compositions of ordinary ops, so
autograd differentiates through those (and each of them goes through the normal dispatch path)."""

from __future__ import annotations

import torch

_library: torch.library.Library | None = None


def _lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
               input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    hy = torch.sigmoid(o) * torch.tanh(cy)
    return hy, cy, gates.detach()  # workspace: only the fused backward reads it


def _gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
              input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, ii, in_ = input_gates.chunk(3, 1)
    hr, hi, hn = hidden_gates.chunk(3, 1)
    r = torch.sigmoid(ir + hr)
    z = torch.sigmoid(ii + hi)
    n = torch.tanh(in_ + r * hn)
    hy = n + z * (hx - n)
    return hy, torch.cat([input_gates, hidden_gates], 1).detach()


def install() -> None:
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_thnn_fused_lstm_cell", _lstm_cell, "AutogradPrivateUse1")
    lib.impl("_thnn_fused_gru_cell", _gru_cell, "AutogradPrivateUse1")
    _library = lib
