"""The sentiment neuron (Radford et al. 2017, Figure 3 and Table 2): one cell unit read byte by byte,
and text sampled with that unit held fixed.

Legend: T bytes, H hidden units, V vocabulary (256 bytes). Both functions step the reference cell
``MLSTM.cell`` with the weights of ``MLSTM.cell_weights``, so the value after a text's last byte is the
feature ``MLSTM.final_cell_state`` gives for that text.

    p_t = σ(c_t · w + b)                       the probe, had the text ended at byte t
    c_t[unit] ← value                          generation with the unit held (after every step)
    x_{t+1} ~ softmax(out(h_t) / temperature)  temperature 0: the most likely byte (greedy)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.mlstm import MLSTM


@dataclass(frozen=True)
class ByteReading:
    """The cell state's unit and the probe's probability after each byte of one chunk."""

    values_T: np.ndarray  # float32: c_t[unit]
    probability_T: np.ndarray | None  # float32: σ(c_t · w + b); None without a probe (a bare checkpoint)


def check_unit(model: MLSTM, unit: int) -> None:
    H = model.config.hidden_size
    if not 0 <= unit < H:
        raise ValueError(f"unit {unit} is outside the model's {H} units (0..{H - 1})")


@torch.no_grad()
def read_bytes(
    model: MLSTM,
    data: bytes,
    coef_H: np.ndarray | None,
    intercept: float,
    *,
    unit: int,
    chunk_len: int = 4096,
) -> Iterator[ByteReading]:
    """Per-byte readings of ``data`` from a zero state, ``chunk_len`` bytes at a time (bounded memory);
    ``coef_H`` None (no probe): the unit's values alone."""
    check_unit(model, unit)
    model = model.eval()
    device = model.b.device
    W_x, W_h, W_mx, W_mh = model.cell_weights()
    # A copy: coef may be read-only.
    w_H = None if coef_H is None else torch.tensor(np.asarray(coef_H, dtype=np.float32), device=device)
    state = model.zero_state(1, device=device)
    for t0 in range(0, len(data), chunk_len):
        bytes_1T = torch.frombuffer(bytearray(data[t0 : t0 + chunk_len]), dtype=torch.uint8).long()[None]
        x_1TE = model.embed(bytes_1T.to(device))
        xz_1TG = x_1TE @ W_x + model.b
        xm_1TH = x_1TE @ W_mx
        cs = []
        for xz_1G, xm_1H in zip(xz_1TG.unbind(1), xm_1TH.unbind(1), strict=True):
            state = MLSTM.cell(xz_1G, xm_1H, state, W_h, W_mh)
            cs.append(state[1][0])
        c_TH = torch.stack(cs)
        p_T = None if w_H is None else torch.sigmoid(c_TH @ w_H + intercept).float().cpu().numpy()
        yield ByteReading(c_TH[:, unit].float().cpu().numpy(), p_T)


@torch.no_grad()
def generate(
    model: MLSTM,
    prompt: bytes,
    *,
    length: int,
    temperature: float,
    samples: int,
    seed: int,
    unit: int | None = None,
    value: float | None = None,
) -> tuple[list[bytes], np.ndarray]:
    """``samples`` continuations of ``prompt`` of ``length`` bytes each, and the held unit's cell value
    after every generated step [samples, length] (NaN when no unit is held).

    With ``unit`` and ``value`` the unit's cell value is overwritten after every step, prompt included,
    so it drives the hidden state, the next byte and the step after. Same seed, same bytes.
    """
    if length < 1:
        raise ValueError(f"length must be at least 1, got {length}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be 0 (greedy) or positive, got {temperature}")
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    if (unit is None) != (value is None):
        raise ValueError("give both unit and value to hold a unit, or neither")
    if unit is not None:
        check_unit(model, unit)
    model = model.eval()
    device = model.b.device
    generator = torch.Generator(device=device).manual_seed(seed)
    W_x, W_h, W_mx, W_mh = model.cell_weights()
    h_BH, c_BH = model.zero_state(samples, device=device)

    H = model.config.hidden_size

    def step(bytes_B: Tensor, h_BH: Tensor, c_BH: Tensor) -> tuple[Tensor, Tensor]:
        x_BE = model.embed(bytes_B)
        xz_BG, xm_BH = x_BE @ W_x + model.b, x_BE @ W_mx
        new_h_BH, new_c_BH = MLSTM.cell(xz_BG, xm_BH, (h_BH, c_BH), W_h, W_mh)
        if unit is None or value is None:
            return new_h_BH, new_c_BH
        # c[unit] ← value, and h[unit] = σ(o[unit]) ⊙ tanh(value) follows it (the output gate recomputed
        # for that one unit), as NVIDIA's generate.py does.
        o_B = xz_BG[:, 2 * H + unit] + (xm_BH * (h_BH @ W_mh)) @ W_h[:, 2 * H + unit]
        new_c_BH[:, unit] = value
        new_h_BH[:, unit] = torch.sigmoid(o_B) * torch.tanh(torch.tensor(value, dtype=new_c_BH.dtype))
        return new_h_BH, new_c_BH

    # The prompt (with the cleaning's front pad, so samples start as reviews do).
    for byte in prompt:
        h_BH, c_BH = step(torch.full((samples,), byte, device=device), h_BH, c_BH)
    out_BT = torch.zeros((samples, length), dtype=torch.long)
    held_BT = np.full((samples, length), np.nan, dtype=np.float32)
    for t in range(length):
        logits_BV = model.out(h_BH).float()
        if temperature == 0:
            next_B = logits_BV.argmax(dim=1)
        else:
            probs_BV = torch.softmax(logits_BV / temperature, dim=1)
            next_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
        out_BT[:, t] = next_B.cpu()
        h_BH, c_BH = step(next_B, h_BH, c_BH)
        if unit is not None:
            held_BT[:, t] = c_BH[:, unit].float().cpu().numpy()
    return [bytes(row.tolist()) for row in out_BT.to(torch.uint8)], held_BT
