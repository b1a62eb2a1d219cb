"""OpenAI's /v1/embeddings on a real server, driven by the openai SDK (sync and
async), LangChain's OpenAIEmbeddings and aiohttp: every input form and both
encodings against the embeddings the model makes, ``dimensions``, usage, the
refusals (status, ``param`` and message), the listing on /v1/models, and the
items of concurrent clients batched together by the model's batcher.

The model is tests/handlers/embedder.py: a deterministic tokenizer and an
embedding bag, small enough to compute here what it must answer."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import openai
import orjson
import pytest
from conftest import HANDLERS, ServerProcess, spec, start_server, write_config
from helpers import stats, wait_for_stats
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reload_helpers import copy_handler

from aserve.frontends.http.openai_fields import EMBEDDING_FIELDS

pytestmark = pytest.mark.timeout(90)

_spec = importlib.util.spec_from_file_location("embedder_ref", HANDLERS / "embedder.py")
assert _spec is not None and _spec.loader is not None
embedder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(embedder)
DIM = embedder.DIM
TEXTS = ["The quick brown fox", "jumps over the lazy dog", "héllo wörld, 42 times"]


def _embedding_model(name: str, input_: str, datatype: str, shape: list[int], **extra: Any) -> dict:
    outputs = [spec("EMBEDDING", "FP32", [DIM])]
    embeddings = {"input": input_, "output": "EMBEDDING", **extra.pop("embeddings", {})}
    if embeddings.get("token_count_output"):
        outputs.append(spec("TOKENS", "INT64", [1]))
    return {
        "name": name,
        "engine": "python",
        "handler": "embedder:Embedder",
        "inputs": [spec(input_, datatype, shape)],
        "outputs": outputs,
        "openai": {"embeddings": embeddings},
        **extra,
        "batching": {"max_batch_size": 8, **extra.get("batching", {})},
    }


def _script_bag(path: Path) -> None:
    """The embedder's table and pooling as a TorchScript module: token ids -> embedding."""
    import torch

    class Bag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.from_numpy(embedder._TABLE.copy()))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            v = self.table[ids % self.table.shape[0]].mean(dim=1)
            return v / torch.linalg.vector_norm(v, dim=1, keepdim=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice
        torch.jit.script(Bag()).save(str(path))


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("embeddings")
    copy_handler(folder, "embedder")
    copy_handler(folder, "text_tokenizer")
    gate = folder / "gate"
    gate.mkdir()
    text = {"dimensions": [4, 8], "token_count_output": "TOKENS", "max_inputs": 16,
            "max_input_bytes": 256}  # fmt: skip
    plain = {  # a model of tensors that does not embed
        "name": "plain",
        "engine": "python",
        "handler": "text_tokenizer:ByteTokenizer",
        "inputs": [spec("TEXT", "BYTES", [1])],
        "outputs": [spec("IDS", "FP32", [16]), spec("LENGTH", "INT64", [1]),
                    spec("UPPER", "BYTES", [1]), spec("BATCH", "INT64", [1])],
    }  # fmt: skip
    ids = {"max_input_tokens": 64}
    _script_bag(folder / "bag.pt")
    torch_bag = {  # the same embedding bag as a TorchScript file: any engine embeds
        "name": "emb-torch", "engine": "torch", "path": "bag.pt",
        "inputs": [spec("IDS", "INT64", [-1])], "outputs": [spec("EMBEDDING", "FP32", [DIM])],
        "openai": {"embeddings": {"input": "IDS", "output": "EMBEDDING", "dimensions": [8]}},
    }  # fmt: skip
    models = [
        _embedding_model("emb", "TEXT", "BYTES", [1], embeddings=text),
        _embedding_model("emb-ids", "IDS", "INT64", [-1], embeddings=ids),
        _embedding_model("emb-gated", "TEXT", "BYTES", [1], parameters={"gate": str(gate)}),
        torch_bag,
        # A queue of one: a request's items must not overflow it on their own.
        _embedding_model("emb-q1", "TEXT", "BYTES", [1], batching={"max_queue_size": 1}),
        plain,
    ]
    config = {"models": models}
    server = start_server(write_config(folder, config))
    server.gate = gate  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)


