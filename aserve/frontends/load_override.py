"""A repository load, with a config override or without (frontends layer; on the loop).

``tritonclient``'s ``load_model(m, config=json_text)`` sends the override as a
string: ``{"parameters": {"config": "..."}}`` over HTTP, the ``config``
parameter's ``string_param`` over gRPC. Both frontends hand it to
:func:`repository_load`, which reads it in one of two forms and gives the
reloader an aserve model entry (:meth:`aserve.loop.reload.Reloader.load_model`
checks it as a reload checks a config, and applies it or changes nothing):

- aserve's own: the keys of a config's ``models[]`` entry, the whole entry
  (``engine`` and the rest, as the file would say it). ``name`` may be left
  out; ``version`` too (the model's highest version in the config).
- Triton's ``ModelConfig`` (what ``get_model_config`` shows), applied over the
  entry in force: the keys in :data:`TRITON_TAKEN` are mapped to aserve's; every
  other key must be as the model's config shows it now (so that what
  ``get_model_config`` gave, edited, can be sent back), else it is refused,
  naming the key: a setting that would be dropped silently is worse than an
  error.

Every refusal is an :class:`InvalidArgument` whose message begins
``failed to load: ``, as the reloader's do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

import orjson
from google.protobuf import json_format

from aserve.config import ModelConfig
from aserve.errors import InvalidArgument, NotFound
from aserve.frontends.model_config import triton_config_json

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext

# The keys of Triton's ModelConfig an override may change, and what they set.
TRITON_TAKEN: Final = {
    "max_batch_size": "batching.max_batch_size",
    "dynamic_batching.max_queue_delay_microseconds": "batching.max_delay_ms (divided by 1000)",
    "dynamic_batching.preferred_batch_size": "batching.preferred_batch_sizes",
    "instance_group[0].count": "instances (one group)",
}
# aserve's entry keys that Triton's ModelConfig does not have: any of them makes
# an override aserve's form. (Both have "sequence_batching", in shapes of their own:
# an aserve entry says "engine" too.)
_ASERVE_KEYS: Final = frozenset(ModelConfig.model_fields) - {
    "name",
    "parameters",
    "sequence_batching",
}
_TAKEN_TEXT: Final = ", ".join(TRITON_TAKEN)


def _refused(name: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"failed to load: the config override of model '{name}' {why}")


async def repository_load(ctx: FrontendContext, name: str, config: str | None) -> None:
    """Load ``name`` (``POST .../load``, ``RepositoryModelLoad``), with the override
    ``config`` (JSON text) when one is given."""
    if config is None:
        await ctx.reloader.load_model(name)
        return
    doc = _json_object(config, name)
    given = doc.get("name", name)
    if given != name:
        raise _refused(name, f"names model {given!r}; leave 'name' out or give '{name}'")
    if _ASERVE_KEYS & doc.keys():
        entry = {**doc, "name": name}
        if "version" not in entry:
            entry["version"] = ctx.reloader.entry_of(name).version
    else:
        current = ctx.reloader.entry_of(name)
        try:
            runtime = ctx.registry.get(name, current.version)
        except NotFound:
            runtime = None  # unloaded: only the keys aserve takes can be given
        shown = triton_config_json(runtime.triton_config()) if runtime is not None else None
        entry = triton_entry(doc, name, current, shown)
    await ctx.reloader.load_model(name, override=entry)


def refuse_override_files(params: Iterable[str]) -> None:
    """Refuse ``file:`` parameters (a model folder sent with the load): aserve
    loads a model from the files its entry names."""
    files = sorted(k for k in params if k.startswith("file:"))
    if files:
        raise InvalidArgument(
            f"load parameter(s) {', '.join(files)} are not supported: aserve loads a model "
            "from the files its config entry names (a config override may name others)"
        )


def _json_object(text: str, name: str) -> dict[str, Any]:
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise _refused(name, f"is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _refused(name, f"must be a JSON object, got {type(doc).__name__}")
    return doc


def triton_entry(
    doc: dict[str, Any], name: str, current: ModelConfig, shown: dict[str, Any] | None
) -> dict[str, Any]:
    """aserve's entry for an override in Triton's form: ``current`` (the entry in
    force) with the keys of :data:`TRITON_TAKEN` applied; every other key must be
    as ``shown`` (the model's config as ``get_model_config`` shows it now; None
    when it is not loaded) has it."""
    try:
        # Through Triton's message, as get_model_config's answer came: unknown keys
        # are refused there, and 64-bit numbers sent as strings (gRPC's JSON) compare.
        given = triton_config_json(doc)
    except json_format.ParseError as exc:
        raise _refused(
            name,
            f"is neither an aserve model entry (it has no 'engine') nor Triton's "
            f"ModelConfig as aserve reads it: {str(exc).splitlines()[0]}",
        ) from None
    loaded = shown is not None
    shown = shown or {}
    # The keys the entry set, as a config file would say them (some keys are only
    # for some engines: their defaults must not be written out).
    entry = current.model_dump(mode="json", exclude_unset=True)
    batching = dict(entry.get("batching", {}))
    # The keys as sent (protobuf's JSON leaves out a value that is its default, 0
    # say), their values as read.
    for key in doc:
        value = given.get(key)
        if key == "name":
            continue
        if key == "max_batch_size":
            batching["max_batch_size"] = value or 0
        elif key == "dynamic_batching":
            value = value or {}
            for sub in doc[key] or {}:
                item = value.get(sub)
                if sub == "max_queue_delay_microseconds":
                    batching["max_delay_ms"] = (item or 0) / 1000
                elif sub == "preferred_batch_size":
                    batching["preferred_batch_sizes"] = item or []
                elif item != shown.get(key, {}).get(sub):
                    raise _not_taken(name, f"{key}.{sub}", loaded)
        elif key == "instance_group" and value != shown.get(key):
            now = shown.get(key) or [{}]
            if not value or len(value) != 1 or len(now) != 1:
                raise _not_taken(name, key, loaded)
            if _but_count(value[0]) != _but_count(now[0]):
                raise _not_taken(name, key, loaded)
            entry["instances"] = value[0].get("count", 0)
        elif key != "instance_group" and value != shown.get(key):
            raise _not_taken(name, key, loaded)
    entry["batching"] = batching
    return entry


def _but_count(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "count"}


def _not_taken(name: str, key: str, loaded: bool) -> InvalidArgument:
    what = "differs from the model's config" if loaded else "is given while the model is not loaded"
    return _refused(
        name,
        f"sets Triton's '{key}', which {what} and which an override cannot change: aserve "
        f"takes {_TAKEN_TEXT} from Triton's form; to change anything else, give an aserve "
        "model entry (the keys of a config's models[] entry, 'engine' among them)",
    )
