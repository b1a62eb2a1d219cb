"""Triton's system shared memory extension, end to end with the released tritonclient.

A real server on loopback (its own: the standard torch models, a python
handler for BYTES and one whose requests the test holds) and
``tritonclient.utils.shared_memory`` as its users call it: regions created by
the client under /dev/shm, registered over HTTP or gRPC, named by inputs and
requested outputs; the answers read back from the regions.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
import tritonclient.utils.shared_memory as shm
from conftest import HANDLERS, ServerProcess, spec, standard_models, start_server, write_config
from helpers import mixed_arrays
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

REVERSE = '''
import numpy as np


class Reverse:
    """TEXT (BYTES [2]) -> REV (BYTES [2]): each element's bytes reversed."""

    def load(self, context):
        pass

    def preprocess(self, request):
        return {"t": request.inputs["TEXT"]}

    def infer(self, batch):
        t = batch["t"]
        out = np.empty(t.shape, dtype=object)
        for i, x in np.ndenumerate(t):
            out[i] = bytes(x)[::-1]
        return {"r": out}

    def postprocess(self, outputs, request):
        return {"REV": outputs["r"]}
'''


@pytest.fixture(scope="module")
def shm_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    work = tmp_path_factory.mktemp("shm")
    (model_dir / "reverse.py").write_text(REVERSE)
    shutil.copy(HANDLERS / "held.py", model_dir / "held.py")
    os.mkfifo(work / "gate")
    models = [m for m in standard_models() if m["name"] in ("affine", "pair", "mixed")]
    models += [
        {"name": "reverse", "engine": "python", "handler": "reverse:Reverse",
         "inputs": [spec("TEXT", "BYTES", [2])], "outputs": [spec("REV", "BYTES", [2])]},
        {"name": "held", "engine": "python", "handler": "held:Held",
         "parameters": {"gate": str(work / "gate"), "began": str(work / "began")},
         "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])]},
    ]  # fmt: skip
    config = {"grpc": {"host": "127.0.0.1", "port": 0}, "models": models}
    srv = start_server(write_config(model_dir, config, "shm_config.json"))
    yield srv, work
    srv.stop()


@pytest.fixture
def server(shm_server: Any) -> ServerProcess:
    return shm_server[0]


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(server.url)
    yield client
    client.unregister_system_shared_memory()  # every region, whatever a test left
    client.close()


@pytest.fixture
def grpc(server: ServerProcess) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.unregister_system_shared_memory()
    client.close()


@pytest.fixture
def regions() -> Iterator[Any]:
    """make(name, byte_size) -> (handle, key): client regions, destroyed after the test."""
    made = []

    def make(name: str, byte_size: int) -> tuple[Any, str]:
        key = f"/aserve_test_{name}_{uuid.uuid4().hex[:8]}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        made.append(handle)
        return handle, key

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _affine(eager_models: dict[str, Any], x: np.ndarray) -> np.ndarray:
    return eager_models["affine"](torch.from_numpy(x)).detach().numpy()


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_inputs_and_outputs_in_shared_memory(request, proto, regions, eager_models):
    client = request.getfixturevalue(proto)
    mod = httpclient if proto == "http" else grpcclient
    x = np.arange(32, dtype=np.float32).reshape(2, 16) / 7
    in_handle, in_key = regions("in", x.nbytes + 64)
    out_handle, out_key = regions("out", x.nbytes + 128)
    shm.set_shared_memory_region(in_handle, [x], offset=64)
    client.register_system_shared_memory("in", in_key, x.nbytes + 64)
    # A region that starts inside its object: the output goes 32 bytes into it.
    client.register_system_shared_memory("out", out_key, x.nbytes + 96, offset=32)

    inp = mod.InferInput("INPUT0", [2, 16], "FP32")
    inp.set_shared_memory("in", x.nbytes, offset=64)
    out = mod.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("out", x.nbytes + 96, offset=0)
    result = client.infer("affine", [inp], outputs=[out])

    got = shm.get_contents_as_numpy(out_handle, np.float32, [2, 16], offset=32)
    np.testing.assert_allclose(got, _affine(eager_models, x), rtol=1e-6)
    if proto == "http":
        meta = result.get_output("OUTPUT0")
        assert "data" not in meta and meta["shape"] == [2, 16]
        assert meta["parameters"]["shared_memory_region"] == "out"
        assert meta["parameters"]["shared_memory_byte_size"] == x.nbytes
        assert result.get_response()["model_name"] == "affine"
    else:
        meta = result.get_output("OUTPUT0")
        assert list(meta.shape) == [2, 16]
        assert meta.parameters["shared_memory_region"].string_param == "out"
        assert meta.parameters["shared_memory_byte_size"].int64_param == x.nbytes
        assert result.get_response().raw_output_contents == [b""]  # in step, empty


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_inputs_in_shared_memory_outputs_inline_every_datatype(
    request, proto, regions, eager_models
):
    client = request.getfixturevalue(proto)
    mod = httpclient if proto == "http" else grpcclient
    arrays = mixed_arrays(seed=11)
    names = list(arrays)
    total = sum(a.nbytes for a in arrays.values())
    in_handle, in_key = regions("mixed_in", total)
    out_handle, out_key = regions("mixed_out", total)
    shm.set_shared_memory_region(in_handle, list(arrays.values()))
    client.register_system_shared_memory("mixed_in", in_key, total)
    client.register_system_shared_memory("mixed_out", out_key, total)
    inputs, outputs, offset, out_offsets = [], [], 0, {}
    for i, (name, arr) in enumerate(arrays.items()):
        inp = mod.InferInput(f"IN_{name}", list(arr.shape), mod.np_to_triton_dtype(arr.dtype))
        if i % 2:  # every other input in shared memory, the rest sent with the request
            inp.set_shared_memory("mixed_in", arr.nbytes, offset=offset)
        else:
            inp.set_data_from_numpy(arr)
        out = mod.InferRequestedOutput(f"OUT_{name}")
        if i % 3 == 0:  # some outputs into shared memory, the rest inline
            out.set_shared_memory("mixed_out", arr.nbytes, offset=offset)
            out_offsets[name] = offset
        inputs.append(inp)
        outputs.append(out)
        offset += arr.nbytes
    result = client.infer("mixed", inputs, outputs=outputs)
    expected = eager_models["mixed"](*[torch.from_numpy(v) for v in arrays.values()])
    for name, want in zip(names, expected, strict=True):
        want = want.numpy()
        if name in out_offsets:
            got = shm.get_contents_as_numpy(out_handle, want.dtype, list(want.shape),
                                            offset=out_offsets[name])  # fmt: skip
        else:
            got = result.as_numpy(f"OUT_{name}")
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_bytes_tensors_in_shared_memory(request, proto, regions):
    client = request.getfixturevalue(proto)
    mod = httpclient if proto == "http" else grpcclient
    text = np.array([[b"shared", b"\xffmemory"]], dtype=object)
    raw = serialize_byte_tensor(text)  # Triton's length-prefixed form
    size = len(raw.item())
    in_handle, in_key = regions("text_in", size + 8)
    out_handle, out_key = regions("text_out", 256)
    shm.set_shared_memory_region(in_handle, [raw], offset=8)
    client.register_system_shared_memory("text_in", in_key, size + 8)
    client.register_system_shared_memory("text_out", out_key, 256)
    inp = mod.InferInput("TEXT", [1, 2], "BYTES")
    inp.set_shared_memory("text_in", size, offset=8)
    out = mod.InferRequestedOutput("REV")
    out.set_shared_memory("text_out", 256)
    result = client.infer("reverse", [inp], outputs=[out])
    got = shm.get_contents_as_numpy(out_handle, np.object_, [1, 2])
    assert got.tolist() == [[b"derahs", b"yromem\xff"]]
    meta = result.get_output("REV")
    written = (meta["parameters"] if proto == "http" else
               {k: v.int64_param for k, v in meta.parameters.items()})  # fmt: skip
    assert written["shared_memory_byte_size"] == size


def test_status_and_unregister_one_and_all(http, grpc, regions):
    _, key_a = regions("a", 64)
    _, key_b = regions("b", 128)
    http.register_system_shared_memory("a", key_a, 64)
    grpc.register_system_shared_memory("b", key_b, 96, offset=16)
    assert http.get_system_shared_memory_status() == [
        {"name": "a", "key": key_a, "offset": 0, "byte_size": 64},
        {"name": "b", "key": key_b, "offset": 16, "byte_size": 96},
    ]
    assert http.get_system_shared_memory_status("b") == [
        {"name": "b", "key": key_b, "offset": 16, "byte_size": 96}
    ]
    status = grpc.get_system_shared_memory_status(as_json=True)["regions"]
    assert status["a"] == {"name": "a", "key": key_a, "byte_size": "64"}  # 0: left out
    assert status["b"]["offset"] == "16"
    grpc.unregister_system_shared_memory("a")
    assert [r["name"] for r in http.get_system_shared_memory_status()] == ["b"]
    http.unregister_system_shared_memory("no-such-region")  # as Triton: nothing to do
    http.unregister_system_shared_memory()
    assert http.get_system_shared_memory_status() == []
    assert grpc.get_system_shared_memory_status().regions == {}
    with pytest.raises(
        InferenceServerException, match="Unable to find system shared memory region: 'a'"
    ):
        http.get_system_shared_memory_status("a")
    # The name is free again.
    http.register_system_shared_memory("a", key_a, 64)
    assert [r["name"] for r in http.get_system_shared_memory_status()] == ["a"]


def _refused(call: Any, *words: str, grpc_code: str = "StatusCode.INVALID_ARGUMENT") -> str:
    with pytest.raises(InferenceServerException) as exc:
        call()
    message = exc.value.message()
    assert exc.value.status() in ("400", grpc_code), (exc.value.status(), message)
    for word in words:
        assert word in message, (word, message)
    return message


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_registration_is_checked(request, proto, regions):
    client = request.getfixturevalue(proto)
    _, key = regions("reg", 64)
    register = client.register_system_shared_memory
    _refused(lambda: register("reg", key, 64, offset=8), "offset 8 + byte_size 64", "past the end")
    _refused(lambda: register("reg", "/../etc/passwd", 8), "one name")
    _refused(lambda: register("reg", "/aserve_no_such_object_x", 8), "names no object")
    _refused(lambda: register("reg", "/", 8), "one name")
    link = Path("/dev/shm") / f"aserve_test_link_{uuid.uuid4().hex[:8]}"
    link.symlink_to(Path("/dev/shm") / key.lstrip("/"))
    try:
        _refused(lambda: register("reg", "/" + link.name, 8), "symbolic link")
    finally:
        link.unlink()
    register("reg", key, 64)
    _refused(lambda: register("reg", key, 64), "'reg' already in manager")
    _refused(
        lambda: client.register_cuda_shared_memory("gpu", "AAAA", 0, 64),
        "CUDA shared memory needs a GPU; this server has none",
    )
    assert client.get_cuda_shared_memory_status(**({"as_json": True} if proto == "grpc" else {})) in (
        [], {},
    )  # fmt: skip


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_inference_bounds_are_checked(request, proto, regions):
    client = request.getfixturevalue(proto)
    mod = httpclient if proto == "http" else grpcclient
    x = np.ones((1, 16), np.float32)
    in_handle, in_key = regions("bin", 64)
    _, out_key = regions("bout", 64)
    shm.set_shared_memory_region(in_handle, [x])
    client.register_system_shared_memory("bin", in_key, 64)
    client.register_system_shared_memory("bout", out_key, 32)

    def infer(
        in_size: int = 64, in_offset: int = 0, region: str = "bin", out_size: int | None = None
    ):
        inp = mod.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_shared_memory(region, in_size, offset=in_offset)
        outputs = None
        if out_size is not None:
            out = mod.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("bout", out_size)
            outputs = [out]
        return lambda: client.infer("affine", [inp], outputs=outputs)

    _refused(infer(in_offset=8), "input 'INPUT0'", "8 + shared_memory_byte_size 64 = 72",
             "past the end of shared memory region 'bin' (64 bytes)")  # fmt: skip
    _refused(infer(in_size=60), "input 'INPUT0'", "60 bytes", "[1, 16]", "needs 64")
    _refused(infer(region="nope"), "input 'INPUT0'",
             "Unable to find system shared memory region: 'nope'")  # fmt: skip
    _refused(infer(out_size=40), "output 'OUTPUT0'", "past the end of shared memory region 'bout'")
    _refused(infer(out_size=32), "output 'OUTPUT0' is 64 bytes", "32 bytes", "'bout'")
    # The regions are still usable: the refusals held nothing.
    assert [r["name"] for r in _status(client)] == ["bin", "bout"]
    client.infer("affine", [_inline(mod, x)])


def _inline(mod: Any, x: np.ndarray) -> Any:
    inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _status(client: Any) -> list[dict[str, Any]]:
    if isinstance(client, httpclient.InferenceServerClient):
        return client.get_system_shared_memory_status()
    regions = client.get_system_shared_memory_status().regions
    return [{"name": n} for n in sorted(regions)]


def _open_gate(gate: Path) -> bool:
    """Let a ``held`` preprocess that waits go on; False when none waits (yet)."""
    try:
        os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        return False
    return True


def _until(condition: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_unregister_while_a_request_uses_the_region(request, proto, shm_server, regions):
    _, work = shm_server
    client = request.getfixturevalue(proto)
    mod = httpclient if proto == "http" else grpcclient
    began = work / "began"
    began.unlink(missing_ok=True)
    x = np.array([[1.5, 2.0], [3.0, -4.0]], np.float32)
    in_handle, in_key = regions("held_in", 16)
    out_handle, out_key = regions("held_out", 8)
    shm.set_shared_memory_region(in_handle, [x])
    client.register_system_shared_memory("held_in", in_key, 16)
    client.register_system_shared_memory("held_out", out_key, 8)
    inp = mod.InferInput("X", [2, 2], "FP32")
    inp.set_shared_memory("held_in", 16)
    out = mod.InferRequestedOutput("Y")
    out.set_shared_memory("held_out", 8)
    answers: list[Any] = []
    caller = (httpclient.InferenceServerClient(shm_server[0].url) if proto == "http"
              else grpcclient.InferenceServerClient(shm_server[0].grpc_url))  # fmt: skip

    def run() -> None:
        try:
            answers.append(caller.infer("held", [inp], outputs=[out]))
        except Exception as exc:  # the assertion below shows it
            answers.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        _until(began.exists)  # the request is in its handler, its input not read yet
        client.unregister_system_shared_memory()
        assert _status(client) == []
        # A new region may take the name at once; the request keeps the old one.
        client.register_system_shared_memory("held_out", in_key, 16)
    finally:
        _until(lambda: _open_gate(work / "gate"))
        thread.join(30)
    assert not thread.is_alive()
    assert not isinstance(answers[0], Exception), answers[0]
    got = shm.get_contents_as_numpy(out_handle, np.float32, [2, 1])
    np.testing.assert_array_equal(got, x.sum(axis=1, keepdims=True))
    caller.close()


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_output_region_too_small(request, proto, shm_server, regions):
    """A fixed-size output is refused before its request is queued (the held model's
    handler never starts); a BYTES one, whose size only the answer tells, after."""
    _, work = shm_server
    client = request.getfixturevalue(proto)
    mod = httpclient if proto == "http" else grpcclient
    began = work / "began"
    began.unlink(missing_ok=True)
    _, key = regions("small", 64)
    client.register_system_shared_memory("small", key, 64)

    x = mod.InferInput("X", [2, 2], "FP32")
    x.set_data_from_numpy(np.ones((2, 2), np.float32))
    y = mod.InferRequestedOutput("Y")
    y.set_shared_memory("small", 4)
    _refused(lambda: client.infer("held", [x], outputs=[y]), "output 'Y' is 8 bytes",
             "shape [2, 1]", "4 bytes", "'small'")  # fmt: skip
    assert not began.exists()

    text = mod.InferInput("TEXT", [1, 2], "BYTES")
    text.set_data_from_numpy(np.array([[b"abcdef", b"ghijkl"]], dtype=object))
    rev = mod.InferRequestedOutput("REV")
    rev.set_shared_memory("small", 10, offset=4)
    _refused(lambda: client.infer("reverse", [text], outputs=[rev]), "output 'REV' is 20 bytes",
             "10 bytes", "'small'")  # fmt: skip
    assert client.get_model_metadata("reverse") is not None  # the server goes on


def test_asyncio_clients(server, regions, eager_models):
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    in_handle, in_key = regions("aio_in", x.nbytes)
    out_handle, out_key = regions("aio_out", 2 * x.nbytes)
    shm.set_shared_memory_region(in_handle, [x])

    async def run(mod: Any, client: Any, out_offset: int) -> None:
        inp = mod.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_shared_memory("aio_in", x.nbytes)
        out = mod.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("aio_out", x.nbytes, offset=out_offset)
        await client.infer("affine", [inp], outputs=[out])

    async def main() -> None:
        http = httpaio.InferenceServerClient(server.url)
        grpc = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            await http.register_system_shared_memory("aio_in", in_key, x.nbytes)
            await grpc.register_system_shared_memory("aio_out", out_key, 2 * x.nbytes)
            await asyncio.gather(run(httpaio, http, 0), run(grpcaio, grpc, x.nbytes))
            await http.unregister_system_shared_memory()
            assert await http.get_system_shared_memory_status() == []
        finally:
            await http.close()
            await grpc.close()

    asyncio.run(main())
    want = _affine(eager_models, x)
    for offset in (0, x.nbytes):
        got = shm.get_contents_as_numpy(out_handle, np.float32, [1, 16], offset=offset)
        np.testing.assert_allclose(got, want, rtol=1e-6)
