"""Hostile model files: a file built to run code when it loads runs none, through every
loader and every way a model arrives (``aserve serve FILE``, a config at start, a hot
reload, a handler archive), and is refused naming the member and the field.

Each hostile ``.pt2`` is a valid ``torch.export`` archive with one thing changed; its
payload creates a marker file, so "no code ran" is a file that does not exist. Every
one of them creates the marker through ``torch.export.load`` itself on torch 2.13
(checked by hand when these tests were written; the test does not run the exploit).
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from conftest import model_entry, spec, start_server, write_config
from hypothesis import HealthCheck, given, settings
from reload_helpers import config_status, rewrite_config, wait_attempts
from stall_watch import watch_loop

from aserve.config import ModelConfig
from aserve.engines.export_file import UnsafeProgram, load_exported_program
from aserve.engines.onnx_engine import OnnxEngine
from aserve.engines.torch_engine import TorchEngine

REPO = Path(__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    "PYTHONUNBUFFERED": "1",
}
INPUTS = [spec("x", "FP32", [4])]
OUTPUTS = [spec("OUTPUT0", "FP32", [2])]


class _Boom:
    """Pickles as ``os.system("touch MARKER")``: what a hostile pickle runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def _boom_pickle(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(_Boom(marker), buf)
    return buf.getvalue()


def _code(marker: Path) -> str:
    """Python that creates the marker, as an expression."""
    return f"__import__('os').system('touch {marker}')"


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x)


@pytest.fixture(scope="module")
def good_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A linear model exported with a dynamic batch dimension."""
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(_Linear(), (torch.randn(2, 4),), dynamic_shapes={"x": {0: batch}})
    path = tmp_path_factory.mktemp("pt2") / "good.pt2"
    torch.export.save(program, str(path))
    return path


def _rewrite(src: Path, dst: Path, edit: dict[str, Callable[[bytes], bytes]],
             add: dict[str, bytes] | None = None) -> Path:  # fmt: skip
    """Copy the archive ``src`` with some records changed (names without the archive's
    top folder, as torch names them) and some added."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        top = zin.namelist()[0].split("/", 1)[0]
        for info in zin.infolist():
            record = info.filename.split("/", 1)[1]
            data = zin.read(info)
            zout.writestr(info, edit[record](data) if record in edit else data)
        for record, data in (add or {}).items():
            zout.writestr(f"{top}/{record}", data)
    return dst


def _json_edit(change: Callable[[Any], None]) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        doc = json.loads(data)
        change(doc)
        return json.dumps(doc).encode()

    return edit


def _rename_input(doc: dict[str, Any], new: str) -> None:
    """Rename the input ``x`` everywhere it is named (its tensor, the signature)."""
    text = json.dumps(doc).replace('"x"', json.dumps(new))
    doc.clear()
    doc.update(json.loads(text))


def _pickled_weight(doc: dict[str, Any]) -> None:
    doc["config"]["l.weight"]["use_pickle"] = True


def _opaque_constant(doc: dict[str, Any]) -> None:
    doc["config"]["evil"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True,
                             "tensor_meta": None}  # fmt: skip


def _first_expr(doc: Any, new: Callable[[str], str]) -> None:
    """Replace the first symbolic size of the program."""
    sizes = doc["graph_module"]["graph"]["tensor_values"]["x"]["sizes"]
    sizes[0]["as_expr"]["expr_str"] = new(sizes[0]["as_expr"]["expr_str"])


def _weight_record(src: Path) -> str:
    with zipfile.ZipFile(src) as z:
        cfg = json.loads(
            z.read(next(n for n in z.namelist() if n.endswith("_weights_config.json")))
        )
    return "data/weights/" + cfg["config"]["l.weight"]["path_name"]


