"""The .proto sources, the generated modules and what tritonclient.grpc speaks."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton_service

from aserve._proto import grpc_service_pb2, model_config_pb2

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "aserve" / "_proto"


def test_committed_modules_are_exactly_what_the_sources_generate(tmp_path):
    out = tmp_path / "_proto"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-proto"), "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    fresh = sorted(p.name for p in out.iterdir())
    committed = sorted(p.name for p in GENERATED.iterdir() if p.is_file())
    assert fresh == committed
    _, mismatch, errors = filecmp.cmpfiles(out, GENERATED, fresh, shallow=False)
    assert not mismatch and not errors, (
        f"aserve/_proto is stale ({mismatch + errors}): run .venv/bin/python scripts/gen-proto"
    )
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-proto"), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr


def _fields(message: Descriptor) -> dict[str, tuple]:
    return {
        f.name: (f.number, f.type, f.is_repeated,
                 f.message_type.full_name if f.message_type else None,
                 f.enum_type.full_name if f.enum_type else None)
        for f in message.fields
    }  # fmt: skip


def _messages(message: Descriptor):
    yield message
    for nested in message.nested_types:
        yield from _messages(nested)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(grpc_service_pb2.DESCRIPTOR, triton_service.DESCRIPTOR),
     (model_config_pb2.DESCRIPTOR, triton_config.DESCRIPTOR)],
    ids=["grpc_service", "model_config"],
)  # fmt: skip
def test_every_message_field_matches_tritonclient(ours, theirs):
    """Same full names, field numbers, types and labels as tritonclient's own stubs."""
    checked = 0
    for top in ours.message_types_by_name.values():
        for message in _messages(top):
            their_message = theirs.pool.FindMessageTypeByName(message.full_name)
            their_fields = _fields(their_message)
            for name, field in _fields(message).items():
                assert name in their_fields, f"{message.full_name}.{name} is not in tritonclient's"
                assert field == their_fields[name], f"{message.full_name}.{name}"
                checked += 1
    for enum in ours.enum_types_by_name.values():
        their_enum = theirs.pool.FindEnumTypeByName(enum.full_name)
        assert {v.name: v.number for v in enum.values} == {
            v.name: v.number for v in their_enum.values
        }
    assert checked > 20


def test_every_rpc_matches_tritonclient():
    ours = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == "inference.GRPCInferenceService"
    for method in ours.methods:
        their = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == their.input_type.full_name, method.name
        assert method.output_type.full_name == their.output_type.full_name, method.name
        assert method.client_streaming == their.client_streaming, method.name
        assert method.server_streaming == their.server_streaming, method.name
    wanted = {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
              "ModelInfer", "ModelStreamInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex"}  # fmt: skip
    assert wanted <= set(ours.methods_by_name)


def test_aserve_and_tritonclient_messages_live_side_by_side():
    # Both define inference.ModelInferRequest; ours are in a private pool.
    assert grpc_service_pb2.DESCRIPTOR.pool is not triton_service.DESCRIPTOR.pool
    ours = grpc_service_pb2.ModelInferRequest(model_name="m", id="x")
    theirs = triton_service.ModelInferRequest.FromString(ours.SerializeToString())
    assert (theirs.model_name, theirs.id) == ("m", "x")


def test_a_built_wheel_carries_the_generated_modules_and_grpc_dependencies(tmp_path):
    """What a fresh ``pip install`` gets: the modules, importable, and their runtime deps."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    shutil.copytree(ROOT / "aserve", src / "aserve", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         str(src), "-w", str(tmp_path / "dist")],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("aserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [
            line.split(":", 1)[1].strip()
            for line in zf.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    for module in (
        "__init__.py",
        "grpc_service_pb2.py",
        "grpc_service_pb2_grpc.py",
        "model_config_pb2.py",
    ):
        assert f"aserve/_proto/{module}" in names
    for dep in ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf"):
        assert any(r.split(">")[0].split("=")[0].strip() == dep for r in requires), (dep, requires)
    # A pure-Python wheel imports as a zip: the package alone, not this checkout.
    probe = subprocess.run(
        [sys.executable, "-c",
         "import aserve._proto.grpc_service_pb2_grpc as m; print(m.__file__)"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={"PYTHONPATH": str(wheel), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().startswith(str(wheel))
