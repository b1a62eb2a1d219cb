"""Config of decoder models: the generation block, and what only one kind of engine takes."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, parse_config
from aserve.engines.checks import check_model_files

DECODER = {"name": "lm", "engine": "decoder", "path": "lm"}
TENSOR = {"name": "X", "datatype": "FP32", "shape": [4]}


def test_decoder_defaults() -> None:
    m = parse_config({"models": [DECODER]}).models[0]
    assert (m.inputs, m.outputs, m.dtype) == ([], [], "float32")
    g = m.generation
    assert (g.max_num_seqs, g.max_model_len, g.max_prefill_tokens, g.stream_buffer_chunks) == (
        32, 2048, 2048, 32,
    )  # fmt: skip


@pytest.mark.parametrize(("model", "message"), [
    ({**DECODER, "inputs": [TENSOR]}, "models[0].inputs: a decoder model's tensors are fixed"),
    ({**DECODER, "batching": {}}, "models[0].batching: not for engine 'decoder'"),
    ({**DECODER, "instances": 2}, "models[0].instances: engine 'decoder' runs on exactly one"),
    ({**DECODER, "dtype": "int8"}, "models[0].dtype"),
    ({**DECODER, "generation": {"max_num_seqs": 0}}, "models[0].generation.max_num_seqs: must be >= 1"),
    ({**DECODER, "generation": {"stream_buffer_chunks": 0}}, "generation.stream_buffer_chunks: must be >= 1"),
    ({**DECODER, "generation": {"max_tokens_default": 9, "max_tokens_cap": 8}}, "max_tokens_default (9)"),
    ({**DECODER, "generation": {"bogus": 1}}, "models[0].generation.bogus: unknown key"),
    ({"name": "t", "engine": "torch", "path": "t.pt", "outputs": [TENSOR]},
     "models[0].inputs: required with engine 'torch'"),
    ({"name": "t", "engine": "torch", "path": "t.pt", "inputs": [TENSOR], "outputs": [TENSOR],
      "generation": {}}, "models[0].generation: only for engine 'decoder'"),
])  # fmt: skip
def test_errors_name_the_json_path(model: dict, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({"models": [model]})
    assert message in str(exc.value)


def test_a_decoder_path_is_a_model_folder(tmp_path) -> None:
    config = parse_config({"models": [DECODER]})
    with pytest.raises(
        ConfigError, match=r"models\[0\].path: not a model folder \(no config.json\)"
    ):
        check_model_files(config, tmp_path)
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text("{}")
    check_model_files(config, tmp_path)