def _hostile(kind: str, good: Path, dst: Path, marker: Path) -> Path:
    """The hostile variant ``kind`` of the good archive, written at ``dst``."""
    boom = _boom_pickle(marker)
    code = _code(marker)
    if kind == "sample inputs":
        return _rewrite(good, dst, {"data/sample_inputs/model.pt": lambda _: boom})
    if kind == "pickled weight":
        return _rewrite(good, dst, {
            "data/weights/model_weights_config.json": _json_edit(_pickled_weight),
            _weight_record(good): lambda _: boom,
        })  # fmt: skip
    if kind == "legacy weights":
        return _rewrite(good, dst, {}, add={"data/weights/model.pt": boom})
    if kind == "opaque constant":
        return _rewrite(
            good, dst, {"data/constants/model_constants_config.json": _json_edit(_opaque_constant)},
            add={"data/constants/opaque_obj_0": boom},
        )  # fmt: skip
    if kind == "symbolic size":
        edit = _json_edit(lambda d: _first_expr(d, lambda e: f"{code} or {e}"))
        return _rewrite(good, dst, {"models/model.json": edit})
    if kind == "guard":
        edit = _json_edit(lambda d: d.update(guards_code=[f"{code} == 0"]))
        return _rewrite(good, dst, {"models/model.json": edit})
    if kind == "input name":
        edit = _json_edit(lambda d: _rename_input(d, f"x={code}"))
        return _rewrite(good, dst, {"models/model.json": edit})
    if kind == "operator":
        swap = lambda d: d.replace(b"torch.ops.aten.linear.default", b"torch.os.system")  # noqa: E731
        return _rewrite(good, dst, {"models/model.json": swap})
    if kind == "aotinductor":
        return _rewrite(good, dst, {}, add={"data/aotinductor/model/model.so": b"\x7fELF"})
    if kind == "old layout":
        return _old_layout(good, dst, boom)
    if kind == "old layout state json":
        return _old_layout(good, dst, boom, json_member="state_dict")
    if kind == "old layout constants json":
        return _old_layout(good, dst, boom, json_member="constants")
    if kind == "second program":
        return _second_program(good, dst, code)
    raise AssertionError(kind)


def _second_program(good: Path, dst: Path, code: str) -> Path:
    """A second program whose member name does not end in .json: torch reads every
    member under models/ and names the model by cutting five characters off."""
    with zipfile.ZipFile(good) as z:
        records = {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}
    program = json.loads(records["models/model.json"])
    _first_expr(program, lambda e: f"{code} or {e}")
    name = "evil.jso"  # what torch makes of models/evil.json.bak
    return _rewrite(good, dst, {}, add={
        "models/evil.json.bak": json.dumps(program).encode(),
        f"data/sample_inputs/{name}.pt": records["data/sample_inputs/model.pt"],
        f"data/weights/{name}_weights_config.json":
            records["data/weights/model_weights_config.json"],
        f"data/constants/{name}_constants_config.json":
            records["data/constants/model_constants_config.json"],
    })  # fmt: skip


def _old_layout(good: Path, dst: Path, boom: bytes, json_member: str = "") -> Path:
    """The layout torch wrote before 2.7, which torch 2.13 still reads when the new one
    fails; the pickle in the example inputs, or in ``serialized_{json_member}.json``
    (an older torch's name for the state dict or the constants, read the same way)."""
    from torch._export.serde.schema import SCHEMA_VERSION

    with zipfile.ZipFile(good) as z:
        program = z.read(next(n for n in z.namelist() if n.endswith("models/model.json")))
    state = io.BytesIO()
    torch.save(dict(torch.export.load(str(good)).state_dict), state)
    empty = io.BytesIO()
    torch.save({}, empty)
    with zipfile.ZipFile(dst, "w") as z:
        z.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
        z.writestr("serialized_exported_program.json", program)
        members = {"serialized_state_dict.pt": state.getvalue(),
                   "serialized_constants.pt": empty.getvalue(),
                   "serialized_example_inputs.pt": boom}  # fmt: skip
        if json_member:
            members["serialized_example_inputs.pt"] = empty.getvalue()
            members.pop(f"serialized_{json_member}.pt")
            members[f"serialized_{json_member}.json"] = boom
        for name, data in members.items():
            z.writestr(name, data)
    return dst