def _want(text: str) -> np.ndarray:
    return embedder.embed(embedder.tokenize(text.encode()))


def test_models_lists_the_embedding_models(client: openai.OpenAI) -> None:
    ids = sorted(m.id for m in client.models.list())
    # Not "plain": it does not embed.
    assert ids == ["emb", "emb-gated", "emb-ids", "emb-q1", "emb-torch"]
    model = client.models.retrieve("emb")
    assert (model.id, model.object, model.owned_by) == ("emb", "model", "aserve")
    assert isinstance(model.created, int) and model.created > 0
    with pytest.raises(openai.NotFoundError, match="'plain' does not exist"):
        client.models.retrieve("plain")


def test_one_string_as_floats(client: openai.OpenAI) -> None:
    out = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    assert out.object == "list" and out.model == "emb"
    [item] = out.data
    assert (item.object, item.index) == ("embedding", 0)
    assert len(item.embedding) == DIM
    np.testing.assert_allclose(item.embedding, _want(TEXTS[0]), atol=1e-6)
    tokens = len(embedder.tokenize(TEXTS[0].encode()))
    assert (out.usage.prompt_tokens, out.usage.total_tokens) == (tokens, tokens)


def test_a_list_of_strings_in_order(client: openai.OpenAI) -> None:
    # The SDK asks for base64 unless told otherwise, and decodes it.
    out = client.embeddings.create(model="emb", input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2]
    for d, text in zip(out.data, TEXTS, strict=True):
        np.testing.assert_allclose(d.embedding, _want(text), atol=1e-6)
    assert out.usage.prompt_tokens == sum(len(embedder.tokenize(t.encode())) for t in TEXTS)


