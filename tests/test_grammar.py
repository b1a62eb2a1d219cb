"""Structured output in the decoder engine: the grammar's mask applied before
sampling (a token it leaves out is never drawn, whatever the settings), the
matcher advanced by each token, the sequence ended at the grammar's end, a
schema the engine refuses named, and a constrained sequence beside a free one
changing nothing of the free one's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import lm_models
import pytest
import torch

from aserve.config import GenerationConfig
from aserve.engines.decoder import DecoderEngine
from aserve.engines.decoder.grammar import GrammarError
from aserve.engines.decoder.sampling import make_generator, sample
from aserve.engines.decoder.sequence import Sequence
from aserve.types.generation import SamplingParams

pytestmark = pytest.mark.timeout(120)

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["a", "bb", "ccc"]},
        "n": {"type": "integer", "minimum": -9, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["kind", "n", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> DecoderEngine:
    folder = lm_models.tiny_model("gpt2", tmp_path_factory.getbasetemp() / "lms")
    return _engine(folder)


def _engine(folder: Path) -> DecoderEngine:
    gen = GenerationConfig(
        max_num_seqs=8, max_model_len=128, max_tokens_default=100, max_tokens_cap=120
    )
    e = DecoderEngine(folder, gen)
    e.load()
    e.create_instance(0)
    return e


def _seq(params: SamplingParams, grammar: object = None) -> Sequence:
    s = Sequence("r", [1, 2], params, 10, frozenset({0}))
    s.generator = make_generator(params.seed)
    s.grammar = grammar  # type: ignore[assignment]
    return s


SETTINGS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=2.0, seed=2),
    SamplingParams(temperature=0.7, top_k=1, seed=3),
    SamplingParams(temperature=1.0, top_p=0.05, seed=4),
    SamplingParams(temperature=1.0, top_k=3, top_p=0.5, seed=5, logit_bias=((7, 100.0),)),
    SamplingParams(temperature=1.5, seed=6, presence_penalty=2.0, min_tokens=5),
]


def test_a_token_the_mask_leaves_out_is_never_drawn() -> None:
    torch.manual_seed(0)
    vocab = 500
    seqs = [_seq(p, grammar=object()) for p in SETTINGS] + [_seq(SamplingParams(seed=9))]
    rows = list(range(len(SETTINGS)))  # the last row is free
    for trial in range(60):
        logits = torch.randn(len(seqs), vocab) * 4
        masks = torch.zeros(len(rows), vocab, dtype=torch.bool)
        for r in rows:
            # A few allowed tokens, the least likely ones among them: the filters
            # (top_k 1, top_p 0.05, a bias of 100 on token 7) would keep others.
            order = logits[r].argsort()
            masks[r, order[: 1 + (trial + r) % 4]] = True
        before = logits.clone()
        tokens = sample(logits, seqs, (rows, masks))
        assert torch.equal(logits, before)  # the model's own logits are left as they came
        for r in rows:
            assert masks[r, tokens[r]], (trial, r, tokens[r])


def test_constrained_output_validates_and_ends_with_stop(engine: DecoderEngine) -> None:
    schema = json.dumps(SCHEMA)
    seqs = [
        engine.new_sequence(f"r{i}", "Hello", SamplingParams(temperature=1.0, seed=i,
                                                             json_schema=schema))
        for i in range(6)
    ]  # fmt: skip
    _run(engine, seqs)
    for s in seqs:
        text = engine.tokenizer.decode(s.output_ids)
        assert s.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def _run(engine: DecoderEngine, seqs: list[Sequence]) -> None:
    engine.step(seqs, [])
    while running := [s for s in seqs if not s.finished]:
        engine.step([], running)


def test_a_free_sequence_beside_a_constrained_one_draws_what_it_draws_alone(
    engine: DecoderEngine,
) -> None:
    free = SamplingParams(temperature=1.0, seed=42, max_tokens=20, ignore_eos=True)
    alone = engine.new_sequence("a", "Hello", free)
    _run(engine, [alone])
    beside = engine.new_sequence("b", "Hello", free)
    held = engine.new_sequence("c", "Hello", SamplingParams(seed=1, json_schema=json.dumps(SCHEMA)))
    _run(engine, [beside, held])
    assert beside.output_ids == alone.output_ids
    jsonschema.validate(json.loads(engine.tokenizer.decode(held.output_ids)), SCHEMA)


def test_the_overlap_changes_no_token(engine: DecoderEngine) -> None:
    outputs = []
    for overlap in (True, False):
        engine.grammars.overlap = overlap
        seqs = [
            engine.new_sequence(
                f"r{i}", "Hi", SamplingParams(seed=i, json_schema=json.dumps(SCHEMA))
            )
            for i in range(4)
        ]
        _run(engine, seqs)
        outputs.append([s.output_ids for s in seqs])
    engine.grammars.overlap = True
    assert outputs[0] == outputs[1]


def test_min_tokens_does_not_hold_the_grammar_end_back(engine: DecoderEngine) -> None:
    schema = json.dumps({"enum": ["yes", "no"]})
    s = engine.new_sequence("r", "Hi", SamplingParams(seed=3, min_tokens=30, json_schema=schema))
    _run(engine, [s])
    assert s.finish_reason == "stop"
    assert json.loads(engine.tokenizer.decode(s.output_ids)) in ("yes", "no")


def test_max_tokens_ends_it_with_length(engine: DecoderEngine) -> None:
    params = SamplingParams(seed=3, max_tokens=2, json_schema=json.dumps(SCHEMA))
    s = engine.new_sequence("r", "Hi", params)
    _run(engine, [s])
    assert s.finish_reason == "length" and len(s.output_ids) == 2


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "pattern": "[a"}, "regex parse error"),
        ({"not": {"type": "null"}}, 'Unimplemented keys: ["not"]'),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "thing"}, "thing"),
    ],
)
def test_a_schema_the_engine_refuses_is_named(
    engine: DecoderEngine, schema: dict[str, object], message: str
) -> None:
    text = json.dumps(schema)
    with pytest.raises(GrammarError) as exc:
        engine.new_sequence("r", "Hi", SamplingParams(json_schema=text))
    assert exc.value.param == "response_format"
    assert exc.value.message.startswith("response_format: ") and message in exc.value.message
    assert not engine.grammars.is_compiled(text)


def test_a_compiled_schema_is_kept_by_its_text(engine: DecoderEngine) -> None:
    text = json.dumps({"type": "object", "properties": {"z": {"type": "integer"}}})
    assert not engine.grammars.is_compiled(text)
    engine.new_sequence("r", "Hi", SamplingParams(json_schema=text))
    assert engine.grammars.is_compiled(text)
    assert engine.grammars.compile(text) is engine.grammars.compile(text)


def test_a_sentencepiece_vocabulary_gets_its_tokens_bytes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The tiny llama's Metaspace BPE ("▁" for a space) has no '{': an enum of
    # what it can spell.
    folder = lm_models.tiny_model("llama", tmp_path_factory.getbasetemp() / "lms")
    llama = _engine(folder)
    schema = {"enum": [3, 12, "the sea"]}
    for seed in range(4):
        s = llama.new_sequence("r", "Hi", SamplingParams(seed=seed, json_schema=json.dumps(schema)))
        _run(llama, [s])
        assert s.finish_reason == "stop"
        assert json.loads(llama.tokenizer.decode(s.output_ids)) in schema["enum"]


def test_a_grammar_its_vocabulary_cannot_spell_fails_its_sequence_alone(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The tiny llama has no '{': its object's sequence fails on its own, and a
    # free sequence of the same step goes on.
    folder = lm_models.tiny_model("llama", tmp_path_factory.getbasetemp() / "lms")
    llama = _engine(folder)
    held = llama.new_sequence("held", "Hi", SamplingParams(seed=1, json_schema=json.dumps(SCHEMA)))
    free = llama.new_sequence("free", "Hi", SamplingParams(seed=1, max_tokens=5))
    outputs = llama.step([held, free], [])
    while not (held.finished or outputs[0].finished):
        outputs = llama.step([], [held, free])
    failed = outputs[0]
    assert failed.request_id == "held" and failed.finished and failed.error is not None
    assert "grammar" in failed.error and held.slot is None
    assert not free.finished or free.finish_reason == "length"
    while not free.finished:
        (out,) = llama.step([], [free])
        assert out.error is None
    assert len(free.output_ids) == 5


def test_constrained_sequences_beside_chunked_prefills_keep_their_masks(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """With chunked prefill a step samples only some of its sequences, in another
    order than it started the masks in: each constrained one still gets its own
    mask (its output validates and equals what it generates without chunking),
    while a long prompt is prefilled over several steps beside it."""
    folder = lm_models.tiny_model("gpt2", tmp_path_factory.getbasetemp() / "lms")
    schema = json.dumps(SCHEMA)
    outputs = []
    for budget in (None, 6):
        e = DecoderEngine(folder, GenerationConfig(
            max_num_seqs=8, max_model_len=128, max_tokens_default=60, max_tokens_cap=120,
            max_num_batched_tokens=budget,
        ))  # fmt: skip
        e.load()
        e.create_instance(0)
        long = e.new_sequence("long", "word " * 40, SamplingParams(seed=9, json_schema=schema))
        held = [
            e.new_sequence(f"h{i}", "Hi", SamplingParams(seed=i, json_schema=schema))
            for i in range(2)
        ]
        _run(e, [*held, long])
        for s in (*held, long):
            jsonschema.validate(json.loads(e.tokenizer.decode(s.output_ids)), SCHEMA)
        outputs.append([s.output_ids for s in (*held, long)])
        e.unload()
    assert outputs[0] == outputs[1]
