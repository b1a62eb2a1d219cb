"""The decoder engine: a causal LM, its tokenizer and KV cache, driven step by step.

Thread contract (the same spirit as :class:`aserve.engines.base.Engine`):

- ``load`` and ``unload`` run once, off the event loop.
- ``create_instance``, ``step`` and ``free`` run on ONE executor thread: the
  KV cache and every started :class:`Sequence` belong to it. There is one
  instance per engine, since the cache is the state that decode continues.
- ``new_sequence`` only validates and builds a sequence (its sampler and
  text state are made by the step that starts it); it touches no engine
  state, so the scheduler may call it wherever it prepares a request (it
  tokenizes a text prompt, which takes longer than the loop should wait for
  a long prompt).
- ``load_front`` loads only what ``new_sequence`` needs (the tokenizer and
  the model's shape): the server process's view of an engine whose steps run
  in a child process (:mod:`aserve.workers.step_process`).

The continuous batcher calls ``step(new, running)`` repeatedly: it prefills
the new sequences (their first token comes from the prefill) and runs one
decode step for the running ones; every sequence passed in gets exactly one
token, except one whose prompt is prefilled in chunks
(``generation.max_num_batched_tokens``), which gets none until its last
chunk. A new sequence's prompt starts after the longest prefix the prefix
cache finds in the KV cache (:mod:`.prefix_cache`). A sequence that finishes frees its slot inside ``step``. A cancelled
one is simply not passed again, and ``free(seq)`` returns its slot.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from aserve.config import GenerationConfig
from aserve.engines.decoder.checkpoint import check_folder
from aserve.engines.decoder.grammar import Allowed, Grammars, GrammarStepError
from aserve.engines.decoder.kv_cache import CacheFull, KVCache, SequenceTooLong
from aserve.engines.decoder.model import DecoderModel, resolve_dtype
from aserve.engines.decoder.prefix_cache import PrefixCache
from aserve.engines.decoder.sampling import make_generator, sample, token_logprobs
from aserve.engines.decoder.sequence import Sequence
from aserve.engines.decoder.spec import ModelSpec
from aserve.engines.decoder.stop import StopMatcher
from aserve.engines.decoder.tokenizer import Tokenizer
from aserve.engines.heap import release_freed_memory
from aserve.errors import AserveError, InvalidArgument
from aserve.types.generation import SamplingParams, StepOutput

log = logging.getLogger("aserve.engines.decoder")


class DecoderEngine:
    def __init__(
        self,
        model_path: str | Path,
        generation: GenerationConfig | None = None,
        device: str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        cpu_threads: int = 1,
    ) -> None:
        self.model_path = Path(model_path)
        self.generation = generation or GenerationConfig()
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.cpu_threads = cpu_threads
        self._model: DecoderModel | None = None
        self._spec: ModelSpec | None = None
        self._tokenizer: Tokenizer | None = None
        self._cache: KVCache | None = None
        self._grammars: Grammars | None = None
        self._prefix: PrefixCache | None = None  # None: prefix caching is off

    # --- lifecycle --------------------------------------------------------------

    def load(self) -> None:
        """Load weights and tokenizer, allocate the KV cache, run one warm-up step.

        What the folder declares is checked before it is built (the
        tokenizer's size, config.json's sizes, the weights' headers against
        them: ``generation.checkpoint_limits``)."""
        gen = self.generation
        limits = gen.checkpoint_limits
        # The tokenizer first: its size is refused in a moment, the weights take longer.
        tokenizer = Tokenizer.load(self.model_path, limits)
        model = DecoderModel.load(self.model_path, self.device, self.dtype, limits)
        cache = model.new_cache(gen.max_num_seqs, gen.max_model_len)
        self._model, self._tokenizer, self._cache = model, tokenizer, cache
        self._spec = model.spec
        self._grammars = Grammars(tokenizer, model.spec.vocab_size, self.cpu_threads)
        self._warm_up()
        if gen.prefix_caching:
            self._prefix = PrefixCache(gen.max_num_seqs, gen.prefix_block_tokens)
        log.info(
            "loaded %s (%s, %d layers) on %s: KV cache %d x %d tokens, %.1f MiB",
            self.model_path,
            model.spec.family,
            model.spec.num_layers,
            self.device,
            gen.max_num_seqs,
            gen.max_model_len,
            cache.nbytes / 2**20,
        )

    def load_front(self) -> None:
        """Load the tokenizer and the model's shape, no weights: enough for
        ``new_sequence``, not for ``step``. The weights' headers are checked
        against the shape here, so a folder whose files do not match is
        refused before the step process is started to load them."""
        limits = self.generation.checkpoint_limits
        self._tokenizer = Tokenizer.load(self.model_path, limits)
        self._spec = check_folder(self.model_path, limits)
        self._grammars = Grammars(self._tokenizer, self._spec.vocab_size)

    def create_instance(self, index: int) -> None:
        """Per-thread settings; call on the executor thread before the first step."""
        if index != 0:
            raise ValueError("the decoder engine runs on exactly one instance thread")
        # Intra-op threads are per thread in torch: set them where the steps run.
        torch.set_num_threads(self.cpu_threads)

    def unload(self) -> None:
        """Drop the model, the tokenizer and the cache, and give their memory
        back to the system (glibc keeps what is freed otherwise: a 150 MiB
        tokenizer.json left 260-330 MiB in the server after its model was
        removed; ``bench/decoder_memory.py``)."""
        if self._grammars is not None:
            self._grammars.close()
        self._model = self._tokenizer = self._cache = self._spec = self._grammars = self._prefix = (
            None
        )
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        release_freed_memory()

    @property
    def model(self) -> DecoderModel:
        if self._model is None:
            raise RuntimeError("the decoder engine is not loaded")
        return self._model

    @property
    def spec(self) -> ModelSpec:
        if self._spec is None:
            raise RuntimeError("the decoder engine is not loaded")
        return self._spec

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the decoder engine is not loaded")
        return self._tokenizer

    @property
    def grammars(self) -> Grammars:
        """Structured output's schemas and masks."""
        if self._grammars is None:
            raise RuntimeError("the decoder engine is not loaded")
        return self._grammars

    @property
    def cache(self) -> KVCache:
        if self._cache is None:
            raise RuntimeError("the decoder engine is not loaded")
        return self._cache

    @property
    def num_free_slots(self) -> int:
        """Sequences that can still be admitted (read between steps)."""
        return self.cache.num_free

    # --- requests ---------------------------------------------------------------

    def new_sequence(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Sequence:
        """Validate a request and build its sequence; nothing is allocated yet.

        A text prompt is encoded with the tokenizer's special tokens (e.g.
        BOS); pass ids for a prompt already rendered and encoded, such as a
        chat. Raises :class:`InvalidArgument` (``SequenceTooLong`` among
        them) naming the field and the limit. ``max_tokens`` over the cap is
        refused; one that would run past ``max_model_len`` is shortened, and
        the sequence then ends with finish reason "length". A ``json_schema``
        (or ``grammar``) is compiled here (or found compiled: :meth:`Grammars.compile`), and
        one the grammar engine refuses raises ``GrammarError``.
        """
        tok, gen = self.tokenizer, self.generation
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidArgument("prompt: is empty (no tokens)")
        # The length first: the per-token check below then costs at most max_model_len.
        if len(ids) >= gen.max_model_len:
            raise SequenceTooLong(
                f"prompt: {len(ids)} tokens leave no room to generate within "
                f"max_model_len ({gen.max_model_len})"
            )
        vocab = self.spec.vocab_size
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"prompt: token id {bad!r} is out of range (vocabulary {vocab})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(
                f"logit_bias: token id {bad} is out of range (vocabulary {vocab})"
            )
        wanted = gen.max_tokens_default if params.max_tokens is None else params.max_tokens
        if params.min_tokens > wanted:  # the default max_tokens: the request's own is checked
            raise InvalidArgument(
                f"min_tokens: {params.min_tokens} is more than max_tokens ({wanted}, "
                "this model's default)"
            )
        if wanted > gen.max_tokens_cap:
            raise InvalidArgument(
                f"max_tokens: {wanted} is over this model's limit ({gen.max_tokens_cap})"
            )
        if params.constraint is not None:
            self.grammars.compile(params.constraint)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= tok.eos_token_ids
        return self.build_sequence(
            request_id, ids, params, min(wanted, gen.max_model_len - len(ids)), stop_ids
        )

    def build_sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        stop_token_ids: Iterable[int],
    ) -> Sequence:
        """A sequence from settings ``new_sequence`` has already validated
        (the step process rebuilds the server's sequences with it). Its random
        stream, detokenizer and stop matcher are made when a step starts it."""
        return Sequence(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            max_tokens=max_tokens,
            stop_token_ids=frozenset(stop_token_ids),
        )

    def _start(self, seq: Sequence) -> None:
        """What only the steps use, made where they run: per request on the
        loop it would cost a seeded torch.Generator and two objects the server
        side of a step process never reads."""
        seq.generator = make_generator(seq.params.seed)
        seq.detokenizer = self.tokenizer.detokenizer(seq.prompt_ids)
        seq.stop = StopMatcher(seq.params.stop)
        if seq.params.constraint is not None:
            seq.grammar = self.grammars.matcher(seq.params.constraint)

    # --- the step -------------------------------------------------------------------

    def step(
        self, new: Iterable[Sequence] = (), running: Iterable[Sequence] = ()
    ) -> list[StepOutput]:
        """Prefill ``new``, decode one token for ``running``; one output per sequence.

        Outputs come in the order ``new`` then ``running``. With
        ``max_num_batched_tokens`` set, a step feeds at most that many tokens
        (each decode one, the rest prompt tokens): a prompt that does not fit
        is prefilled in chunks over the next steps, first admitted first. A
        sequence still prefilling after this step has an output with
        ``prefilling`` set and no token; the caller passes it as running
        again, as any other. Raises
        :class:`CacheFull` (and allocates nothing) when ``new`` has more
        sequences than free slots.

        A step never fails because of one member. If the batched step raises,
        each member is run again on its own (a decode rewrites the same KV
        positions, a prefill refills its slot), and a member that fails alone
        gets an output with ``error`` set, its slot freed; the others get their
        tokens. A step of one member that fails raises, its slot (if new) given
        back, so the caller fails exactly that request.
        """
        new, running = list(new), list(running)
        for s in new:
            if s.slot is not None or s.output_ids or s.finished:
                raise ValueError(f"sequence '{s.request_id}' has already started")
        for s in running:
            if s.slot is None or not (s.output_ids or s.prefilling) or s.finished:
                raise ValueError(f"sequence '{s.request_id}' is not running")
        if not new and not running:
            return []
        cache = self.cache
        if len(new) > cache.num_free:
            raise CacheFull(
                f"{len(new)} new sequence(s) but only {cache.num_free} free KV-cache slot(s)"
            )
        for s in new:
            self._start(s)
        seqs = new + running
        try:
            tokens = self._forward(new, running)
        except Exception as exc:
            if len(seqs) == 1:
                raise
            log.warning(
                "a step of %d sequences failed (%r); running each on its own", len(seqs), exc
            )
            return [self._alone(s, s in new) for s in seqs]
        return [self._settle(s, t) for s, t in zip(seqs, tokens, strict=True)]

    def _forward(self, new: list[Sequence], running: list[Sequence]) -> list[int | None]:
        """Run the model and sample one token per sequence (None for one whose
        prompt is not all prefilled yet); on failure the new sequences' slots
        are given back and the running ones are unchanged (a chunk that ran
        is kept: its K/V are right)."""
        cache, model = self.cache, self.model
        # The grammars' masks are filled on a helper thread while the model runs, for
        # every sequence of the step (one still prefilling draws nothing: its mask,
        # read-only, is left unused).
        candidates = new + running
        masks = None
        try:
            masks = self.grammars.start(candidates)
            decode = [s for s in running if not s.prefilling]
            budget = self.generation.max_num_batched_tokens
            if budget is not None:  # decodes first; a prefill always gets a token
                budget = max(budget - len(decode), 1)
            parts, seqs = [], []
            chunked = [s for s in running if s.prefilling]
            logits, done, decoded = self._prefill(new, chunked, budget, decode)
            if done:
                parts.append(logits)
                seqs += done
            if decoded is not None:
                parts.append(decoded)
                seqs += decode
            elif decode:
                parts.append(
                    model.decode(
                        cache,
                        [s.slot for s in decode],  # type: ignore[misc]
                        [s.output_ids[-1] for s in decode],
                        [s.num_tokens - 1 for s in decode],
                    )
                )
                seqs += decode
            if not seqs:
                if masks is not None:
                    masks.settle()  # every sequence is still prefilling: no mask is used
                return [None] * (len(new) + len(running))
            logits = parts[0] if len(parts) == 1 else torch.cat(parts)
            allowed = None if masks is None else _rows_of(masks.wait(), candidates, seqs)
            tokens = sample(logits, seqs, allowed)
            for s, logprob in zip(seqs, token_logprobs(logits, tokens, seqs), strict=True):
                s.step_logprob = logprob
            by_seq = dict(zip(seqs, tokens, strict=True))
            return [by_seq.get(s) for s in new + running]
        except BaseException:
            if masks is not None:
                masks.settle()
            for s in new:
                self.free(s, holds=0)  # what its slot holds now is not known
            raise

    def _prefill(
        self,
        new: list[Sequence],
        chunked: list[Sequence],
        budget: int | None,
        decode: list[Sequence],
    ) -> tuple[torch.Tensor, list[Sequence], torch.Tensor | None]:
        """Give the new sequences their slots and prefill prompts, at most
        ``budget`` tokens of them (None: all), ``chunked`` (already running,
        partly prefilled) first. Returns the logits of the sequences whose
        prompt is now all prefilled, those sequences, in that order, and with
        chunked prefill the logits of ``decode`` (None: not decoded here).

        With a budget, the chunks and the decodes run as one pass of the
        weights (:meth:`DecoderModel.mixed`): a step then costs about a
        decode step plus the chunk's attention, not a decode step plus a
        prefill's.

        Each distinct prompt is prefilled once: a sequence whose prompt
        another of this step has (the choices of a request with ``n`` > 1, or
        two clients' equal prompts) gets a copy of that one's KV and its
        logits row, when that one's prefill ends in this step (otherwise it
        is prefilled on its own, in chunks). With prefix caching, a prompt
        starts after the longest cached prefix the prefix cache finds
        (:mod:`.prefix_cache`): every copy of a prefix is made before the
        model runs, while its source positions are still as recorded."""
        cache, prefix = self.cache, self._prefix
        first: dict[tuple[int, ...], Sequence] = {}
        owners: list[Sequence] = []  # the first sequence of each distinct prompt
        followers: list[tuple[Sequence, Sequence]] = []  # (sequence, its owner)
        for s in new:
            key = tuple(s.prompt_ids)
            owner = first.get(key)
            if owner is None:
                first[key] = s
                owners.append(s)
                if prefix is not None:
                    place = prefix.place(s.prompt_ids)
                    s.slot, s.cached_tokens = cache.alloc(place.slot), place.cached
                    if place.copy_from is not None:
                        cache.copy(place.copy_from, place.slot, place.cached)
                else:
                    s.slot = cache.alloc()
                s.prefilled = s.cached_tokens
            else:
                s.slot = cache.alloc(None if prefix is None else prefix.place(()).slot)
                followers.append((s, owner))
        rows: list[tuple[Sequence, int]] = []  # (sequence, tokens fed now)
        left = budget
        for s in (*chunked, *owners):
            take = len(s.prompt_ids) - s.prefilled
            if left is not None:
                take = min(take, left)
                left -= take
            if take > 0:
                rows.append((s, take))
        done: list[Sequence] = []
        picks: list[int] = []
        logits, decoded = torch.empty(0), None
        if rows and decode and budget is not None:
            both = self.model.mixed(
                cache,
                [
                    (s.slot, s.prompt_ids[s.prefilled : s.prefilled + n], s.prefilled)
                    for s, n in rows
                ],  # type: ignore[misc]
                [s.slot for s in decode],  # type: ignore[misc]
                [s.output_ids[-1] for s in decode],
                [s.num_tokens - 1 for s in decode],
            )
            logits, decoded = both[: len(rows)], both[len(rows) :]
        elif rows:
            logits = self.model.prefill(
                cache,
                [s.slot for s, _ in rows],  # type: ignore[misc]
                [s.prompt_ids[s.prefilled : s.prefilled + n] for s, n in rows],
                [s.prefilled for s, _ in rows],
            )
        for row, (s, n) in enumerate(rows):
            s.prefilled += n
            if prefix is not None:
                prefix.filled(s.slot, s.prompt_ids[: s.prefilled])  # type: ignore[arg-type]
            if not s.prefilling:
                done.append(s)
                picks.append(row)
        for s, owner in followers:
            if owner.prefilling or owner not in done:
                s.prefilled = 0  # its own prefill, from the next chunk on
                continue
            cache.copy(owner.slot, s.slot, len(s.prompt_ids))  # type: ignore[arg-type]
            s.prefilled, s.cached_tokens = len(s.prompt_ids), owner.cached_tokens
            if prefix is not None:
                prefix.filled(s.slot, s.prompt_ids)  # type: ignore[arg-type]
            done.append(s)
            picks.append(picks[done.index(owner)])
        if done and picks != list(range(len(rows))):
            logits = logits[torch.tensor(picks, device=logits.device)]
        return logits, done, decoded

    def _alone(self, seq: Sequence, is_new: bool) -> StepOutput:
        """One member of a failed step, run on its own; a failure is its own."""
        try:
            (token,) = self._forward([seq], []) if is_new else self._forward([], [seq])
        except Exception as exc:
            return self._failed(seq, exc)
        return self._settle(seq, token)

    def _settle(self, seq: Sequence, token: int | None) -> StepOutput:
        """Append ``token``; text handling that raises fails this sequence only.
        No token: the sequence is still prefilling."""
        if token is None:
            return StepOutput(
                seq.request_id,
                -1,
                "",
                False,
                None,
                seq.prompt_tokens,
                0,
                cached_tokens=seq.cached_tokens,
                prefilling=True,
            )
        try:
            return self._append(seq, token)
        except Exception as exc:
            return self._failed(seq, exc)

    def _failed(self, seq: Sequence, exc: Exception) -> StepOutput:
        self.free(seq, holds=0)
        log.warning("sequence '%s' failed on its own: %r", seq.request_id, exc)
        code = exc.code.value if isinstance(exc, AserveError) else "internal"
        return StepOutput(
            seq.request_id,
            -1,
            "",
            True,
            None,
            seq.prompt_tokens,
            seq.completion_tokens,
            error=f"{type(exc).__name__}: {exc}",
            error_code=code,
            cached_tokens=seq.cached_tokens,
        )

    def free(self, seq: Sequence, holds: int | None = None) -> None:
        """Return a sequence's slot (a cancelled one, or after a failed step); idempotent.

        The prefix cache keeps what the slot holds: the K/V of the sequence's
        first ``holds`` tokens, by default every token fed so far (the prompt
        prefilled so far, and all generated tokens but the last, which no
        step has fed yet)."""
        if seq.slot is not None:
            if self._prefix is not None:
                fed = seq.prefilled + max(0, len(seq.output_ids) - 1)
                n = fed if holds is None else holds
                self._prefix.release(seq.slot, (seq.prompt_ids + seq.output_ids)[:n])
            self.cache.free(seq.slot)
            seq.slot = None

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        seq.output_ids.append(token)
        complete = False  # the sequence's grammar has nothing more to take
        if seq.grammar is not None and token not in seq.stop_token_ids:
            if not seq.grammar.consume_token(token):
                raise GrammarStepError(f"the grammar refused token {token}")
            complete = seq.grammar.is_stopped()
        if token in seq.stop_token_ids:
            text = self._release(seq)
            if seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", token
        else:
            armed = len(seq.output_ids) >= seq.params.min_tokens  # vLLM's rule for stops
            text, matched = seq.stop.push(seq.detokenizer.push(token), armed)
            if matched:
                seq.finish_reason, seq.stop_reason = "stop", seq.stop.matched
            elif complete:
                text += self._release(seq)
                if seq.finish_reason is None:
                    seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.max_tokens:
                text += self._release(seq)
                if seq.finish_reason is None:
                    seq.finish_reason = "length"
        if seq.finished:
            self.free(seq)
        return StepOutput(
            seq.request_id,
            token,
            text,
            seq.finished,
            seq.finish_reason,
            seq.prompt_tokens,
            seq.completion_tokens,
            logprob=seq.step_logprob,
            cached_tokens=seq.cached_tokens,
        )

    def _release(self, seq: Sequence) -> str:
        """Everything still held back when a sequence ends for a reason other
        than a stop string. The flushed characters may themselves complete a
        stop string; then that match is the finish reason."""
        text, matched = seq.stop.push(seq.detokenizer.flush())
        if matched:
            seq.finish_reason, seq.stop_reason = "stop", seq.stop.matched
            return text
        return text + seq.stop.flush()

    def _warm_up(self) -> None:
        """One tiny prefill and decode: fails a broken model at load, not on a request."""
        cache, model = self.cache, self.model
        slot = cache.alloc()
        try:
            logits = model.prefill(cache, [slot], [[0]])
            model.decode(cache, [slot], [int(logits.argmax())], [1])
        finally:
            cache.free(slot)


def _rows_of(allowed: Allowed, candidates: list[Sequence], seqs: list[Sequence]) -> Allowed | None:
    """The masks filled for ``candidates`` (the step's sequences, in their order),
    as rows of ``seqs`` (the ones that draw a token, in the logits' order)."""
    rows, masks = allowed
    where = {id(s): i for i, s in enumerate(seqs)}
    pairs = [
        (where[id(candidates[r])], j) for j, r in enumerate(rows) if id(candidates[r]) in where
    ]
    if not pairs:
        return None
    return [row for row, _ in pairs], masks[[j for _, j in pairs]]
