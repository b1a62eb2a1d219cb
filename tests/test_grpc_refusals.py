"""A refused gRPC call lets go of its request at once, not when the garbage collector runs.

``context.abort()`` raises an exception that grpc.aio keeps in a reference
cycle with the handler's frame, and with it the request: a client sending
big refused requests would hold the server's memory until a collection.
"""

from __future__ import annotations

import gc
import types
from pathlib import Path

import grpc
from conftest import model_entry, spec
from inprocess import in_process

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc

CALLS = 20


def _kept_handler_frames() -> int:
    """Frames of ModelInfer calls that ended but are still referenced (from a cycle)."""
    return sum(
        1
        for o in gc.get_objects()
        # type() rather than isinstance(): isinstance asks some objects (torch's lazy
        # modules) for their __class__, which warns.
        if type(o) is types.FrameType and o.f_code.co_name == "ModelInfer"
    )


async def test_refused_model_infer_calls_do_not_pile_up_in_memory(model_dir: Path) -> None:
    entry = model_entry(
        "affine", "affine.pt", [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])]
    )
    config = {"grpc": {"host": "127.0.0.1", "port": 0}, "models": [entry]}
    # 1 MB of raw contents for a [1, 16] FP32 input: refused, as the wrong size.
    request = pb.ModelInferRequest(
        model_name="affine",
        inputs=[
            pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[1, 16])
        ],
        raw_input_contents=[bytes(1 << 20)],
    )
    gc.disable()  # what a cycle keeps stays kept
    try:
        async with in_process(config, model_dir) as srv:
            port = srv.server.grpc.addresses[0][1]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                codes = []
                for _ in range(CALLS):
                    try:
                        await stub.ModelInfer(request, timeout=30)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
                kept = _kept_handler_frames()  # each would hold its request
    finally:
        gc.enable()
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * CALLS
    assert kept == 0, f"{kept} refused calls' frames (and requests) wait for the collector"
