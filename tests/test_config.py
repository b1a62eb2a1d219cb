"""Config validation messages name the JSON path."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, parse_config

MODEL = {
    "name": "m", "engine": "torch", "path": "m.pt",
    "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}],
    "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1]}],
}  # fmt: skip


def test_defaults_fill_in():
    cfg = parse_config({"models": [MODEL]})
    m = cfg.models[0]
    assert (m.version, m.device, m.instances, m.cpu_threads) == ("1", "cpu", 1, 1)
    assert m.batching.max_batch_size == 32 and m.batching.timeout_ms == 5000
    assert cfg.http.port == 8000 and cfg.limits.max_request_bytes == 64 * 1024 * 1024


def test_config_is_frozen():
    cfg = parse_config({"models": [MODEL]})
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        cfg.models[0].instances = 3  # type: ignore[misc]


@pytest.mark.parametrize(("change", "message"), [
    ({"inputs": [{"name": "X", "datatype": "FP33", "shape": [4]}]}, "models[0].inputs[0].datatype"),
    ({"inputs": [{"name": "X", "datatype": "FP32", "shape": [0]}]}, "models[0].inputs[0].shape"),
    ({"inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}] * 2}, "duplicate tensor name(s) X"),
    ({"instances": 0}, "models[0].instances: must be >= 1"),
    ({"device": "cuda:x"}, "models[0].device"),
    ({"version": "v1"}, "models[0].version"),
    ({"name": "bad/name"}, "models[0].name"),
    ({"batching": {"timeout_ms": 0}}, "models[0].batching.timeout_ms: must be > 0"),
])  # fmt: skip
def test_errors_name_the_json_path(change, message):
    with pytest.raises(ConfigError) as exc:
        parse_config({"models": [{**MODEL, **change}]})
    assert message in str(exc.value)


def test_top_level_must_be_an_object():
    with pytest.raises(ConfigError, match="JSON object"):
        parse_config([1, 2])


@pytest.mark.timeout(10)
def test_prompt_bytes_limit_is_computed_at_validation_and_follows_copies():
    from aserve.config import PROMPT_BYTES_PER_TOKEN, GenerationConfig

    gen = GenerationConfig(max_model_len=100)
    # A value on the instance, not a property run by every generation request.
    assert gen.__dict__["prompt_bytes_limit"] == PROMPT_BYTES_PER_TOKEN * 100
    assert gen.model_copy(update={"max_model_len": 10}).prompt_bytes_limit == (
        PROMPT_BYTES_PER_TOKEN * 10
    )
    assert gen.model_copy(update={"max_prompt_bytes": 7}).prompt_bytes_limit == 7
    assert gen == GenerationConfig(max_model_len=100)
    assert "prompt_bytes_limit" not in gen.model_dump()
