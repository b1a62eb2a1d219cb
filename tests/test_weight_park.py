"""A TorchScript module's weights released and read back from its file
(aserve.engines.weight_park): the same answers after, the memory let go
meanwhile, storages shared by two tensors shared again, a file changed since
the load refused, and a module whose weights changed after its load keeping
what the file does not hold."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from aserve.engines.base import ParkError
from aserve.engines.weight_park import WeightPark

pytestmark = pytest.mark.timeout(60)


class Tied(torch.nn.Module):
    """Two linears sharing one weight, a buffer, and a view of the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)
        self.b.weight = self.a.weight  # tied: one storage
        self.register_buffer("scale", torch.arange(32, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "tied.pt"
    torch.jit.save(torch.jit.script(Tied().eval()), str(path))
    return path


def _loaded(path: Path) -> torch.jit.ScriptModule:
    return torch.jit.load(str(path)).eval()


def test_weights_read_back_give_the_same_answers(saved: Path) -> None:
    module = _loaded(saved)
    x = torch.randn(4, 32)
    before = module(x)
    plan = WeightPark.plan(module, saved)
    assert plan is not None
    weight, bias, scale = 32 * 32 * 4, 32 * 4, 32 * 4
    assert plan.nbytes == weight + 2 * bias + scale  # the tied weight counted once
    assert plan.release() == plan.nbytes and plan.parked
    assert all(t.numel() == 0 for t in module.state_dict(keep_vars=True).values())
    with pytest.raises(RuntimeError):
        module(x)  # released: nothing to compute with
    plan.restore(torch.device("cpu"))
    assert not plan.parked
    assert torch.equal(module(x), before)
    tensors = module.state_dict(keep_vars=True)
    assert tensors["a.weight"].data_ptr() == tensors["b.weight"].data_ptr()  # tied again
    plan.release()  # and again: a second eviction
    plan.restore(torch.device("cpu"))
    assert torch.equal(module(x), before)


def test_a_file_changed_since_the_load_is_refused(saved: Path) -> None:
    module = _loaded(saved)
    plan = WeightPark.plan(module, saved)
    assert plan is not None
    plan.release()
    st = saved.stat()
    os.utime(saved, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ParkError, match="changed since it was loaded"):
        plan.restore(torch.device("cpu"))
    assert plan.parked


def test_weights_changed_after_the_load_stay(saved: Path) -> None:
    module = _loaded(saved)
    with torch.no_grad():
        module.scale.add_(1.0)  # no longer what the file holds
    x = torch.randn(2, 32)
    before = module(x)
    plan = WeightPark.plan(module, saved)
    assert plan is not None
    assert plan.nbytes == 32 * 32 * 4 + 2 * 32 * 4  # the buffer is not released
    plan.release()
    assert module.scale.numel() == 32
    plan.restore(torch.device("cpu"))
    assert torch.equal(module(x), before)


def test_a_file_that_is_not_a_torchscript_zip_has_no_plan(tmp_path: Path, saved: Path) -> None:
    module = _loaded(saved)
    other = tmp_path / "other.pt"
    other.write_bytes(b"not a zip")
    assert WeightPark.plan(module, other) is None
