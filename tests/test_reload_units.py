"""Pure parts of reloads, handlers and pipelines: config checks, routing swaps, diffs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aserve.config import ConfigError, parse_config
from aserve.engines.python_handler import HandlerImportError, import_handler
from aserve.errors import NotFound
from aserve.loop.registry import ModelRegistry
from aserve.loop.reload import _dependents, _differences
from aserve.loop.runtimes.batched import ModelRuntime


def _t(name: str, datatype: str = "FP32", shape: list[int] | None = None) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape or [4]}


def _torch(name: str, inputs: list, outputs: list, **extra: Any) -> dict[str, Any]:
    return {"name": name, "engine": "torch", "path": f"{name}.pt", "inputs": inputs,
            "outputs": outputs, **extra}  # fmt: skip


TOK = {
    "name": "tok", "engine": "python", "handler": "pkg.mod:Tok",
    "inputs": [_t("TEXT", "BYTES", [1])], "outputs": [_t("IDS", "FP32", [4])],
}  # fmt: skip
ENC = _torch("enc", [_t("X")], [_t("Y")])


def _pipe(steps: list[dict[str, Any]], outputs: list | None = None) -> dict[str, Any]:
    return {"name": "pipe", "engine": "pipeline", "inputs": [_t("TEXT", "BYTES", [1])],
            "outputs": outputs or [_t("Y")], "steps": steps}  # fmt: skip


GOOD_STEPS = [{"model": "tok", "outputs": {"IDS": "X"}}, {"model": "enc"}]


def test_a_pipeline_of_a_handler_and_a_model_validates():
    cfg = parse_config({"models": [TOK, ENC, _pipe(GOOD_STEPS)]})
    assert [s.model for s in cfg.models[2].steps] == ["tok", "enc"]


@pytest.mark.parametrize(("models", "message"), [
    ([TOK, _pipe(GOOD_STEPS)], "models[1].steps[1].model: no model 'enc' in this config"),
    ([TOK, ENC, _pipe([{"model": "tok", "outputs": {"IDS": "X"}}, {"model": "enc", "version": "2"}])],
     "models[2].steps[1].model: no model 'enc' version '2'"),
    ([TOK, ENC, _pipe([{"model": "tok"}, {"model": "enc"}])],
     "models[2].steps[1].inputs: model 'enc' input 'X' needs tensor 'X', which neither the pipeline's "
     "inputs nor an earlier step provides (available: TEXT, IDS)"),
    ([TOK, ENC, _pipe([{"model": "tok", "outputs": {"IDS": "X"}}, {"model": "enc", "inputs": {"Z": "X"}}])],
     "models[2].steps[1].inputs.Z: model 'enc' has no input 'Z' (inputs: X)"),
    ([TOK, _torch("enc", [_t("X", "INT64")], [_t("Y")]), _pipe(GOOD_STEPS)],
     "models[2].steps[1].inputs: tensor 'X' is FP32 (from steps[0] (tok)), but model 'enc' input 'X' takes INT64"),
    ([TOK, ENC, _pipe(GOOD_STEPS, outputs=[_t("Q")])], "models[2].outputs[0]: no step produces tensor 'Q'"),
    ([TOK, ENC, _pipe([*GOOD_STEPS, {"model": "enc"}])],
     "models[2].steps[2].outputs: tensor 'Y' is already provided by steps[1] (enc)"),
    ([TOK, {**_pipe([{"model": "pipe"}]), "outputs": [_t("TEXT", "BYTES", [1])]}],
     "models[1].steps: pipeline 'pipe' calls itself"),
    ([{**TOK, "handler": "no colon"}], "models[0].handler: 'no colon' is not 'package.module:ClassName'"),
    ([{k: v for k, v in TOK.items() if k != "handler"}], "models[0]: handler: required with engine 'python'"),
    ([{**ENC, "handler": "a:B"}], "handler: only for engine 'python'"),
    ([{k: v for k, v in ENC.items() if k != "path"}], "path: required with engine 'torch'"),
    ([{**ENC, "parameters": {"a": 1}}], "parameters: only for engine 'python'"),
    ([{**_pipe([]), "name": "p"}], "steps: a pipeline needs at least one step"),
])  # fmt: skip
def test_config_errors_name_the_json_path(models, message):
    with pytest.raises(ConfigError) as exc:
        parse_config({"models": models})
    assert message in str(exc.value)


class _Fake:
    """Enough of a runtime for the registry."""

    def __init__(self, name: str, version: str) -> None:
        self.name, self.version = name, version
        self.label = f"{name}/{version}"


def test_registry_swaps_a_whole_table_at_once():
    reg = ModelRegistry()
    v1, v2, other = _Fake("m", "1"), _Fake("m", "2"), _Fake("o", "1")
    reg.swap(add=[v1, v2, other])  # type: ignore[list-item]
    assert reg.get("m") is v2 and reg.get("m", "1") is v1 and reg.get("m", "") is v2
    before = reg._routes
    new_v2 = _Fake("m", "2")
    left = reg.swap(add=[new_v2], remove=[other])  # type: ignore[list-item]
    assert {id(x) for x in left} == {id(v2), id(other)}
    assert reg.get("m") is new_v2 and before[("m", None)] is v2  # the old table is untouched
    with pytest.raises(NotFound, match=r"^Request for unknown model: 'o' is not found$"):
        reg.get("o")
    left = reg.swap(remove=[new_v2])  # type: ignore[list-item]
    assert reg.get("m") is v1  # the highest remaining version
    with pytest.raises(
        NotFound, match=r"^Request for unknown model: 'm' version 2 is not found \(versions: 1\)$"
    ):
        reg.get("m", "2")
    assert [rt.label for rt in reg] == ["m/1"]


def test_what_a_reload_can_apply_in_place():
    cfg = parse_config({"models": [ENC]}).models[0]
    batching = cfg.batching.model_copy(update={"max_delay_ms": 9.0, "max_queue_size": 3})
    assert ModelRuntime.reconfigurable(cfg, cfg.model_copy(update={"batching": batching}))
    bigger = cfg.batching.model_copy(update={"max_batch_size": 64})
    assert not ModelRuntime.reconfigurable(cfg, cfg.model_copy(update={"batching": bigger}))
    assert not ModelRuntime.reconfigurable(cfg, cfg.model_copy(update={"path": "other.pt"}))
    assert not ModelRuntime.reconfigurable(cfg, cfg.model_copy(update={"instances": 2}))


def test_differences_list_leaf_paths():
    old = {"http": {"host": "h", "port": 1}, "grpc": None}
    new = {"http": {"host": "h", "port": 2}, "grpc": {"port": 0}}
    assert _differences(old, new, "") == ['grpc: null -> {"port":0}', "http.port: 1 -> 2"]


def test_dependents_follow_nested_pipelines():
    inner = _pipe(GOOD_STEPS)
    outer = {**_pipe([{"model": "pipe"}], outputs=[_t("Y")]), "name": "outer"}
    cfg = parse_config({"models": [TOK, ENC, inner, outer]})
    assert _dependents(cfg.models, "enc") == {"pipe", "outer"}
    assert _dependents(cfg.models, "outer") == set()


def test_handler_import_errors_say_what_is_wrong(tmp_path: Path):
    (tmp_path / "h_mod.py").write_text(
        "class Good:\n"
        "    def load(self, c): pass\n    def preprocess(self, r): pass\n"
        "    def infer(self, b): pass\n    def postprocess(self, o, r): pass\n"
        "class Half:\n    def load(self, c): pass\n"
    )
    (tmp_path / "h_broken.py").write_text("raise RuntimeError('boom at import')\n")
    assert import_handler("h_mod:Good", tmp_path).__name__ == "Good"
    with pytest.raises(
        HandlerImportError, match=r"lacks method\(s\) preprocess, infer, postprocess"
    ):
        import_handler("h_mod:Half", tmp_path)
    with pytest.raises(HandlerImportError, match="module 'h_mod' has no class 'Nope'"):
        import_handler("h_mod:Nope", tmp_path)
    with pytest.raises(HandlerImportError, match="RuntimeError: boom at import"):
        import_handler("h_broken:X", tmp_path)
    with pytest.raises(HandlerImportError, match="cannot import module 'h_missing'"):
        import_handler("h_missing:X", tmp_path)
    import sys

    assert str(tmp_path) not in sys.path  # only for the import
