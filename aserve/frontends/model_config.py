"""A model's Triton ModelConfig as JSON, as Triton's HTTP ``/config`` answers it.

Both frontends start from :meth:`Runtime.triton_config` (a dict in the
protobuf's field names). Over gRPC it is parsed into the ``ModelConfig``
message; over HTTP it goes through the same message, so that both carry
exactly the same fields, and comes back as JSON with protobuf's field names
(``max_batch_size``, not ``maxBatchSize``), as ``tritonclient.http``'s
``get_model_config()`` and ``perf_analyzer`` read it. Protobuf's JSON mapping
writes 64-bit integers as strings; Triton's HTTP server writes them as
numbers, and so does this.

Frontends layer, pure (no I/O); both frontends call it on the loop.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from aserve._proto import model_config_pb2

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def triton_config_message(doc: dict[str, Any]) -> model_config_pb2.ModelConfig:
    """``doc`` (a runtime's ``triton_config()``) as Triton's ModelConfig message."""
    return json_format.ParseDict(doc, model_config_pb2.ModelConfig())


def triton_config_json(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as Triton's HTTP ``/v2/models/{m}/config`` answers it."""
    message = triton_config_message(doc)
    out = json_format.MessageToDict(message, preserving_proto_field_name=True)
    _numbers(message.DESCRIPTOR, out)
    # A control's kind START is its enum's 0, which protobuf's JSON leaves out;
    # Triton's JSON names it, and a reader of it looks for it.
    for control_input in out.get("sequence_batching", {}).get("control_input", []):
        for control in control_input.get("control", []):
            control.setdefault("kind", "CONTROL_SEQUENCE_START")
    return out


def _numbers(descriptor: Descriptor, doc: dict[str, Any]) -> None:
    """Turn the 64-bit integers of ``doc`` (a message of ``descriptor``) back into numbers."""
    for name, value in doc.items():
        field = descriptor.fields_by_name.get(name)
        if field is None:
            continue
        kind = field.message_type
        if kind is not None and kind.GetOptions().map_entry:
            entry = kind.fields_by_name["value"]
            for key, item in value.items():
                if entry.message_type is not None:
                    _numbers(entry.message_type, item)
                elif entry.type in _INT64_TYPES:
                    value[key] = int(item)
        elif kind is not None:
            for item in value if isinstance(value, list) else [value]:
                _numbers(kind, item)
        elif field.type in _INT64_TYPES:
            doc[name] = [int(v) for v in value] if isinstance(value, list) else int(value)
