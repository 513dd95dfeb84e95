"""The byte-level multiplicative LSTM of Radford et al. (2017) and Puri et al. (2018).

Legend: B batch, T time steps, E byte embedding (64), H hidden units, V vocabulary (256 bytes).
Weights are stored as in the papers' code, ``x @ W`` with ``W`` of shape [in, out], so the published
weights load without transposes. Per time step:

    m = (x W_mx) ⊙ (h W_mh)
    z = x W_x + m W_h + b            gates in the order i, f, o, u
    c = σ(f) ⊙ c + σ(i) ⊙ tanh(u)
    h = σ(o) ⊙ tanh(c)

Weight normalisation on the four matrices of the cell: ``W = g · v / ‖v‖`` per output unit (column).
The input projections x W_x and x W_mx are one matrix product for all T steps; only the recurrence
loops, through the fused recurrence of ``models/recurrence.py`` unless ``recurrence="reference"``
(``MLSTM.cell`` below, step by step under autograd: the same numbers, kept for tests and debugging).
The feature of Radford et al. is the cell state after a text's last byte: ``read_packed`` reads it
for texts laid end to end (``models.features``, the fused recurrence), ``final_cell_state`` for a
padded batch, step by step with the padding masked (the reference the packed path is tested against).
Single device, no mixed precision or distribution here: the training job adds those.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.config import (
    PRESETS,
    RECURRENCES,
    MLSTMConfig,
    Recurrence,
    large_16384,
    large_32768,
    paper_4096,
    paper_8192,
    preset,
    small,
    tiny,
)
from models.recurrence import packed_states, recurrence

State = tuple[Tensor, Tensor]  # (h_BH, c_BH)
# The sizes and presets live in models/config.py (no torch there); the model's users import them from here.
__all__ = [
    "MLSTM", "PRESETS", "RECURRENCES", "MLSTMConfig", "Recurrence", "State", "large_16384",
    "large_32768", "paper_4096", "paper_8192", "preset", "small", "tiny", "weight_norm",
]  # fmt: skip


def weight_norm(v: Tensor, g: Tensor) -> Tensor:
    """W = g · v / ‖v‖, the norm taken per output unit (column of v, which is [in, out])."""
    W: Tensor = v * (g / v.norm(dim=0))
    return W


class MLSTM(nn.Module):
    """Embedding → mLSTM cell over time → linear read-out to next-byte logits."""

    def __init__(
        self, config: MLSTMConfig, *, recurrence: Recurrence = "fused", compile_gates: bool = True
    ) -> None:
        super().__init__()
        if recurrence not in RECURRENCES:
            raise ValueError(f"unknown recurrence {recurrence!r}: choose one of {', '.join(RECURRENCES)}")
        self.config = config
        # How the loop over time runs; neither is a parameter, so checkpoints are the same for both.
        self.recurrence: Recurrence = recurrence
        self.compile_gates = compile_gates  # the fused path's gate math through torch.compile (CUDA only)
        E, H, V = config.embed_size, config.hidden_size, config.vocab_size
        self.embed = nn.Embedding(V, E)
        self.w_x = nn.Parameter(torch.empty(E, 4 * H))
        self.w_h = nn.Parameter(torch.empty(H, 4 * H))
        self.w_mx = nn.Parameter(torch.empty(E, H))
        self.w_mh = nn.Parameter(torch.empty(H, H))
        self.g_x = nn.Parameter(torch.empty(4 * H))
        self.g_h = nn.Parameter(torch.empty(4 * H))
        self.g_mx = nn.Parameter(torch.empty(H))
        self.g_mh = nn.Parameter(torch.empty(H))
        self.b = nn.Parameter(torch.empty(4 * H))
        self.out = nn.Linear(H, V)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.embed.weight, std=0.02)
        for v, g in (
            (self.w_x, self.g_x),
            (self.w_h, self.g_h),
            (self.w_mx, self.g_mx),
            (self.w_mh, self.g_mh),
        ):
            nn.init.orthogonal_(v) if v.shape[0] >= v.shape[1] else nn.init.normal_(v, std=v.shape[0] ** -0.5)
            g.copy_(v.norm(dim=0))  # so W = v at the start
        self.b.zero_()
        self.out.reset_parameters()

    def zero_state(self, batch_size: int, *, device: torch.device | None = None) -> State:
        shape, like = (batch_size, self.config.hidden_size), self.b
        return (
            torch.zeros(shape, device=device or like.device, dtype=like.dtype),
            torch.zeros(shape, device=device or like.device, dtype=like.dtype),
        )

    def cell_weights(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """W_x, W_h, W_mx, W_mh after weight normalisation."""
        return (
            weight_norm(self.w_x, self.g_x),
            weight_norm(self.w_h, self.g_h),
            weight_norm(self.w_mx, self.g_mx),
            weight_norm(self.w_mh, self.g_mh),
        )

    @staticmethod
    def cell(xz_BG: Tensor, xm_BH: Tensor, state: State, W_h: Tensor, W_mh: Tensor) -> State:
        """One time step, given the input's shares xz = x W_x + b and xm = x W_mx."""
        h_BH, c_BH = state
        m_BH = xm_BH * (h_BH @ W_mh)
        z_BG = xz_BG + m_BH @ W_h
        i_BH, f_BH, o_BH, u_BH = z_BG.chunk(4, dim=1)
        c_BH = torch.sigmoid(f_BH) * c_BH + torch.sigmoid(i_BH) * torch.tanh(u_BH)
        h_BH = torch.sigmoid(o_BH) * torch.tanh(c_BH)
        return h_BH, c_BH

    def forward(self, bytes_BT: Tensor, state: State | None = None) -> tuple[Tensor, State, Tensor]:
        """Next-byte logits [B, T, V], the final state, and the cell state after every step [B, T, H]."""
        state = state if state is not None else self.zero_state(bytes_BT.shape[0], device=bytes_BT.device)
        if self.recurrence == "fused":
            return self._forward_fused(bytes_BT, state)
        x_BTE = self.embed(bytes_BT)
        W_x, W_h, W_mx, W_mh = self.cell_weights()
        xz_BTG = x_BTE @ W_x + self.b  # G = 4H: the input's share of every gate, all steps at once
        xm_BTH = x_BTE @ W_mx
        # Under autocast the products run in xz's dtype: cast the recurrent weights once, not every step
        # (autocast caches casts of parameters only, and these are computed).
        W_h, W_mh = W_h.to(xz_BTG.dtype), W_mh.to(xz_BTG.dtype)
        hs, cs = [], []
        # unbind once: slicing x[:, t] inside the loop makes autograd allocate a full-size gradient per step.
        for xz_BG, xm_BH in zip(xz_BTG.unbind(1), xm_BTH.unbind(1), strict=True):
            state = self.cell(xz_BG, xm_BH, state, W_h, W_mh)
            hs.append(state[0])
            cs.append(state[1])
        h_BTH, c_BTH = torch.stack(hs, dim=1), torch.stack(cs, dim=1)
        return self.out(h_BTH), state, c_BTH

    def _input_gates(self, x_TBE: Tensor, W_x: Tensor) -> Tensor:
        """x W_x + b, the input's share of every gate [T, B, G], for the fused recurrence.

        Under autocast as one addmm in autocast's dtype: ``x @ W_x + self.b`` would be an fp32 tensor
        (b is fp32), 4H wide for every byte, and the recurrence casts it down anyway."""
        if torch.is_autocast_enabled(x_TBE.device.type):
            xz_NG = torch.addmm(self.b, x_TBE.flatten(0, 1), W_x)
            return xz_NG.view(x_TBE.shape[0], x_TBE.shape[1], -1)
        # b added in place: ``x @ W_x + self.b`` holds two 4H-wide tensors a byte at once (the same sums).
        return (x_TBE @ W_x).add_(self.b)

    def _forward_fused(self, bytes_BT: Tensor, state: State) -> tuple[Tensor, State, Tensor]:
        """``forward`` through models/recurrence.py: time-major inside, the same results outside."""
        x_TBE = self.embed(bytes_BT.T)
        W_x, W_h, W_mx, W_mh = self.cell_weights()
        xz_TBG = self._input_gates(x_TBE, W_x)
        xm_TBH = x_TBE @ W_mx
        h_TBH, c_TBH = recurrence(xz_TBG, xm_TBH, *state, W_h, W_mh, compile_gates=self.compile_gates)
        # The read-out is smaller than h (V < H): transpose the logits, not h.
        return self.out(h_TBH).transpose(0, 1), (h_TBH[-1], c_TBH[-1]), c_TBH.transpose(0, 1)

    @torch.no_grad()
    def read_packed(
        self, bytes_TN: Tensor, keep_TN1: Tensor, state: State, reading_T: list[int]
    ) -> tuple[State, list[Tensor]]:
        """T steps of rows that each hold texts end to end (``models.features``' packed batches).

        A row starts a text where ``keep`` is 0 (its state restarts from zero); at step t the first
        ``reading_T[t]`` rows read. The fused recurrence only: the state after the last step (h in the
        products' dtype, c; the rows still reading) and the cell state after each step.
        """
        W_x, W_h, W_mx, W_mh = self.cell_weights()
        x_TNE = self.embed(bytes_TN)
        xz_TNG = self._input_gates(x_TNE, W_x)
        xm_TNH = (x_TNE @ W_mx).mul_(keep_TN1)  # m = 0 where a text starts: the last text's h stays out
        del x_TNE
        h_NH, c_NH, cs = packed_states(
            xz_TNG, xm_TNH, *state, W_h, W_mh, reading_T, keep_TN1, compile_gates=self.compile_gates
        )
        return (h_NH, c_NH), cs

    @torch.no_grad()
    def final_cell_state(self, bytes_BT: Tensor, lengths_B: Tensor, *, chunk_len: int = 256) -> Tensor:
        """The cell state [B, H] after each row's own first ``lengths_B[b]`` bytes, from a zero state.

        Radford et al.'s feature, read one step at a time through ``cell`` whatever the recurrence: the
        reference path of ``models.features`` (length-bucketed batches) and what the packed, fused one
        is tested against. Bytes past a row's length (padding) never reach its state: the row's state
        stops changing at its length. Rows are read longest first and leave the batch once read, and
        the input projections are made ``chunk_len`` steps at a time, so memory stays bounded for long
        texts.
        """
        if bytes_BT.shape[0] == 0:
            return bytes_BT.new_zeros((0, self.config.hidden_size), dtype=self.b.dtype)
        if int(lengths_B.min()) < 1 or int(lengths_B.max()) > bytes_BT.shape[1]:
            raise ValueError("every length must be between 1 and the padded width")
        order_B = lengths_B.argsort(descending=True, stable=True)
        bytes_BT, lengths_B = bytes_BT[order_B], lengths_B[order_B]
        W_x, W_h, W_mx, W_mh = self.cell_weights()
        h_BH, c_BH = self.zero_state(bytes_BT.shape[0], device=bytes_BT.device)
        for t0 in range(0, int(lengths_B[0]), chunk_len):
            n = int((lengths_B > t0).sum())  # rows still reading: a prefix, since the longest come first
            x_NTE = self.embed(bytes_BT[:n, t0 : t0 + chunk_len])
            xz_NTG = x_NTE @ W_x + self.b
            xm_NTH = x_NTE @ W_mx
            W_h, W_mh = W_h.to(xz_NTG.dtype), W_mh.to(xz_NTG.dtype)  # once: a no-op after the first chunk
            state = (h_BH[:n], c_BH[:n])
            for t, (xz_NG, xm_NH) in enumerate(zip(xz_NTG.unbind(1), xm_NTH.unbind(1), strict=True)):
                reading_N1 = (lengths_B[:n] > t0 + t).unsqueeze(1)
                new_h, new_c = self.cell(xz_NG, xm_NH, state, W_h, W_mh)
                state = (torch.where(reading_N1, new_h, state[0]), torch.where(reading_N1, new_c, state[1]))
            h_BH[:n], c_BH[:n] = state
        return c_BH[order_B.argsort()]
