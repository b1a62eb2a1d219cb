"""The decoder engine driven the way a continuous batcher drives it."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import lm_models
import pytest
import torch

from aserve.engines.decoder import (
    CacheFull,
    DecoderEngine,
    GenerationConfig,
    Sequence,
    SequenceTooLong,
)
from aserve.errors import InvalidArgument
from aserve.types.generation import SamplingParams, StepOutput

GREEDY = SamplingParams(temperature=0)
TEXTS = [
    "The quick brown fox",
    "Hello",
    "A server streams tokens to many clients, one step at a time",
    "seven silver",
    "When a client goes away, its sequence leaves",
    "Yes",
]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lm_models.tiny_model(request.param, tmp_path_factory.getbasetemp() / "lms")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lm_models.tiny_model("llama", tmp_path_factory.getbasetemp() / "lms")


def make_engine(folder: Path, **generation: int) -> DecoderEngine:
    engine = DecoderEngine(
        folder, GenerationConfig(**{"max_num_seqs": 4, "max_model_len": 64, **generation})
    )
    engine.load()
    engine.create_instance(0)
    return engine


def drive(
    engine: DecoderEngine,
    arrivals: list[tuple[int, Sequence]],
    cancel_at: dict[str, int] | None = None,
    running: list[Sequence] | None = None,
) -> dict[str, list[StepOutput]]:
    """A minimal continuous batcher: admit arrived sequences while slots are free,
    drop cancelled ones between steps, step until everything has finished
    (``running``: sequences already started)."""
    pending, running = list(arrivals), list(running or [])
    outputs: dict[str, list[StepOutput]] = defaultdict(list)
    cancel_at = cancel_at or {}
    for step in range(500):
        if not pending and not running:
            return outputs
        for seq in [s for s in running if cancel_at.get(s.request_id) == step]:
            engine.free(seq)
            running.remove(seq)
        new = []
        for arrival in [a for a in pending if a[0] <= step]:
            if engine.num_free_slots > len(new):
                new.append(arrival[1])
                pending.remove(arrival)
        for out in engine.step(new, running):
            outputs[out.request_id].append(out)
        running = [s for s in new + running if not s.finished]
    raise AssertionError("generation did not finish")


def joined(outputs: list[StepOutput]) -> str:
    return "".join(o.text for o in outputs)


def test_greedy_equals_transformers_with_sequences_joining_and_leaving(lm_dir: Path) -> None:
    engine = make_engine(lm_dir)
    ref = lm_models.load_reference(lm_dir)
    budgets = [12, 5, 20, 8, 15, 10]
    seqs = [
        engine.new_sequence(f"r{i}", text, SamplingParams(temperature=0, max_tokens=n))
        for i, (text, n) in enumerate(zip(TEXTS, budgets, strict=True))
    ]
    # Two start together, others join mid-way; with 4 slots the last ones
    # wait for a slot, and r3 is cancelled after a few tokens.
    arrivals = list(zip([0, 0, 2, 3, 3, 6], seqs, strict=True))
    outputs = drive(engine, arrivals, cancel_at={"r3": 6})
    for seq in seqs:
        want = lm_models.greedy_reference(ref, seq.prompt_ids, seq.max_tokens)
        if seq.request_id == "r3":
            assert seq.finish_reason is None and 0 < len(seq.output_ids) < len(want)
            want = want[: len(seq.output_ids)]
        assert seq.output_ids == want, seq.request_id
        assert [o.token_id for o in outputs[seq.request_id]] == seq.output_ids
    assert len({t for s in seqs for t in s.output_ids}) > 10  # a model that says varied things
    assert engine.num_free_slots == 4


def test_streamed_text_equals_the_decoded_tokens(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    seqs = [
        engine.new_sequence(f"r{i}", t, SamplingParams(temperature=0, max_tokens=15))
        for i, t in enumerate(TEXTS[:3])
    ]
    outputs = drive(engine, [(0, s) for s in seqs])
    for seq in seqs:
        text = joined(outputs[seq.request_id])
        assert text.strip() == engine.tokenizer.decode(seq.output_ids).strip()
        assert len(text) > 10


def test_max_tokens_finishes_with_length(lm_dir: Path) -> None:
    engine = make_engine(lm_dir)
    seq = engine.new_sequence("r", TEXTS[0], SamplingParams(max_tokens=7, ignore_eos=True, seed=1))
    outputs = drive(engine, [(0, seq)])["r"]
    assert [o.finished for o in outputs] == [False] * 6 + [True]
    last = outputs[-1]
    assert (last.finish_reason, last.completion_tokens, last.prompt_tokens) == (
        "length",
        7,
        len(seq.prompt_ids),
    )
    assert seq.slot is None and engine.num_free_slots == 4


def test_default_max_tokens_and_cap(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_tokens_default=3, max_tokens_cap=10)
    assert engine.new_sequence("a", "Hello", GREEDY).max_tokens == 3
    with pytest.raises(InvalidArgument, match=r"max_tokens: 11 is over this model's limit \(10\)"):
        engine.new_sequence("b", "Hello", SamplingParams(max_tokens=11))


def test_max_model_len_shortens_generation_and_refuses_long_prompts(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_model_len=16)
    prompt = engine.tokenizer.encode(TEXTS[2])[:10]
    seq = engine.new_sequence(
        "r", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )
    assert seq.max_tokens == 6
    drive(engine, [(0, seq)])
    assert seq.finish_reason == "length" and seq.num_tokens == 16
    with pytest.raises(
        SequenceTooLong, match=r"16 tokens leave no room to generate within max_model_len \(16\)"
    ):
        engine.new_sequence("long", list(range(1, 17)), GREEDY)
    with pytest.raises(InvalidArgument, match="token id 9999 is out of range"):
        engine.new_sequence("bad", [1, 9999], GREEDY)
    with pytest.raises(InvalidArgument, match="prompt: is empty"):
        engine.new_sequence("empty", [], GREEDY)


def test_eos_finishes_with_stop(llama_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(llama_dir)
    free_run = engine.new_sequence(
        "free", TEXTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    free_out = drive(engine, [(0, free_run)])["free"]
    ids = free_run.output_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    # Declare that token an end-of-sequence token of the model, as a chat model's end-of-turn token is.
    folder = shutil.copytree(llama_dir, tmp_path / "m")
    eos = engine.tokenizer.inner.token_to_id("</s>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, ids[k]]}))
    engine = make_engine(folder)
    seq = engine.new_sequence("r", TEXTS[0], SamplingParams(temperature=0, max_tokens=12))
    out = drive(engine, [(0, seq)])["r"]
    assert seq.output_ids == ids[: k + 1]  # the end token is generated (and counted) ...
    assert out[-1].finish_reason == "stop" and seq.stop_reason == ids[k]
    assert joined(out) == joined(free_out[:k])  # ... but adds no text
    assert out[-1].completion_tokens == k + 1


def test_stop_string_ends_generation_and_is_not_emitted(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    free_run = engine.new_sequence(
        "free", TEXTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    pieces = [o.text for o in drive(engine, [(0, free_run)])["free"]]
    full = "".join(pieces)
    # A stop string that straddles two pieces.
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
    stop = pieces[k][-2:] + pieces[k + 1][:1]
    seq = engine.new_sequence(
        "r", TEXTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=(stop,))
    )
    out = drive(engine, [(0, seq)])["r"]
    assert joined(out) == full[: full.index(stop)]
    assert (out[-1].finish_reason, seq.stop_reason) == ("stop", stop)
    assert seq.output_ids == free_run.output_ids[: len(seq.output_ids)]
    assert len(seq.output_ids) < 20


def test_text_held_for_a_possible_stop_is_released(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    free_run = engine.new_sequence(
        "free", TEXTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    pieces = [o.text for o in drive(engine, [(0, free_run)])["free"]]
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
    never = pieces[k][-2:] + "\x00"  # starts like the text but can never match
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=(never,))
    seq = engine.new_sequence("r", TEXTS[1], params)
    out = [o.text for o in drive(engine, [(0, seq)])["r"]]
    assert "".join(out) == "".join(pieces)
    assert out[k] == pieces[k][:-2]  # held back while it could still become the stop string
    assert out[k + 1].startswith(pieces[k][-2:])  # and released once it could not
    assert seq.finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_batch(lm_dir: Path) -> None:
    engine = make_engine(lm_dir)
    params = SamplingParams(
        temperature=1.0, top_k=50, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True
    )
    alone = engine.new_sequence("x", TEXTS[0], params)
    drive(engine, [(0, alone)])

    crowd = [
        engine.new_sequence("a", TEXTS[2], SamplingParams(seed=1, max_tokens=20)),
        engine.new_sequence("b", TEXTS[3], GREEDY),
        engine.new_sequence("c", TEXTS[4], SamplingParams(temperature=0.7, max_tokens=4)),
    ]
    again = engine.new_sequence("x", TEXTS[0], params)
    drive(engine, [(0, crowd[0]), (0, crowd[1]), (1, again), (3, crowd[2])])
    assert again.slot is None and again.output_ids == alone.output_ids

    other_seed = engine.new_sequence(
        "y", TEXTS[0], SamplingParams(**{**params.__dict__, "seed": 12})
    )
    drive(engine, [(0, other_seed)])
    assert other_seed.output_ids != alone.output_ids


def test_cache_full_and_cancellation_free_slots(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_num_seqs=2)
    a, b, c = (
        engine.new_sequence(n, TEXTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
        for n in "abc"
    )
    with pytest.raises(CacheFull, match="3 new sequence"):
        engine.step([a, b, c])
    assert engine.num_free_slots == 2 and a.slot is None  # nothing was allocated
    engine.step([a, b])
    with pytest.raises(CacheFull):
        engine.step([c], [a, b])
    engine.free(a)  # the client went away
    engine.free(a)  # freeing twice is harmless
    outs = engine.step([c], [b])
    assert [o.request_id for o in outs] == ["c", "b"]
    assert c.slot is not None and engine.num_free_slots == 0


def test_step_refuses_sequences_in_the_wrong_state(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    seq = engine.new_sequence("r", TEXTS[0], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="'r' is not running"):
        engine.step([], [seq])
    [out] = engine.step([seq])
    assert out.finished and out.finish_reason == "length"
    with pytest.raises(ValueError, match="'r' has already started"):
        engine.step([seq])
    with pytest.raises(ValueError, match="'r' is not running"):
        engine.step([], [seq])
    assert engine.step() == []


def test_chat_prompt_round_trip(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hello world"}])
    ids = tok.encode(text, add_special_tokens=False)
    assert (
        ids[0] == tok.inner.token_to_id("<s>") and ids.count(ids[0]) == 1
    )  # the template's BOS only
    seq = engine.new_sequence("chat", ids, SamplingParams(temperature=0, max_tokens=3))
    assert len(drive(engine, [(0, seq)])["chat"]) == seq.completion_tokens <= 3


def test_unloaded_engine_says_so(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    engine.unload()
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.new_sequence("r", "x", GREEDY)


def test_a_member_that_breaks_the_step_fails_alone(llama_dir: Path) -> None:
    """One sequence whose inputs break the batched forward (a token id past the
    vocabulary, which only validation would have caught) fails on its own; the
    new and the running ones beside it get the tokens they would get alone."""
    engine = make_engine(llama_dir)
    want = {t: engine.new_sequence(t, t, GREEDY) for t in TEXTS[:3]}
    for seq in want.values():  # each alone, for the reference tokens
        engine.step([seq])
        engine.step([], [seq])
        engine.free(seq)
    running = engine.new_sequence("running", TEXTS[0], GREEDY)
    engine.step([running])
    fresh = engine.new_sequence("fresh", TEXTS[1], GREEDY)
    vocab = engine.spec.vocab_size
    bad = engine.build_sequence("bad", [1, vocab + 5], GREEDY, 4, ())
    outs = engine.step([fresh, bad], [running])
    assert [o.request_id for o in outs] == ["fresh", "bad", "running"]
    assert outs[1].error is not None and outs[1].finished and outs[1].finish_reason is None
    assert bad.slot is None  # its slot is free again
    assert (outs[0].error, outs[2].error) == (None, None)
    assert outs[0].token_id == want[TEXTS[1]].output_ids[0]
    assert outs[2].token_id == want[TEXTS[0]].output_ids[1]
    assert engine.num_free_slots == 4 - 2  # fresh and running hold theirs


def test_a_top_k_past_the_vocabulary_does_not_overflow_the_step(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    huge = SamplingParams(temperature=1.0, top_k=2**63 - 1, seed=3)
    seqs = [engine.new_sequence("k", TEXTS[0], huge), engine.new_sequence("g", TEXTS[1], GREEDY)]
    outs = engine.step(seqs)
    assert [o.error for o in outs] == [None, None]
    with pytest.raises(InvalidArgument, match="top_k"):
        SamplingParams(top_k=2**63)


def test_equal_prompts_of_one_step_are_prefilled_once(lm_dir: Path) -> None:
    """The choices of a request with n > 1 (equal prompts admitted together) share
    one prefill, its KV copied to each one's slot: each generates exactly what it
    would alone, and the model ran the prompt once."""
    engine = make_engine(lm_dir)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True) for s in (1, 2, 3)
    ]
    alone = []
    for i, p in enumerate(params):
        seq = engine.new_sequence(f"alone{i}", TEXTS[2], p)
        drive(engine, [(0, seq)])
        alone.append(seq.output_ids)
    prefill = engine.model.prefill
    rows: list[int] = []

    def counted(cache, slots, prompts, starts):  # a spy on the real prefill: how many ran
        rows.append(len(prompts))
        return prefill(cache, slots, prompts, starts)

    engine.model.prefill = counted  # type: ignore[method-assign]
    together = [engine.new_sequence(f"n{i}", TEXTS[2], p) for i, p in enumerate(params)]
    other = engine.new_sequence("other", TEXTS[0], GREEDY)
    drive(engine, [(0, s) for s in [*together, other]])
    assert rows == [2]  # one step: the shared prompt once, the other prompt once
    assert [s.output_ids for s in together] == alone
    assert len({tuple(a) for a in alone}) == 3  # the seeds really differ


# --- prefix caching --------------------------------------------------------------

LONG = (
    "A server streams tokens to many clients, one step at a time; when a client "
    "goes away its sequence leaves, and the next one takes its slot in the cache"
)


@torch.inference_mode()
def reference(ref: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens past any EOS (the whole prompt run per token)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def greedy(
    engine: DecoderEngine, ref: torch.nn.Module, prompts: list[list[int]], n: int = 8
) -> list[Sequence]:
    """Run ``prompts`` together in one step (then decode them to the end) and check
    each against transformers' greedy generation."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    seqs = [engine.new_sequence(f"g{i}", p, params) for i, p in enumerate(prompts)]
    drive(engine, [(0, s) for s in seqs])
    for seq in seqs:
        assert seq.output_ids == reference(ref, seq.prompt_ids, n)
    return seqs