# What each refusal names: the member or the field, and why.
KINDS = {
    "sample inputs": "member 'data/sample_inputs/model.pt' is a pickle that does not load with "
    "weights_only=True",
    "pickled weight": "is a pickle that does not load with weights_only=True",
    "legacy weights": "member 'data/weights/model.pt' is a pickle",
    "opaque constant": "makes constant 'evil' an opaque Python object",
    "symbolic size": "tensor_values.x.sizes[0].as_expr.expr_str",
    "guard": "guards_code[0]",
    "input name": "not a plain name",
    "operator": "names the operator 'torch.os.system', not an operator name",
    "aotinductor": "is AOTInductor compiled code",
    "old layout": "member 'serialized_example_inputs.pt' is a pickle",
    "old layout state json": "member 'serialized_state_dict.json' is a pickle",
    "old layout constants json": "member 'serialized_constants.json' is a pickle",
    "second program": "member 'models/evil.json.bak' is not part of the layout",
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_hostile_export_is_refused_naming_what_and_runs_nothing(
    kind: str, good_pt2: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    path = _hostile(kind, good_pt2, tmp_path / "model.pt2", marker)
    with pytest.raises(UnsafeProgram) as refused:
        load_exported_program(path)
    assert KINDS[kind] in str(refused.value)
    assert "model.pt2" in str(refused.value)
    assert not marker.exists()


def test_the_good_export_loads_and_answers_as_the_module_does(good_pt2: Path) -> None:
    x = torch.randn(3, 4)
    want = torch.export.load(str(good_pt2)).module()(x)
    got = load_exported_program(good_pt2).module()(x)
    assert torch.equal(got, want)


class _Sizes(torch.nn.Module):
    """Guards, derived sizes, keyword inputs and a dict output: names and expressions of
    every kind the checks must let through."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, z: torch.Tensor) -> dict[str, Any]:
        h = self.conv(x) * self.scale
        return {
            "flat": h.reshape(h.shape[0], -1)[:, : x.shape[2] // 2],
            "half": y.reshape(y.shape[0] // 2, -1),
            "floor": torch.div(z, 2, rounding_mode="floor")
            + torch.einsum("bi,bi->b", z, z)[:, None],
        }


def test_exports_with_guards_sizes_and_keywords_load_and_match(tmp_path: Path) -> None:
    torch.manual_seed(1)
    d = torch.export.Dim
    batch = d("batch", min=2, max=32)
    module = _Sizes().eval()
    args = (torch.randn(2, 3, 8, 8), torch.randn(4, 6))
    kwargs = {"z": torch.randn(2, 5)}
    shapes = {"x": {0: batch, 2: d("h", min=4, max=32)}, "y": {0: 2 * d("pairs", max=16)},
              "z": {0: batch}}  # fmt: skip
    program = torch.export.export(module, args, kwargs, dynamic_shapes=shapes)
    assert program._guards_code, "the export was meant to carry guards"
    path = tmp_path / "sizes.pt2"
    torch.export.save(program, str(path))
    loaded = load_exported_program(path).module()
    got, want = loaded(*args, **kwargs), module(*args, **kwargs)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.allclose(got[key], want[key]), key


# --- the other loaders -------------------------------------------------------------


def _torch_config(path: Path, **extra: Any) -> ModelConfig:
    return ModelConfig.model_validate(
        {**model_entry("m", str(path), INPUTS, OUTPUTS), "device": "cpu", **extra}
    )


def test_a_pickle_named_like_torchscript_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "model.pt"
    torch.save({"weights": _Boom(marker)}, path)
    with pytest.raises(Exception) as refused:
        TorchEngine(_torch_config(path), path).load()
    assert "constants.pkl" in str(refused.value) or "TorchScript" in str(refused.value)
    assert not marker.exists()


def test_a_torchscript_file_with_a_hostile_pickle_inside_runs_nothing(tmp_path: Path) -> None:
    """TorchScript's unpickler knows no Python globals: os.system in data.pkl is refused."""
    marker = tmp_path / "ran"
    good = tmp_path / "good.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(4, 2)), str(good))
    import pickle

    evil = tmp_path / "model.pt"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):
                data = pickle.dumps(_Boom(marker), protocol=2)
            zout.writestr(info, data)
    with pytest.raises(RuntimeError, match=r"Unknown type name 'posix\.system'"):
        TorchEngine(_torch_config(evil), evil).load()
    assert not marker.exists()


def test_onnx_external_data_outside_the_model_folder_is_refused(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "secret").write_bytes(b"0123456789abcdef")
    weight = helper.make_tensor("W", TensorProto.UINT8, [16], vals=bytes(16), raw=True)
    weight.data_location = TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    for key, value in (("location", "../secret"), ("offset", "0"), ("length", "16")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    x = helper.make_tensor_value_info("x", TensorProto.UINT8, [None, 16])
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, [None, 16])
    graph = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "g", [x], [y], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    config = ModelConfig.model_validate({
        "name": "m", "engine": "onnx", "path": str(path), "device": "cpu",
        "inputs": [spec("x", "UINT8", [16])], "outputs": [spec("y", "UINT8", [16])],
    })  # fmt: skip
    with pytest.raises(Exception) as refused:
        OnnxEngine(config, path).load()
    assert "escapes model directory" in str(refused.value)
    del onnx


def test_a_decoder_folder_never_reads_a_pickled_checkpoint_beside_its_safetensors(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import lm_models

    from aserve.config import GenerationConfig
    from aserve.engines.decoder import DecoderEngine

    marker = tmp_path / "ran"
    folder = shutil.copytree(lm_models.tiny_model("gpt2", tmp_path_factory.getbasetemp() / "lms"),
                             tmp_path / "gpt2")  # fmt: skip
    for name in ("pytorch_model.bin", "model.pt", "training_args.bin"):
        torch.save({"state": _Boom(marker)}, folder / name)
    engine = DecoderEngine(folder, GenerationConfig(max_num_seqs=1, max_model_len=64))
    engine.load()
    assert engine.tokenizer.encode("hello")
    assert not marker.exists()


def test_a_planted_builtin_cache_file_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever can write the cache can swap the built model; what they put there still
    loads as TorchScript or not at all."""
    from aserve.engines import builtin

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    marker = tmp_path / "ran"
    path = builtin.resolve("affine")
    torch.save({"weights": _Boom(marker)}, path)
    assert builtin.resolve("affine") == path  # the cached copy is reused as it is
    entry = model_entry("affine", str(path), [spec("INPUT0", "FP32", [16])],
                        [spec("OUTPUT0", "FP32", [16])])  # fmt: skip
    config = ModelConfig.model_validate({**entry, "device": "cpu"})
    with pytest.raises(RuntimeError, match=r"constants\.pkl"):
        TorchEngine(config, path).load()
    assert not marker.exists()


# --- every way a .pt2 arrives ------------------------------------------------------


def test_aserve_serve_refuses_a_hostile_export_while_reading_its_tensors(
    good_pt2: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    path = _hostile("sample inputs", good_pt2, tmp_path / "model.pt2", marker)
    done = subprocess.run(
        [sys.executable, "-m", "aserve", "serve", str(path), "--print-config"],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert KINDS["sample inputs"] in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()


def test_a_server_refuses_a_hostile_export_at_start_and_exits(
    good_pt2: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    _hostile("guard", good_pt2, tmp_path / "model.pt2", marker)
    config = write_config(tmp_path, {"models": [model_entry("m", "model.pt2", INPUTS, OUTPUTS)]})
    done = subprocess.run(
        [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert done.returncode != 0
    assert "model 'm/1' failed to load" in done.stderr and KINDS["guard"] in done.stderr
    assert not marker.exists()


@pytest.mark.timeout(180)
async def test_a_reload_to_a_hostile_export_is_rejected_and_the_old_model_serves(
    good_pt2: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    shutil.copy(good_pt2, tmp_path / "good.pt2")
    _hostile("symbolic size", good_pt2, tmp_path / "evil.pt2", marker)
    good = model_entry("good", "good.pt2", INPUTS, OUTPUTS)
    config = write_config(tmp_path, {"models": [good]})
    server = start_server(config)
    try:
        before = config_status(server.base)["reloads"]
        evil = model_entry("evil", "evil.pt2", INPUTS, OUTPUTS)
        async with watch_loop(server.base):
            rewrite_config(config, {"models": [good, evil]})
            server.proc.send_signal(signal.SIGHUP)
            status = wait_attempts(server.base, before)
        assert status["last_reload"]["result"] == "rejected", status
        assert "models[1]: model 'evil/1' failed to load" in status["last_error"]["error"]
        assert KINDS["symbolic size"] in status["last_error"]["error"]
        assert not marker.exists()
        _infer_ok(server.base, "good")
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_a_handler_archive_of_a_hostile_export_is_refused(good_pt2: Path, tmp_path: Path) -> None:
    """An archive that holds only its config and a model.pt2: no handler code of its own."""
    marker = tmp_path / "ran"
    project = tmp_path / "proj"
    project.mkdir()
    _hostile("input name", good_pt2, project / "model.pt2", marker)
    write_config(project, {"models": [model_entry("m", "model.pt2", INPUTS, OUTPUTS)]})
    packed = subprocess.run(
        [sys.executable, "-m", "aserve", "archive", "proj", "-o", "m.aserve", "--skip-tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert packed.returncode == 0, packed.stdout + packed.stderr
    config = write_config(tmp_path, {"models": [{"name": "m", "path": "m.aserve"}]})
    done = subprocess.run(
        [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"],
        capture_output=True, text=True, timeout=120,
        env={**ENV, "ASERVE_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    assert done.returncode != 0
    assert "failed to load" in done.stderr and KINDS["input name"] in done.stderr
    assert not marker.exists()


def _infer_ok(base: str, model: str) -> None:
    import urllib.request

    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()  # fmt: skip
    request = urllib.request.Request(f"{base}/v2/models/{model}/infer", data=body)
    with urllib.request.urlopen(request, timeout=10) as r:
        answer = json.loads(r.read())
    assert r.status == 200 and np.array(answer["outputs"][0]["data"]).shape == (2,)


# --- fuzz: code in every string of the program ------------------------------------------


@pytest.fixture(scope="module")
def sizes_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export with guards, derived sizes, keyword inputs and a dict output."""
    torch.manual_seed(1)
    d = torch.export.Dim
    batch = d("batch", min=2, max=32)
    args = (torch.randn(2, 3, 8, 8), torch.randn(4, 6))
    shapes = {"x": {0: batch, 2: d("h", min=4, max=32)}, "y": {0: 2 * d("pairs", max=16)},
              "z": {0: batch}}  # fmt: skip
    program = torch.export.export(
        _Sizes().eval(), args, {"z": torch.randn(2, 5)}, dynamic_shapes=shapes
    )
    path = tmp_path_factory.mktemp("fuzz") / "sizes.pt2"
    torch.export.save(program, str(path))
    return path


def _sizes_args() -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    return (torch.randn(2, 3, 8, 8), torch.randn(4, 6)), {"z": torch.randn(2, 5)}


def _program(path: Path) -> Any:
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read(next(n for n in z.namelist() if n.endswith("models/model.json"))))


def _string_fields(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every string in the document: values, and dict keys."""
    found: list[tuple[Any, ...]] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            found.append((*path, ("key", k)))
            found += _string_fields(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += _string_fields(v, (*path, i))
    elif isinstance(doc, str):
        found.append(path)
    return found


def _kinds_of_field(doc: Any) -> list[tuple[Any, ...]]:
    """One field of each kind: the first path per shape (indices and the names of
    tensors, nodes and sizes blurred), so the sweep covers every field torch reads."""
    seen: dict[str, tuple[Any, ...]] = {}
    for path in _string_fields(doc):
        shape = "/".join(
            "[]" if isinstance(p, int) else ("key" if isinstance(p, tuple) else p)
            for p in path
            if not (isinstance(p, str) and p in _blurred(doc, path))
        )
        seen.setdefault(shape, path)
    return list(seen.values())


def _blurred(doc: Any, path: tuple[Any, ...]) -> set[str]:
    graph = doc["graph_module"]["graph"]
    return {*graph.get("tensor_values", {}), *graph.get("sym_int_values", {}),
            *doc.get("range_constraints", {})}  # fmt: skip


def _replace(doc: Any, path: tuple[Any, ...], new: str) -> None:
    *parents, last = path
    for step in parents:
        doc = doc[step]
    if isinstance(last, tuple):  # a dict key
        doc[new] = doc.pop(last[1])
    else:
        doc[last] = new


PAYLOADS = [
    "{code}",
    "x={code}",
    "1) or {code} or (1",
    'x")\n{code}\nif 1:\n    ("',
    "'+{code}+'",
    "Symbol('s0') + {code}",
    "L['x'].size()[0] + {code}",
]


def _run_mutated(program: Any, good: Path, dst: Path) -> None:
    _rewrite(good, dst, {"models/model.json": lambda _: json.dumps(program).encode()})
    args, kwargs = _sizes_args()
    try:
        load_exported_program(dst).module()(*args, **kwargs)
    except Exception:  # refused, or torch's own failure: both fine, if nothing ran
        pass


@pytest.mark.timeout(600)
def test_code_in_each_kind_of_field_of_a_program_never_runs(
    sizes_pt2: Path, tmp_path: Path
) -> None:
    """Every payload in one field of each kind (with aserve's checks off, these run code
    through the symbolic sizes, the guards, and names in the graph and the signature)."""
    fields = _kinds_of_field(_program(sizes_pt2))
    assert len(fields) > 40  # the program's schema, not a handful of names
    ran = []
    for i, where in enumerate(fields):
        for j, template in enumerate(PAYLOADS):
            marker = tmp_path / f"ran-{i}-{j}"
            program = _program(sizes_pt2)
            _replace(program, where, template.replace("{code}", _code(marker)))
            _run_mutated(program, sizes_pt2, tmp_path / "fuzzed.pt2")
            if marker.exists():
                ran.append((where, template))
    fields_hit = sorted({".".join(str(p) for p in where[-3:]) for where, _ in ran})
    assert not ran, f"{len(ran)} of {len(fields) * len(PAYLOADS)} ran code, in {fields_hit}"


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(data=st.data())
def test_any_text_in_any_string_of_a_program_runs_nothing_and_is_refused_cleanly(
    data: st.DataObject, sizes_pt2: Path, tmp_path: Path
) -> None:
    program = _program(sizes_pt2)
    where = data.draw(st.sampled_from(_string_fields(program)), label="field")
    marker = tmp_path / "ran"
    text = data.draw(st.text(max_size=40) | st.sampled_from(PAYLOADS), label="text")
    _replace(program, where, text.replace("{code}", _code(marker)))
    _run_mutated(program, sizes_pt2, tmp_path / "fuzzed.pt2")
    assert not marker.exists(), (where, text)
