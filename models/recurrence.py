"""The mLSTM recurrence as one autograd function: the cell of ``models/mlstm.py``, fast.

Legend: T time steps, B batch, H hidden units, G = 4H gate pre-activations (i, f, o, u).
Same equations as ``MLSTM.cell`` (which stays the readable reference):

    hm = h W_mh                      m = xm ⊙ hm
    z  = xz + m W_h                  (xz = x W_x + b and xm = x W_mx come in, all steps at once)
    c  = σ(f) ⊙ c + σ(i) ⊙ tanh(u)   h = σ(o) ⊙ tanh(c)

Why a function of its own: autograd through the step-by-step cell makes a full [H, 4H] gradient of
W_h (and [H, H] of W_mh) at every time step, casts it and adds it into the accumulator; at 4096 units
that traffic is most of a training step (``/work/shared/notes/gpu.md``). Here the forward loop keeps
what the backward needs in time-major [T, B, ·] tensors; the backward loop does only the two products
each step needs (dm = dz W_hᵀ, dh = (dm ⊙ xm) W_mhᵀ), and the weight gradients are two large products
over all T·B rows after the loop (dW_h = Mᵀ dZ, dW_mh = H_prevᵀ dHM).

Dtypes: the matrix products run in autocast's dtype where autocast is on (xz and xm are cast to it: x W_x
+ b comes in as fp32, since b is), else in xz's (fp32 or fp64); the gate math and the cell state in the
wider of that and the initial cell state's (fp32 under autocast).
The gate math of one step is a plain function, compiled into one kernel per direction on CUDA where
``torch.compile`` works (``compile_gates``); on a CPU it runs as plain PyTorch, which is faster to start.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

GateStep = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]
GateBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
ProductBackward = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
ReadingStep = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def gates(z_BG: Tensor, c_BH: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One step's gate math: σ(i, f, o) [B, 3H], tanh(u) [B, H] and the new c, in c's dtype, and the new
    h in z's (the products' dtype: the next step's product reads it, with no cast of its own)."""
    dt = z_BG.dtype
    z_BG = z_BG.to(c_BH.dtype)
    H = c_BH.shape[1]
    s_B3H = torch.sigmoid(z_BG[:, : 3 * H])
    tu_BH = torch.tanh(z_BG[:, 3 * H :])
    si_BH, sf_BH, so_BH = s_B3H.chunk(3, dim=1)
    c_BH = torch.addcmul(sf_BH * c_BH, si_BH, tu_BH)
    h_BH = so_BH * torch.tanh(c_BH)
    return s_B3H, tu_BH, c_BH, h_BH.to(dt)


def reading_gates(z_BG: Tensor, c_BH: Tensor, keep_B1: Tensor) -> tuple[Tensor, Tensor]:
    """The feature path's step: the new c (in c's dtype) and h (in z's, the products' dtype).

    The previous cell state is ``c ⊙ keep``: ``keep`` is 0 where a row starts a new text, 1 elsewhere.
    Only what reading needs is written (no gate values for a backward) and h comes out ready for the
    next product: one kernel where ``gates``, a mask and a cast would be three."""
    dt = z_BG.dtype
    i_BH, f_BH, o_BH, u_BH = z_BG.to(c_BH.dtype).chunk(4, dim=1)
    c_BH = torch.addcmul(torch.sigmoid(f_BH) * (c_BH * keep_B1), torch.sigmoid(i_BH), torch.tanh(u_BH))
    return c_BH, (torch.sigmoid(o_BH) * torch.tanh(c_BH)).to(dt)


def gates_backward(
    s_B3H: Tensor,
    tu_BH: Tensor,
    c_prev_BH: Tensor,
    c_BH: Tensor,
    dh_next_BH: Tensor,
    dh_out_BH: Tensor,
    dc_BH: Tensor,
) -> tuple[Tensor, Tensor]:
    """The gradients of one step's gate pre-activations dz [B, G] and of the previous cell state.

    h's gradient comes in two shares, added here: the next step's (from its product, in the products'
    dtype) and the output's. dz goes out in the products' dtype (the next product reads it), the cell
    state's in c's. Few, wide operations: on a CPU at small widths each costs about as much as its
    arithmetic; on a GPU, compiled, the adds and casts cost no kernels of their own."""
    dh_BH = dh_next_BH.to(c_BH.dtype) + dh_out_BH
    si_BH, sf_BH, so_BH = s_B3H.chunk(3, dim=1)
    tc_BH = torch.tanh(c_BH)
    dc_BH = torch.addcmul(dc_BH, dh_BH * so_BH, 1 - tc_BH * tc_BH)
    # dσ(i, f, o): the upstream gradients of the three sigmoid gates at once, times σ' = σ(1 − σ).
    ds_B3H = torch.cat([dc_BH * tu_BH, dc_BH * c_prev_BH, dh_BH * tc_BH], dim=1) * (s_B3H - s_B3H * s_B3H)
    du_BH = dc_BH * si_BH * (1 - tu_BH * tu_BH)
    return torch.cat([ds_B3H, du_BH], dim=1).to(dh_next_BH.dtype), dc_BH * sf_BH