def test_base64_is_the_float32_bytes_of_the_floats(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    b64 = client.embeddings.create(model="emb", input=TEXTS, encoding_format="base64")
    for f, b in zip(floats.data, b64.data, strict=True):
        assert isinstance(b.embedding, str)
        decoded = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        assert decoded.tolist() == np.asarray(f.embedding, dtype=np.float32).tolist()


def test_token_ids_single_list_and_lists(client: openai.OpenAI) -> None:
    one = client.embeddings.create(model="emb-ids", input=[5, 6, 7], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, embedder.embed([5, 6, 7]), atol=1e-6)
    assert one.usage.prompt_tokens == 3  # no token count output: the ids are counted
    lists = [[1, 2], [3], [900, 901, 902, 903]]
    many = client.embeddings.create(model="emb-ids", input=lists, encoding_format="float")
    for d, ids in zip(many.data, lists, strict=True):
        np.testing.assert_allclose(d.embedding, embedder.embed(ids), atol=1e-6)
    assert many.usage.total_tokens == 7


@pytest.mark.parametrize("size", [4, 8, DIM])
def test_dimensions_truncates_and_renormalises(client: openai.OpenAI, size: int) -> None:
    out = client.embeddings.create(
        model="emb", input=TEXTS[1], dimensions=size, encoding_format="float"
    )
    got = np.asarray(out.data[0].embedding)
    full = _want(TEXTS[1])
    want = full[:size] / np.linalg.norm(full[:size])
    assert got.shape == (size,)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert abs(np.linalg.norm(got) - 1) < 1e-5


def test_user_is_accepted(client: openai.OpenAI) -> None:
    out = client.embeddings.create(model="emb", input="x", user="someone", encoding_format="float")
    np.testing.assert_allclose(out.data[0].embedding, _want("x"), atol=1e-6)


def _refused(client: openai.OpenAI, status: int, param: str, match: str, **kw: Any) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(**kw)
    err = info.value
    assert err.status_code == status, err
    assert isinstance(err.body, dict)
    assert err.body["param"] == param, err.body
    assert match in err.body["message"], err.body
    assert err.response.headers.get("x-should-retry") == "false"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    _refused(client, 404, "model", "The model 'nope' does not exist", model="nope", input="a")


def test_a_model_that_does_not_embed_is_refused(client: openai.OpenAI) -> None:
    _refused(client, 400, "model", "model 'plain/1' does not embed", model="plain", input="a")


@pytest.mark.parametrize(
    ("model", "value", "match"),
    [("emb", [], "got an empty list"), ("emb", "", "input[0]: an empty string"),
     ("emb-ids", [[]], "input[0]: an empty list of token ids"),
     ("emb", ["a", [1]], "input[1]: a list of strings holds only strings"),
     ("emb-ids", [[1], 2], "input[1]: a list of token-id lists holds only lists")],
)  # fmt: skip
def test_empty_or_mixed_input_is_refused(
    client: openai.OpenAI, model: str, value: Any, match: str
) -> None:
    _refused(client, 400, "input", match, model=model, input=value)


def test_too_many_inputs_is_400_naming_the_limit(client: openai.OpenAI) -> None:
    _refused(client, 400, "input", "17 items, over the limit of model 'emb/1' "
             "(openai.embeddings.max_inputs 16)", model="emb", input=["a"] * 17)  # fmt: skip


def test_an_input_too_large_is_413_naming_the_limit(client: openai.OpenAI) -> None:
    _refused(client, 413, "input", "input[1]: 257 bytes, over the limit "
             "openai.embeddings.max_input_bytes 256", model="emb", input=["a", "é" * 128 + "b"])  # fmt: skip
    _refused(client, 413, "input", "input[0]: 65 token ids, over the limit "
             "openai.embeddings.max_input_tokens 64", model="emb-ids", input=[list(range(65))])  # fmt: skip


def test_bad_encoding_format(client: openai.OpenAI) -> None:
    _refused(client, 400, "encoding_format", "must be 'float' or 'base64' (got 'int8')",
             model="emb", input="a", encoding_format="int8")  # fmt: skip


def test_dimensions_not_allowed_or_out_of_range(client: openai.OpenAI) -> None:
    _refused(client, 400, "dimensions", "model 'emb-ids/1' makes embeddings of 16 values only",
             model="emb-ids", input=[1, 2], dimensions=8)  # fmt: skip
    _refused(client, 400, "dimensions", "model 'emb/1' takes dimensions 4, 8, 16",
             model="emb", input="a", dimensions=5)  # fmt: skip
    _refused(client, 400, "dimensions", "must be a positive integer", model="emb", input="a",
             dimensions=0)  # fmt: skip


def test_token_lists_to_a_text_model_and_text_to_a_token_model(client: openai.OpenAI) -> None:
    _refused(client, 400, "input", "model 'emb/1' takes text only (its input 'TEXT' is BYTES",
             model="emb", input=[[1, 2, 3]])  # fmt: skip
    _refused(client, 400, "input", "model 'emb/1' takes text only", model="emb", input=[1, 2])
    _refused(client, 400, "input", "model 'emb-ids/1' takes token ids only (its input 'IDS' is "
             "INT64) and the server has no tokenizer", model="emb-ids", input="text")  # fmt: skip
    _refused(client, 400, "input", "input[1]: token id -1 is out of range",
             model="emb-ids", input=[[1], [-1]])  # fmt: skip


async def _post(srv: ServerProcess, doc: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        url = srv.base + "/v1/embeddings"
        async with session.post(url, data=orjson.dumps(doc)) as r:
            return r.status, await r.json()


@pytest.mark.parametrize(
    ("doc", "param", "match"),
    [({"input": "a"}, "model", "model: is required"),
     ({"model": "emb", "input": "a", "priority": 1}, "priority",
      "priority: unknown field of /v1/embeddings (refused rather than ignored)"),
     ({"model": "emb", "input": "a", "user": 3}, "user", "user: a string naming the caller"),
     ({"model": "emb-ids", "input": [[1, True]]}, "input", "token ids are integers (got bool)"),
     ({"model": "emb", "input": "a", "timeout_ms": -1}, "timeout_ms", "timeout_ms")],
)  # fmt: skip
async def test_fields_refused_by_name(srv: ServerProcess, doc: Any, param: str, match: str) -> None:
    status, body = await _post(srv, doc)
    assert status == 400, body
    assert body["error"]["param"] == param and match in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"


async def test_a_large_body_is_checked_off_the_loop_the_same(srv: ServerProcess) -> None:
    # Over INLINE_PARSE_BYTES: parsed on a thread, then the model looked up again.
    texts = [f"word{i} " * 30 for i in range(16)]
    assert len(orjson.dumps(texts)) < 256 * 1024  # not yet: add a long field that is refused
    status, body = await _post(srv, {"model": "emb", "input": texts, "user": "u" * 300_000})
    assert status == 200, body
    for d, text in zip(body["data"], texts, strict=True):
        np.testing.assert_allclose(d["embedding"], _want(text), atol=1e-6)
    status, body = await _post(srv, {"model": "emb", "input": [[1]], "user": "u" * 300_000})
    assert status == 400 and "takes text only" in body["error"]["message"], body


async def test_concurrent_clients_items_batch_together(srv: ServerProcess) -> None:
    """One request holds the model's only instance (its batch waits at the gate);
    three clients' two items each queue meanwhile, and run as one batch once it opens."""
    closed = srv.gate / "closed"  # type: ignore[attr-defined]
    aclient = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
    closed.touch()
    try:
        async with aiohttp.ClientSession() as session:
            before = await stats(session, srv.base, "emb-gated")
            first = asyncio.ensure_future(
                aclient.embeddings.create(model="emb-gated", input="held")
            )
            await wait_for_stats(
                session, srv.base, "emb-gated", lambda s: s["running_batch_count"] == 1
            )
            groups = [[f"client {c} item {i}" for i in range(2)] for c in range(3)]
            rest = [
                asyncio.ensure_future(aclient.embeddings.create(model="emb-gated", input=g))
                for g in groups
            ]
            await wait_for_stats(
                session, srv.base, "emb-gated", lambda s: s["pending_request_count"] == 6
            )
            closed.unlink()
            held = await first
            answers = await asyncio.gather(*rest)
            after = await stats(session, srv.base, "emb-gated")
    finally:
        closed.unlink(missing_ok=True)
        await aclient.close()
    np.testing.assert_allclose(held.data[0].embedding, _want("held"), atol=1e-6)
    for group, answer in zip(groups, answers, strict=True):
        for d, text in zip(answer.data, group, strict=True):
            np.testing.assert_allclose(d.embedding, _want(text), atol=1e-6)
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    old = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
    assert sizes.get(6, 0) - old.get(6, 0) == 1, after["batch_stats"]  # the six queued items
    assert after["inference_count"] - before["inference_count"] == 7


def test_langchain_openai_embeddings(srv: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: the texts go as they are (the default
    # tokenizes them with tiktoken first, whose files come from the network).
    emb = langchain_openai.OpenAIEmbeddings(
        model="emb", base_url=srv.base + "/v1", api_key="x", check_embedding_ctx_length=False,
        max_retries=0,
    )  # fmt: skip
    docs = emb.embed_documents(TEXTS)
    for got, text in zip(docs, TEXTS, strict=True):
        np.testing.assert_allclose(got, _want(text), atol=1e-6)
    np.testing.assert_allclose(emb.embed_query("lazy dog"), _want("lazy dog"), atol=1e-6)
    short = langchain_openai.OpenAIEmbeddings(
        model="emb", base_url=srv.base + "/v1", api_key="x", check_embedding_ctx_length=False,
        dimensions=4, max_retries=0,
    )  # fmt: skip
    full = _want(TEXTS[0])
    np.testing.assert_allclose(
        short.embed_query(TEXTS[0]), full[:4] / np.linalg.norm(full[:4]), atol=1e-6
    )


def test_one_failing_item_fails_its_request_alone(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        client.embeddings.create(model="emb", input=["fine", "!fail here", "also fine"])
    assert "preprocess failed: ValueError: cannot embed '!fail here'" in str(info.value)
    out = client.embeddings.create(model="emb", input=["fine"], encoding_format="float")
    np.testing.assert_allclose(out.data[0].embedding, _want("fine"), atol=1e-6)


async def test_a_client_gone_withdraws_its_queued_items(srv: ServerProcess) -> None:
    """A request's items wait behind a held batch; its client goes; they leave the
    queue, uncounted as inferences, and the held request is answered."""
    closed = srv.gate / "closed"  # type: ignore[attr-defined]
    url = srv.base + "/v1/embeddings"
    closed.touch()
    try:
        async with aiohttp.ClientSession() as session, aiohttp.ClientSession() as other:
            before = await stats(session, srv.base, "emb-gated")

            async def ask(s: aiohttp.ClientSession, texts: list[str]) -> Any:
                body = orjson.dumps({"model": "emb-gated", "input": texts})
                async with s.post(url, data=body) as r:
                    return r.status, await r.json()

            held = asyncio.ensure_future(ask(session, ["held"]))
            await wait_for_stats(
                session, srv.base, "emb-gated", lambda s: s["running_batch_count"] == 1
            )
            gone = asyncio.ensure_future(ask(other, ["a", "b", "c"]))
            await wait_for_stats(
                session, srv.base, "emb-gated", lambda s: s["pending_request_count"] == 3
            )
            gone.cancel()
            await other.close()  # the connection closes: the server cancels the request
            await wait_for_stats(
                session, srv.base, "emb-gated",
                lambda s: s["pending_request_count"] == 0
                and s["cancelled"] == before["cancelled"] + 3,
            )  # fmt: skip
            closed.unlink()
            status, body = await held
            after = await wait_for_stats(
                session, srv.base, "emb-gated", lambda s: s["running_batch_count"] == 0
            )
    finally:
        closed.unlink(missing_ok=True)
    assert status == 200, body
    np.testing.assert_allclose(body["data"][0]["embedding"], _want("held"), atol=1e-6)
    assert after["inference_count"] - before["inference_count"] == 1


@pytest.mark.parametrize(
    ("change", "match"),
    [({"inputs": [spec("A", "BYTES", [1]), spec("B", "BYTES", [1])]},
      "'A' must be the model's only input (its inputs: A, B)"),
     ({"inputs": [spec("A", "FP32", [4])]}, "'A' is FP32 [4]; an embedding input is BYTES [1]"),
     ({"outputs": [spec("E", "INT64", [8])]}, "'E' is INT64 [8]; an embedding is FP16, FP32"),
     ({"outputs": [spec("E", "FP32", [-1])]}, "of one fixed dimension [D]"),
     ({"embeddings": {"output": "F"}}, "openai.embeddings.output: the model has no output 'F'"),
     ({"embeddings": {"dimensions": [4, 9]}}, "9 is more than the embedding's 8 values"),
     ({"embeddings": {"dimensions": [4, 4]}}, "each size once"),
     ({"embeddings": {"token_count_output": "E"}}, "'E' must be an INT32 or INT64 [1] output"),
     ({"engine": "decoder"}, "a decoder does not embed"),
     ({"decoupled": True}, "a decoupled model does not embed"),
     ({"sequence_batching": {}}, "a sequence-batched model keeps state per sequence")],
)  # fmt: skip
def test_the_config_checks_what_the_model_declares(change: dict[str, Any], match: str) -> None:
    from pydantic import ValidationError

    from aserve.config import ModelConfig

    entry: dict[str, Any] = {
        "name": "e", "engine": "python", "handler": "embedder:Embedder",
        "inputs": [spec("A", "BYTES", [1])], "outputs": [spec("E", "FP32", [8])],
    }  # fmt: skip
    embeddings = {"input": "A", "output": "E", **change.pop("embeddings", {})}
    entry.update(change)
    if entry["engine"] == "decoder":
        entry = {"name": "e", "engine": "decoder", "path": "x"}
    entry["openai"] = {"embeddings": embeddings}
    with pytest.raises(ValidationError, match=re.escape(match)):
        ModelConfig.model_validate(entry)
    ModelConfig.model_validate(
        {"name": "e", "engine": "python", "handler": "embedder:Embedder",
         "inputs": [spec("A", "INT32", [-1])], "outputs": [spec("E", "FP16", [8])],
         "openai": {"embeddings": {"input": "A", "output": "E", "dimensions": [2]}}}
    )  # fmt: skip


def test_a_torch_model_embeds_token_ids(client: openai.OpenAI) -> None:
    lists = [[1, 2, 3], [4, 5, 6], [7, 8]]  # two of one length batch; the third alone
    out = client.embeddings.create(model="emb-torch", input=lists, encoding_format="float")
    for d, ids in zip(out.data, lists, strict=True):
        np.testing.assert_allclose(d.embedding, embedder.embed(ids), atol=1e-6)
    short = client.embeddings.create(model="emb-torch", input=[9, 10], dimensions=8)
    full = embedder.embed([9, 10])
    np.testing.assert_allclose(
        short.data[0].embedding, full[:8] / np.linalg.norm(full[:8]), atol=1e-6
    )
    _refused(client, 400, "input", "model 'emb-torch/1' takes token ids only", model="emb-torch",
             input="text")  # fmt: skip


def test_a_request_never_fills_the_queue_with_its_own_items(client: openai.OpenAI) -> None:
    texts = [f"item {i}" for i in range(12)]
    out = client.embeddings.create(model="emb-q1", input=texts, encoding_format="float")
    for d, text in zip(out.data, texts, strict=True):
        np.testing.assert_allclose(d.embedding, _want(text), atol=1e-6)


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text("ab é\u4e00 ", max_size=12),
)  # fmt: skip
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=5), max_leaves=30)
_TEXT = st.text("ab é\u4e00 ", min_size=1, max_size=12)
_IDS = st.lists(st.integers(0, 996), min_size=1, max_size=8)
_INPUTS = st.one_of(
    _TEXT, st.lists(_TEXT, min_size=1, max_size=5), _IDS, st.lists(_IDS, min_size=1, max_size=4),
    _JSON,
)  # fmt: skip
_BODIES = st.fixed_dictionaries(
    {
        "model": st.one_of(st.sampled_from(["emb", "emb-ids", "emb-torch"]),
                           st.sampled_from(["plain", "nope", "", 3])),
        "input": _INPUTS,
    },
    optional={
        "encoding_format": st.sampled_from(["float", "base64", "bf16", 1, None]),
        "dimensions": st.one_of(st.sampled_from([4, 8, DIM, 5, 0, -1]), _SCALARS),
        "user": st.one_of(_TEXT, _SCALARS),
        "timeout_ms": st.one_of(st.integers(1000, 60_000), _SCALARS),
    },
).flatmap(lambda body: st.sampled_from([body, {**body, "n": 1}]))  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(body=_BODIES)
def test_any_body_is_answered_or_refused_by_name(srv: ServerProcess, body: dict) -> None:
    """Whatever JSON a client sends: 200 with one embedding per item, or a refusal
    in OpenAI's shape (400, 404, 413) naming a field; never a 500."""
    with httpx.Client(timeout=30) as http:
        r = http.post(srv.base + "/v1/embeddings", content=orjson.dumps(body))
    doc = r.json()
    if r.status_code == 200:
        value = body["input"]
        count = 1 if isinstance(value, str) or isinstance(value[0], int) else len(value)
        assert len(doc["data"]) == count, (body, doc)
        assert [d["index"] for d in doc["data"]] == list(range(count))
        return
    assert r.status_code in (400, 404, 413), (body, r.status_code, doc)
    err = doc["error"]
    assert isinstance(err["message"], str) and err["message"], doc
    assert err["param"] in (*EMBEDDING_FIELDS, "n"), (body, doc)
