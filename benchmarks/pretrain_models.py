"""The implementations ``benchmarks/pretrain.py`` times side by side, by name (``IMPLEMENTATIONS``).

Beside the project's model (``models.mlstm.MLSTM``, fused or with the reference recurrence), the two
models only the benchmark needs: the step-by-step baseline (``StepwiseMLSTM``) and the yardstick
(``TorchLSTM``). Kept apart from the measuring and the command so that each reads on its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.mlstm import MLSTM, MLSTMConfig, State, weight_norm


class StepwiseMLSTM(MLSTM):
    """The baseline: the same cell and parameters as a plain PyTorch loop would run them, one time step
    at a time, with no fused input projections (``tests/test_mlstm.py::naive_forward``, trainable)."""

    def forward(
        self, bytes_BT: torch.Tensor, state: State | None = None
    ) -> tuple[torch.Tensor, State, torch.Tensor]:
        h_BH, c_BH = (
            state if state is not None else self.zero_state(bytes_BT.shape[0], device=bytes_BT.device)
        )
        logits, cells = [], []
        for t in range(bytes_BT.shape[1]):
            x_BE = self.embed(bytes_BT[:, t])
            W_x, W_h = weight_norm(self.w_x, self.g_x), weight_norm(self.w_h, self.g_h)
            W_mx, W_mh = weight_norm(self.w_mx, self.g_mx), weight_norm(self.w_mh, self.g_mh)
            m_BH = (x_BE @ W_mx) * (h_BH @ W_mh)
            z_BG = x_BE @ W_x + m_BH @ W_h + self.b
            i_BH, f_BH, o_BH, u_BH = z_BG.chunk(4, dim=1)
            c_BH = torch.sigmoid(f_BH) * c_BH + torch.sigmoid(i_BH) * torch.tanh(u_BH)
            h_BH = torch.sigmoid(o_BH) * torch.tanh(c_BH)
            logits.append(self.out(h_BH))
            cells.append(c_BH)
        return torch.stack(logits, 1), (h_BH, c_BH), torch.stack(cells, 1)


class TorchLSTM(nn.Module):
    """The yardstick: ``torch.nn.LSTM`` of the preset's width between the same embedding and read-out."""

    def __init__(self, config: MLSTMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.embed_size)
        self.lstm = nn.LSTM(config.embed_size, config.hidden_size, batch_first=True)
        self.out = nn.Linear(config.hidden_size, config.vocab_size)

    def zero_state(self, batch_size: int, *, device: torch.device | None = None) -> State:
        zeros = torch.zeros(batch_size, self.config.hidden_size, device=device)
        return zeros, zeros.clone()

    def forward(
        self, bytes_BT: torch.Tensor, state: State | None = None
    ) -> tuple[torch.Tensor, State, torch.Tensor]:
        h_BH, c_BH = (
            state if state is not None else self.zero_state(bytes_BT.shape[0], device=bytes_BT.device)
        )
        h_BTH, (h_1BH, c_1BH) = self.lstm(self.embed(bytes_BT), (h_BH[None], c_BH[None]))
        return self.out(h_BTH), (h_1BH[0], c_1BH[0]), h_BTH


def reference_mlstm(config: MLSTMConfig) -> MLSTM:
    return MLSTM(config, recurrence="reference")


IMPLEMENTATIONS: dict[str, Callable[[MLSTMConfig], nn.Module]] = {
    "graphed": MLSTM,  # the fused model, its step captured as a CUDA graph (CUDA only)
    "fused": MLSTM,
    "reference": reference_mlstm,
    "baseline": StepwiseMLSTM,
    "nn.LSTM": TorchLSTM,
}