def product_backward(dm_BH: Tensor, hm_BH: Tensor, xm_BH: Tensor) -> tuple[Tensor, Tensor]:
    """m = xm ⊙ hm: the gradients of its two factors (dxm, dhm), in one pass over dm."""
    return dm_BH * hm_BH, dm_BH * xm_BH


class _CompiledOrPlain:
    """``torch.compile(plain)``, which falls back to ``plain`` for good where compiling fails, at any call.

    Triton being importable does not mean compilation works (it also needs a C compiler, a supported
    GPU, a writable cache): a run then goes on, slower, with one warning, instead of failing. Any call may
    compile: the first, and a later one with a shape not seen before (the features path's batch shrinking
    as texts end, a validation batch), so every call is guarded; the guard costs nothing when nothing
    raises. The first call is eager in every use (the training step's warm-up runs before CUDA-graph
    capture). ``backend``: torch.compile's (tests give one that fails on purpose)."""

    def __init__(self, plain: Callable[..., Any], *, backend: str | Callable[..., Any] = "inductor") -> None:
        self.plain = plain
        # dynamic=None: a shape seen twice (features: fewer rows as texts end) compiles once, symbolically.
        self.compiled: Callable[..., Any] | None = torch.compile(plain, fullgraph=True, backend=backend)

    def __call__(self, *args: Tensor) -> Any:
        if self.compiled is None:
            return self.plain(*args)
        try:
            return self.compiled(*args)
        except torch.OutOfMemoryError:
            raise  # the device's, not the compiler's: the plain function would not fit either
        except Exception as error:  # any compiler failure: the plain function computes the same
            warnings.warn(
                f"torch.compile of {self.plain.__name__} failed ({_describe(error)}); "
                "the gate math runs uncompiled",
                RuntimeWarning,
                stacklevel=2,
            )
            self.compiled = None
            return self.plain(*args)


def _describe(error: BaseException) -> str:
    """Its type and first line, then those of the errors it wraps: the compiler's own says what failed.

    Each error once: a cycle of causes must not turn the fallback's warning into a crash."""
    described: list[str] = []
    seen: set[int] = set()
    current: object = error
    while isinstance(current, BaseException) and id(current) not in seen:
        seen.add(id(current))
        line = next((text for text in str(current).splitlines() if text.strip()), "")
        described.append(f"{type(current).__name__}: {line}")
        current = getattr(current, "inner_exception", None) or current.__cause__
    return " ".join(described)


@functools.cache
def _compiled(plain: Callable[..., Any]) -> Callable[..., Any] | None:
    """``plain`` through torch.compile (one fused kernel), or None where it cannot run."""
    try:
        import triton  # noqa: F401  (torch.compile's CUDA code generator)
    except ImportError:
        return None
    return _CompiledOrPlain(plain)


def _compiled_on(device: torch.device, compile_gates: bool, plain: Callable[..., Any]) -> Callable[..., Any]:
    """Compiled on CUDA when asked and available (it pays there: launches dominate); plain otherwise."""
    if compile_gates and device.type == "cuda":
        return _compiled(plain) or plain
    return plain


def gate_functions(device: torch.device, compile_gates: bool) -> tuple[GateStep, GateBackward]:
    """The training step's gate math, forward and backward (``_compiled_on``)."""
    return _compiled_on(device, compile_gates, gates), _compiled_on(device, compile_gates, gates_backward)