def test_prefix_cached_prefill_equals_transformers(lm_dir: Path) -> None:
    """A prompt sharing a prefix with what a freed slot holds prefills only the
    rest, at every alignment against the blocks (4 tokens here): shorter or
    longer than the cached prompt, ending on a block boundary or one past it,
    equal to it (one token is still prefilled), continuing its generated
    tokens (the next turn of a chat), and next to uncached prompts of other
    lengths in the same step (ragged starts)."""
    engine = make_engine(lm_dir, prefix_block_tokens=4)
    ref = lm_models.load_reference(lm_dir)
    base = engine.tokenizer.encode(LONG)[:30]
    assert len(base) == 30
    (first,) = greedy(engine, ref, [base])
    assert first.cached_tokens == 0
    others = ["The quick brown fox", "Hello", "seven silver", "Yes", "Blue", "When it rains"]
    for k, text in zip((8, 9, 11, 13, 29, 30), others, strict=True):
        prompt = base if k == 30 else base[:k] + engine.tokenizer.encode(" and then")
        seq, plain = greedy(engine, ref, [prompt, engine.tokenizer.encode(text)])
        assert seq.cached_tokens == min(k // 4, (len(prompt) - 1) // 4) * 4, k
        assert plain.cached_tokens == 0
    # The next turn: the whole last sequence (prompt and output) then more.
    turn = greedy(engine, ref, [base])[0]
    follow = base + turn.output_ids + engine.tokenizer.encode(" Yes")
    (nxt,) = greedy(engine, ref, [follow])
    assert nxt.cached_tokens == (len(base) + len(turn.output_ids) - 1) // 4 * 4
    assert nxt.cached_tokens > len(base)


def test_a_running_sequence_shares_its_prefix(lm_dir: Path) -> None:
    """A prompt whose prefix a running sequence holds gets a copy of it (the
    slot stays the running one's): both generate what they would alone."""
    engine = make_engine(lm_dir, prefix_block_tokens=4)
    ref = lm_models.load_reference(lm_dir)
    base = engine.tokenizer.encode(LONG)[:24]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = engine.new_sequence("a", base, params)
    b = engine.new_sequence("b", base[:20] + engine.tokenizer.encode(" Hello there"), params)
    drive(engine, [(0, a), (2, b)])
    assert b.cached_tokens == 20 and a.cached_tokens == 0
    for seq in (a, b):
        assert seq.output_ids == reference(ref, seq.prompt_ids, 12)


def test_prefix_cache_evicts_the_least_recently_used_slot(llama_dir: Path) -> None:
    """With two slots, a third prompt takes the slot freed longest ago: the
    prefix held by the other slot stays cached, the evicted one is gone."""
    engine = make_engine(llama_dir, max_num_seqs=2, prefix_block_tokens=4)
    words = ["apple", "river", "stone"]
    prompts = [engine.tokenizer.encode(f"{w} " * 12) for w in words]

    def cached(prompt: list[int]) -> int:
        seq = engine.new_sequence("s", prompt, SamplingParams(temperature=0, max_tokens=2))
        drive(engine, [(0, seq)])
        return seq.cached_tokens

    assert [cached(p) for p in prompts] == [0, 0, 0]  # apple, river, then stone evicts apple
    assert cached(prompts[1]) > 0  # river is still there
    assert cached(prompts[0]) == 0  # apple was evicted (and now evicts stone, the LRU)
    assert cached(prompts[2]) == 0
    assert cached(prompts[0]) > 0


def test_prefix_caching_can_be_turned_off(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, prefix_caching=False)
    ref = lm_models.load_reference(llama_dir)
    base = engine.tokenizer.encode(LONG)[:30]
    for _ in range(2):
        (seq,) = greedy(engine, ref, [base])
        assert seq.cached_tokens == 0


def test_a_failed_step_forgets_what_its_slots_held(llama_dir: Path) -> None:
    """A prefill that raised leaves its slots' contents unknown: the next
    sequence of that prompt is prefilled whole, and generates what it should
    (one slot: the failed sequence took the slot that held its prefix)."""
    engine = make_engine(llama_dir, max_num_seqs=1, prefix_block_tokens=4)
    ref = lm_models.load_reference(llama_dir)
    base = engine.tokenizer.encode(LONG)[:30]
    greedy(engine, ref, [base])
    prefill = engine.model.prefill

    def broken(*args: object) -> object:
        raise RuntimeError("the device went away")

    engine.model.prefill = broken  # type: ignore[method-assign]
    seq = engine.new_sequence("x", base, GREEDY)
    with pytest.raises(RuntimeError):
        engine.step([seq])
    engine.model.prefill = prefill  # type: ignore[method-assign]
    (again,) = greedy(engine, ref, [base])
    assert again.cached_tokens == 0


# --- chunked prefill ------------------------------------------------------------


def test_chunked_prefill_equals_transformers_and_decodes_go_on(lm_dir: Path) -> None:
    """With at most 7 tokens a step, long prompts are prefilled in chunks
    (ending on and off the prefix cache's blocks of 4) while the running
    sequences get a token every step; everyone generates exactly what
    transformers does, a prompt cached in part included."""
    engine = make_engine(lm_dir, max_num_batched_tokens=7, prefix_block_tokens=4)
    ref = lm_models.load_reference(lm_dir)
    base = engine.tokenizer.encode(LONG)[:30]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    short = engine.new_sequence("short", engine.tokenizer.encode("Hello"), params)
    engine.step([short])  # one token of prompt (and a token out): under the budget
    assert not short.prefilling and len(short.output_ids) == 1
    long_a = engine.new_sequence("a", base, params)
    long_b = engine.new_sequence("b", base[:17] + engine.tokenizer.encode(" Yes"), params)
    running, steps = [short], 0
    new = [long_a, long_b]
    while long_a.prefilling or long_b.prefilling or new:
        outs = engine.step(new, running)
        steps += 1
        running = [s for s in new + running if not s.finished]
        new = []
        assert not short.finished or len(short.output_ids) == 10
        by_id = {o.request_id: o for o in outs}
        if not short.finished:
            assert not by_id["short"].prefilling and by_id["short"].token_id >= 0
        for s in (long_a, long_b):
            assert by_id[s.request_id].prefilling == s.prefilling
    # First admitted first: "a" (30 tokens) in 5 steps of 6 (7 less short's decode),
    # then "b" (18) in steps of 5 (a decodes too): 4 more. Short's 10 tokens outlast them.
    assert steps == 5 + -(-len(long_b.prompt_ids) // 5) < 10
    drive(engine, [], running=running)
    for seq in (short, long_a, long_b):
        assert seq.output_ids == reference(ref, seq.prompt_ids, 10), seq.request_id
    # A prompt cached in part, its rest in chunks.
    c = engine.new_sequence("c", base[:20] + engine.tokenizer.encode(" and then"), params)
    drive(engine, [(0, c)])
    assert c.cached_tokens == 20
    assert c.output_ids == reference(ref, c.prompt_ids, 10)


def test_chunked_prefill_of_equal_prompts(llama_dir: Path) -> None:
    """Equal prompts admitted together whose prefill takes several steps are
    each prefilled on their own, and each generates what it would alone."""
    engine = make_engine(llama_dir, max_num_batched_tokens=5, prefix_caching=False)
    ref = lm_models.load_reference(llama_dir)
    prompt = engine.tokenizer.encode(LONG)[:23]
    seqs = [
        engine.new_sequence(
            f"n{i}", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        )
        for i in range(3)
    ]
    outputs = drive(engine, [(0, s) for s in seqs])
    want = reference(ref, prompt, 6)
    for s in seqs:
        assert s.output_ids == want
        assert [o.token_id for o in outputs[s.request_id] if not o.prefilling] == want
        assert sum(o.prefilling for o in outputs[s.request_id]) >= 4
