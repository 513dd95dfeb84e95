"""The fused recurrence (models/recurrence.py) against autograd through the reference cell, in float64."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.features import _read_packed
from models.mlstm import MLSTM, MLSTMConfig
from models.recurrence import _CompiledOrPlain, _describe, gates, gates_backward, recurrence

RTOL, ATOL = 1e-10, 1e-12


def _pair(hidden: int = 12, seed: int = 0) -> tuple[MLSTM, MLSTM]:
    """The same float64 weights behind the fused and the reference recurrence."""
    torch.manual_seed(seed)
    fused = MLSTM(MLSTMConfig(hidden_size=hidden, embed_size=8)).double()
    with torch.no_grad():  # gains and bias away from their initial values, so every term matters
        for p in (fused.g_x, fused.g_h, fused.g_mx, fused.g_mh, fused.b):
            p.add_(torch.randn_like(p) * 0.3)
    reference = MLSTM(fused.config, recurrence="reference").double()
    reference.load_state_dict(fused.state_dict())
    return fused, reference


def _loss_and_grads(
    model: MLSTM, bytes_BT: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, splits: tuple[int, ...]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs and the gradients of every parameter and of (h0, c0), reading the bytes in ``splits`` calls
    with the state carried from one call to the next."""
    h0, c0 = h0.clone().requires_grad_(), c0.clone().requires_grad_()
    torch.manual_seed(1)
    state, outputs, loss = (h0, c0), [], torch.zeros((), dtype=torch.float64)
    for part in bytes_BT.split(splits, dim=1):
        logits, state, cells = model(part, state)
        # Every output takes part: logits, the cell state of every step, the final h and c.
        # (randn, not randn_like: the fused outputs are transposed views, and randn_like follows strides)
        weights_BTV = torch.randn(logits.shape, dtype=logits.dtype)
        weights_BTH = torch.randn(cells.shape, dtype=cells.dtype)
        loss = loss + (logits * weights_BTV).sum() + (cells * weights_BTH).sum()
        outputs += [logits, cells]
    loss = loss + (state[0] * 0.7).sum() + (state[1] * 1.3).sum()
    outputs += list(state)
    grads = torch.autograd.grad(loss, [*model.parameters(), h0, c0])
    return outputs, list(grads)


@pytest.mark.parametrize(
    ("batch", "splits"),
    [(3, (7,)), (5, (1,)), (1, (9,)), (3, (4, 5)), (7, (1, 1, 3))],
    ids=["odd B and T", "T = 1", "B = 1", "state across two calls", "three calls, T = 1 twice"],
)
def test_fused_gradients_equal_autograd_through_the_reference_cell(
    batch: int, splits: tuple[int, ...]
) -> None:
    fused, reference = _pair()
    bytes_BT = torch.randint(0, 256, (batch, sum(splits)))
    h0, c0 = torch.randn(batch, 12, dtype=torch.float64), torch.randn(batch, 12, dtype=torch.float64)
    fused_out, fused_grads = _loss_and_grads(fused, bytes_BT, h0, c0, splits)
    ref_out, ref_grads = _loss_and_grads(reference, bytes_BT, h0, c0, splits)
    for fast, ref in zip(fused_out, ref_out, strict=True):
        torch.testing.assert_close(fast, ref, rtol=RTOL, atol=ATOL)
    names = [name for name, _ in fused.named_parameters()] + ["h0", "c0"]
    for name, fast, ref in zip(names, fused_grads, ref_grads, strict=True):
        assert fast.abs().max() > 0, f"gradient of {name} is zero: the test would not see it"
        torch.testing.assert_close(fast, ref, rtol=RTOL, atol=ATOL, msg=f"gradient of {name}")


def test_gate_backward_is_the_derivative_of_the_gate_math() -> None:
    torch.manual_seed(0)
    z = torch.randn(3, 20, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    s, tu, c_new, h_new = gates(z, c)
    dh, dc = torch.randn_like(h_new), torch.randn_like(c_new)
    dz_auto, dc_auto = torch.autograd.grad((h_new * dh).sum() + (c_new * dc).sum(), [z, c])
    dh_next = torch.randn_like(h_new)  # h's gradient in two shares: the next step's and the output's
    dz, dc_prev = gates_backward(s, tu, c, c_new, dh_next, dh - dh_next, dc)
    torch.testing.assert_close(dz, dz_auto, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dc_prev, dc_auto, rtol=RTOL, atol=ATOL)


def test_the_recurrence_needs_a_time_step() -> None:
    empty = torch.zeros(0, 2, 8)
    with pytest.raises(ValueError, match="at least one time step"):
        recurrence(
            empty, empty[..., :2], torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 8), torch.zeros(2, 2)
        )