class Recurrence(torch.autograd.Function):
    """h_TBH, c_TBH from xz_TBG, xm_TBH, the initial state and the normalised W_h, W_mh."""

    @staticmethod
    def forward(
        ctx: Any,  # FunctionCtx, which carries our own attributes too
        xz_TBG: Tensor,
        xm_TBH: Tensor,
        h0_BH: Tensor,
        c0_BH: Tensor,
        W_h: Tensor,
        W_mh: Tensor,
        compile_gates: bool,
    ) -> tuple[Tensor, Tensor]:
        step, step_backward = gate_functions(xz_TBG.device, compile_gates)
        dt = xz_TBG.dtype  # the products' dtype
        acc = torch.promote_types(dt, c0_BH.dtype)  # the gate math's and the cell state's
        with torch.autocast(xz_TBG.device.type, enabled=False):
            W_h_d, W_mh_d = W_h.to(dt), W_mh.to(dt)  # cast once, not every step
            h_BH, c_BH = h0_BH.to(dt), c0_BH.to(acc)
            hs, cs, hms, ms, ss, tus = [h_BH], [c_BH], [], [], [], []
            for xz_BG, xm_BH in zip(xz_TBG.unbind(0), xm_TBH.unbind(0), strict=True):
                hm_BH = h_BH @ W_mh_d
                m_BH = xm_BH * hm_BH
                z_BG = torch.addmm(xz_BG, m_BH, W_h_d)
                s_B3H, tu_BH, c_BH, h_BH = step(z_BG, c_BH)
                hs.append(h_BH)
                cs.append(c_BH)
                hms.append(hm_BH)
                ms.append(m_BH)
                ss.append(s_B3H)
                tus.append(tu_BH)
            h_T1BH, c_T1BH = torch.stack(hs), torch.stack(cs)  # step 0 is the initial state
        ctx.set_materialize_grads(
            False
        )  # no gradient for c (training never uses it): no T additions of zeros
        ctx.save_for_backward(xm_TBH, h_T1BH, c_T1BH, torch.stack(hms), torch.stack(ms), W_h_d, W_mh_d)
        ctx.gates = (ss, tus)  # per-step tensors, read once each by the backward loop
        ctx.step_backward = step_backward
        ctx.product_backward = _compiled_on(xz_TBG.device, compile_gates, product_backward)
        ctx.dtypes = (h0_BH.dtype, c0_BH.dtype, W_h.dtype, W_mh.dtype)
        return h_T1BH[1:], c_T1BH[1:]

    @staticmethod
    def backward(ctx: Any, dh_out_TBH: Tensor | None, dc_out_TBH: Tensor | None) -> tuple[Tensor | None, ...]:
        xm_TBH, h_T1BH, c_T1BH, hm_TBH, m_TBH, W_h_d, W_mh_d = ctx.saved_tensors
        ss, tus = ctx.gates
        step_backward: GateBackward = ctx.step_backward
        m_backward: ProductBackward = ctx.product_backward
        h0_dtype, c0_dtype, W_h_dtype, W_mh_dtype = ctx.dtypes
        T, B, H = xm_TBH.shape
        dt, acc = W_h_d.dtype, c_T1BH.dtype
        with torch.autocast(xm_TBH.device.type, enabled=False):
            # dh in two shares, added inside step_backward: the next step's product's (in the products'
            # dtype, as it comes out of the product) and the output's (zeros where h's outputs had none).
            dh_BH = torch.zeros(B, H, dtype=dt, device=xm_TBH.device)
            if dh_out_TBH is None:  # one row of zeros for every step
                dh_out_TBH = torch.zeros(1, B, H, dtype=acc, device=xm_TBH.device).expand(T, B, H)
            dc_BH = torch.zeros(B, H, dtype=acc, device=xm_TBH.device)
            dzs, dxms, dhms = [], [], []
            for t in range(T - 1, -1, -1):
                if dc_out_TBH is not None:
                    dc_BH = dc_BH + dc_out_TBH[t]
                dz_BG, dc_BH = step_backward(
                    ss[t], tus[t], c_T1BH[t], c_T1BH[t + 1], dh_BH, dh_out_TBH[t], dc_BH
                )
                dm_BH = dz_BG @ W_h_d.T
                dxm_BH, dhm_BH = m_backward(dm_BH, hm_TBH[t], xm_TBH[t])
                dh_BH = dhm_BH @ W_mh_d.T
                dzs.append(dz_BG)
                dxms.append(dxm_BH)
                dhms.append(dhm_BH)
            dz_TBG, dhm_TBH = torch.stack(dzs[::-1]), torch.stack(dhms[::-1])
            # The weight gradients: two products over all T·B rows, not T small ones.
            dW_h = m_TBH.flatten(0, 1).T @ dz_TBG.flatten(0, 1) if ctx.needs_input_grad[4] else None
            dW_mh = h_T1BH[:-1].flatten(0, 1).T @ dhm_TBH.flatten(0, 1) if ctx.needs_input_grad[5] else None
        return (
            dz_TBG,
            torch.stack(dxms[::-1]),
            dh_BH.to(h0_dtype),
            dc_BH.to(c0_dtype),
            None if dW_h is None else dW_h.to(W_h_dtype),
            None if dW_mh is None else dW_mh.to(W_mh_dtype),
            None,
        )


