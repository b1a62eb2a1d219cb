"""ONNX test models: exported from the torch test models with ``torch.onnx.export(dynamo=True)``,
or written by hand with ``onnx.helper`` for the cases an export cannot make (a fixed batch).

Exports need ``onnx`` and ``onnxscript`` (dev extra); each takes a second or two.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import torch
from models import Affine, Pair


class PairTuple(torch.nn.Module):
    """:class:`models.Pair` with tuple outputs, the form an ONNX export names in order."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.pair(a, b)
        return out["SUM"], out["DOT"]


class Mlp(torch.nn.Module):
    """64 -> 1024, then 12 x [the same Linear 1024 + ReLU], -> 64, seeded: a few milliseconds
    a batch on one core, so that requests arriving together queue up and share batches."""

    def __init__(self, repeats: int = 12) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.w_in = torch.nn.Parameter(
            torch.randn(1024, 64, generator=gen) / 8, requires_grad=False
        )
        self.w = torch.nn.Parameter(
            torch.randn(1024, 1024, generator=gen) / 32, requires_grad=False
        )
        self.w_out = torch.nn.Parameter(
            torch.randn(64, 1024, generator=gen) / 32, requires_grad=False
        )
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(x @ self.w_in.T)
        for _ in range(self.repeats):
            x = torch.relu(x @ self.w.T)
        return x @ self.w_out.T


def export(
    module: torch.nn.Module,
    example: tuple[torch.Tensor, ...],
    path: Path,
    input_names: list[str],
    output_names: list[str],
) -> Path:
    """Export with a dynamic batch dimension on every input (and so every output)."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    quiet = logging.getLogger("torch")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module.eval(),
                example,
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes=tuple({0: batch} for _ in example),
                dynamo=True,
                verbose=False,
            )
            program.save(str(path))
    finally:
        quiet.setLevel(level)
    return path


def fixed_batch_model(path: Path, batch: int = 4) -> Path:
    """y = x + 1 on [batch, 3] floats, the batch dimension fixed (as some exporters leave it)."""
    import onnx
    from onnx import TensorProto, helper

    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "one"], ["Y"])],
        "fixed",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch, 3])],
        [one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def build_onnx(folder: Path) -> dict[str, torch.nn.Module]:
    """Write affine.onnx, pair.onnx, mlp.onnx and fixed.onnx into ``folder``; returns the eager modules by file name."""
    folder.mkdir(parents=True, exist_ok=True)
    affine, pair = Affine().eval(), PairTuple().eval()
    export(affine, (torch.randn(2, 16),), folder / "affine.onnx", ["INPUT0"], ["OUTPUT0"])
    export(
        pair,
        (torch.randn(2, 8), torch.randn(2, 8)),
        folder / "pair.onnx",
        ["A", "B"],
        ["SUM", "DOT"],
    )
    mlp = Mlp().eval()
    export(mlp, (torch.randn(2, 64),), folder / "mlp.onnx", ["X"], ["Y"])
    fixed_batch_model(folder / "fixed.onnx")
    return {"affine.onnx": affine, "pair.onnx": pair, "mlp.onnx": mlp}