def test_an_unknown_recurrence_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown recurrence 'cudnn': choose one of fused, reference"):
        MLSTM(MLSTMConfig(hidden_size=4), recurrence="cudnn")  # type: ignore[arg-type]


def test_both_recurrences_have_the_same_checkpoint() -> None:
    fused, reference = _pair()
    assert fused.state_dict().keys() == reference.state_dict().keys()


class _ProductDtypes(TorchDispatchMode):
    """Records the dtypes of every matrix product as it reaches its kernel (after autocast's casts)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


def test_under_autocast_the_fused_products_run_in_its_dtype() -> None:
    """x W_x + b is fp32 under autocast (b is): the recurrence must still multiply in bf16, or a GPU runs
    every product of training and of features in fp32."""
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(hidden_size=16, embed_size=8))
    bytes_BT = torch.randint(0, 256, (3, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _ProductDtypes() as training:
            logits, (h, c), _ = model(bytes_BT)
            logits.float().sum().backward()
        with _ProductDtypes() as features:  # the features path: texts packed end to end
            _read_packed(model, [b"hello", b"ab", b"abcd"], 2, torch.device("cpu"), None)
    assert training.dtypes == {torch.bfloat16}, training.dtypes
    assert features.dtypes == {torch.bfloat16}, features.dtypes
    assert h.dtype == torch.bfloat16 and c.dtype == torch.float32  # the cell state stays wide


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """torch.compile's caches empty before and after: ``gates`` compiled by one test's backend is not
    another's, and no test counts recompiles left by an earlier one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_gate_function_that_fails_to_compile_runs_uncompiled_with_a_warning() -> None:
    def halved(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # fullgraph=True refuses this: compilation fails at the first call
        return x / 2

    step = _CompiledOrPlain(halved)
    x = torch.arange(4.0)
    with pytest.warns(RuntimeWarning, match="halved failed .* the gate math runs uncompiled"):
        torch.testing.assert_close(step(x), x / 2)
    torch.testing.assert_close(step(x), x / 2)  # and from then on, without asking the compiler again
    assert step.compiled is None


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compile_that_fails_at_a_later_shape_falls_back_too() -> None:
    """The first shape compiles; a second one (a shorter feature batch) recompiles and fails: that call and
    every later one run uncompiled, with one warning, instead of raising."""
    compiles: list[int] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiles.append(len(compiles))
        if len(compiles) > 1:
            raise RuntimeError("no C compiler for this shape")
        return graph.forward

    step = _CompiledOrPlain(gates, backend=backend)
    z, c = torch.randn(6, 32), torch.randn(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: it compiled
        for got, want in zip(step(z, c), gates(z, c), strict=True):
            torch.testing.assert_close(got, want)
    assert step.compiled is not None and len(compiles) == 1
    z, c = torch.randn(3, 32), torch.randn(3, 8)
    with pytest.warns(RuntimeWarning, match="gates failed .*no C compiler"):
        for got, want in zip(step(z, c), gates(z, c), strict=True):
            torch.testing.assert_close(got, want)
    assert step.compiled is None and len(compiles) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning in all, and no compiler asked again
        step(torch.randn(5, 32), torch.randn(5, 8))
    assert len(compiles) == 2


@pytest.mark.usefixtures("fresh_dynamo")
def test_running_out_of_device_memory_is_not_taken_for_a_compiler_failure() -> None:
    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        def out_of_memory(*args: Any) -> Any:
            raise torch.OutOfMemoryError("CUDA out of memory")

        return out_of_memory

    step = _CompiledOrPlain(gates, backend=backend)
    with pytest.raises(torch.OutOfMemoryError):
        step(torch.randn(2, 8), torch.randn(2, 2))
    assert step.compiled is not None  # the plain function would not fit either: nothing to fall back to


def test_the_warning_names_the_wrapped_errors_once_each() -> None:
    """The compiler's own error sits under torch's wrapper; a cycle of causes ends the description, not
    the run."""
    wrapper, inner = RuntimeError("backend='inductor' raised:\n  more"), OSError("no C compiler")
    wrapper.__cause__, inner.__cause__ = inner, wrapper
    assert _describe(wrapper) == "RuntimeError: backend='inductor' raised: OSError: no C compiler"