def _in_autocast_dtype(xz: Tensor, xm: Tensor) -> tuple[Tensor, Tensor]:
    """xz and xm in autocast's dtype where it is on, so the products run in it (they run with autocast
    off): x W_x + b is fp32 under autocast, since b is, and would make every product an fp32 one."""
    device_type = xz.device.type
    if not torch.is_autocast_enabled(device_type):
        return xz, xm
    dt = torch.get_autocast_dtype(device_type)
    return xz.to(dt), xm.to(dt)


def recurrence(
    xz_TBG: Tensor,
    xm_TBH: Tensor,
    h0_BH: Tensor,
    c0_BH: Tensor,
    W_h: Tensor,
    W_mh: Tensor,
    *,
    compile_gates: bool = True,
) -> tuple[Tensor, Tensor]:
    """h and c after every step, [T, B, H] each (h in xz's dtype, c in the gate math's)."""
    if xz_TBG.shape[0] == 0:
        raise ValueError("the recurrence needs at least one time step")
    xz_TBG, xm_TBH = _in_autocast_dtype(xz_TBG, xm_TBH)
    # torch types Function.apply without annotations.
    result: tuple[Tensor, Tensor] = Recurrence.apply(  # type: ignore[no-untyped-call]
        xz_TBG.contiguous(), xm_TBH.contiguous(), h0_BH, c0_BH, W_h, W_mh, compile_gates
    )
    return result


@torch.no_grad()
def packed_states(
    xz_TNG: Tensor,
    xm_TNH: Tensor,
    h_NH: Tensor,
    c_NH: Tensor,
    W_h: Tensor,
    W_mh: Tensor,
    reading_T: list[int],
    keep_TN1: Tensor,
    *,
    compile_gates: bool = True,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """T steps over rows that each read texts laid end to end: the state (h, c) after the last step, and
    the cell state after every step ([reading_T[t], H] each), where the texts' features are taken.

    A row starts a text where ``keep`` is 0: its cell state restarts from zero and its h does not
    reach the step (xm comes in already multiplied by ``keep``, so m = 0 there). At step t only the
    first ``reading_T[t]`` rows still read (rows are ordered by where their last text ends), so the
    state shrinks to them and rows that have ended cost nothing. h is in the products' dtype.

    Four calls a step (two products, a product of two, the compiled gates) and nothing else: on a
    GPU at a few hundred rows the host's time per call, not the device's, sets the pace.
    """
    step: ReadingStep = _compiled_on(xz_TNG.device, compile_gates, reading_gates)
    xz_TNG, xm_TNH = _in_autocast_dtype(xz_TNG, xm_TNH)
    dt = xz_TNG.dtype
    W_h_d, W_mh_d = W_h.to(dt), W_mh.to(dt)
    h_NH = h_NH.to(dt)
    cs: list[Tensor] = []
    with torch.autocast(xz_TNG.device.type, enabled=False):
        for xz_NG, xm_NH, keep_N1, n in zip(
            xz_TNG.unbind(0), xm_TNH.unbind(0), keep_TN1.unbind(0), reading_T, strict=True
        ):
            if n != xz_NG.shape[0]:  # rows that have ended drop out (views)
                xz_NG, xm_NH, keep_N1 = xz_NG[:n], xm_NH[:n], keep_N1[:n]
            if n != h_NH.shape[0]:
                h_NH, c_NH = h_NH[:n], c_NH[:n]
            z_NG = torch.addmm(xz_NG, xm_NH * (h_NH @ W_mh_d), W_h_d)
            c_NH, h_NH = step(z_NG, c_NH, keep_N1)
            cs.append(c_NH)
    return h_NH, c_NH, cs
