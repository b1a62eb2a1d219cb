"""Small real models the tests build with seeded weights and save to files.

Each builder returns the eager module too, so tests compare served results
with the model run directly in the test process.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.export import Dim


def _script_save(module: torch.nn.Module, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice
        torch.jit.script(module).save(str(path))


class Affine(torch.nn.Module):
    """y = x @ W.T + b on 16 floats."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.linear = torch.nn.Linear(16, 16)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(16, 16, generator=gen))
            self.linear.bias.copy_(torch.randn(16, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Pair(torch.nn.Module):
    """Two inputs, two outputs (a dict): exercises names and ordering."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.scale = torch.nn.Parameter(torch.randn(8, generator=gen), requires_grad=False)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"SUM": a * self.scale + b, "DOT": (a * b).sum(dim=1, keepdim=True)}


class Mixed(torch.nn.Module):
    """One input per datatype family; outputs derived from each."""

    def forward(
        self,
        flags: torch.Tensor,
        small: torch.Tensor,
        big: torch.Tensor,
        half: torch.Tensor,
        double: torch.Tensor,
        bytes_: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.logical_not(flags),
            small * 2,
            big + 1,
            half * 2,
            double / 2,
            bytes_ + 1,
        )


class Spin(torch.nn.Module):
    """A slow model: one tanh(matmul) step per input column, so a request's
    width sets its run time."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.w = torch.nn.Parameter(torch.randn(128, 128, generator=gen) / 12, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ones(1, 128)
        for _ in range(int(x.shape[1])):
            y = torch.tanh(y @ self.w)
        return x.sum(dim=1, keepdim=True) + y.sum() * 0


class Fussy(torch.nn.Module):
    """Doubles its input, and fails on purpose when any element is negative:
    a model error (INTERNAL) that tests can cause at will."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x < 0).any()):
            raise RuntimeError("negative input")
        return x * 2


def build_all(folder: Path) -> dict[str, torch.nn.Module]:
    """Write every test model into ``folder``; returns the eager modules by file name."""
    folder.mkdir(parents=True, exist_ok=True)
    affine, pair, mixed = Affine().eval(), Pair().eval(), Mixed().eval()
    _script_save(affine, folder / "affine.pt")
    _script_save(mixed, folder / "mixed.pt")
    _script_save(Spin(), folder / "spin.pt")
    _script_save(Fussy(), folder / "fussy.pt")
    batch = Dim("batch", min=1, max=64)
    example = (torch.randn(2, 8), torch.randn(2, 8))
    program = torch.export.export(pair, example, dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, str(folder / "pair.pt2"))
    return {"affine.pt": affine, "pair.pt2": pair, "mixed.pt": mixed}
