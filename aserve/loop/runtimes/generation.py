"""One served decoder model (``"engine": "decoder"``): engine, step thread, continuous batcher.

Layer: loop; runs on the event loop (long prompts are tokenized in a worker
thread, the steps run on the step thread or in the step process). A
:class:`~aserve.loop.runtimes.base.Runtime` like the others (the same
registry, readiness, statistics and unload), but requests are sequences that
stream tokens: a :class:`~aserve.loop.runtimes.base.Generator`, whose
``prepare`` and ``generate`` the generation routes call.

For KServe clients the model also answers ``/infer`` and ``ModelInfer``
(``text_input`` BYTES [1] -> ``text_output`` BYTES [1], sampling settings as
request parameters) with the whole generated text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import reprlib
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from aserve.codecs.sampling import sampling_from_parameters
from aserve.codecs.sequence import refuse_sequence
from aserve.config import GpuConfig, ModelConfig, TensorSpec
from aserve.engines import builtin
from aserve.errors import InvalidArgument, TooLarge, Unavailable
from aserve.loop.continuous import ContinuousBatcher, GenerationRequest
from aserve.loop.prompt_size import BODY_SLACK_BYTES, body_limit, check_prompt_size
from aserve.loop.runtimes.base import (
    Generator,
    ModelState,
    instance_group,
    load_timeout_only,
    not_ready,
    string_parameters,
)
from aserve.types.generation import BadSetting, SamplingParams
from aserve.workers.job import ChildProcesses, Executor, SequenceCheck, StepJob
from aserve.workers.offload import run_off_loop
from aserve.workers.step_executor import StepExecutor
from aserve.workers.step_process import ProcessStepExecutor, WorkerArgs

if TYPE_CHECKING:
    from aserve.engines.decoder import DecoderEngine, Tokenizer
    from aserve.engines.decoder import Sequence as EngineSequence
    from aserve.engines.decoder.chat_template import RenderBudget
    from aserve.loop.registry import ModelRegistry

log = logging.getLogger("aserve.model")

PLATFORM = "aserve_decoder"
BACKEND = "aserve_decoder"
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
# Larger prompts (UTF-8 bytes; a chat's structure counted, as prompt_size
# measures it) are tokenized, and chats rendered, in a worker thread, not on the
# loop. A model's own chat template always renders there: its cost is the
# model's code, bounded by its budget, not by the request.
_INLINE_PROMPT_BYTES = 2048
# vLLM's request priority (lower is admitted first), bounded to a signed 32-bit
# integer: a value every JSON client and a protobuf int parameter carry exactly.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


class GenerationRuntime(Generator):
    """A decoder model version; its request path runs on the loop."""

    def __init__(self, config: ModelConfig, base_dir: Path, gpu: GpuConfig | None = None) -> None:
        super().__init__(config, base_dir, gpu)
        self.generation = config.generation
        self.created = int(time.time())
        # What the KServe codecs see: one string in, one string out, no batching
        # (the shape of text_input is [1], as Triton's LLM backends declare it).
        self.input_specs = {TEXT_INPUT: TensorSpec(name=TEXT_INPUT, datatype="BYTES", shape=[])}
        self.output_specs = {TEXT_OUTPUT: TensorSpec(name=TEXT_OUTPUT, datatype="BYTES", shape=[])}
        self.max_batch_size = 1
        self.variable_shapes = False
        self._engine: DecoderEngine | None = None
        self._executor: Executor[StepJob] | None = None
        # The executor's check of a sequence before it is queued (a SequenceCheck's).
        self._check: Callable[[EngineSequence], None] | None = None
        self.batcher: ContinuousBatcher | None = None
        self._preparing = 0  # requests tokenizing in a worker thread
        # Chats render on a thread of the model's own: a template that runs to
        # its budget ties up that thread only, never the loop's default executor.
        self._template_thread: ThreadPoolExecutor | None = None
        self._new_budget: Callable[[], RenderBudget] | None = None
        self._renders: set[RenderBudget] = set()  # in flight, cancelled at stop

    @staticmethod
    def timeout_of(config: ModelConfig) -> float:
        return config.generation.timeout_ms / 1000.0

    def not_ready_reason(self) -> str | None:
        """Not loaded, or its step process (if it has one) is down, being restarted."""
        reason = self.state_reason()
        executor = self._executor
        if reason is None and executor is not None and executor.live == 0:
            return not_ready(self.label, "restarting")
        return reason

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._engine is not None
        return self._engine.tokenizer

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer.has_chat_template

    @property
    def template_reads_tools(self) -> bool:
        return self.tokenizer.template_reads_tools

    def choices(self, sequence: EngineSequence, n: int) -> list[EngineSequence]:
        assert self._engine is not None
        params, seqs = sequence.params, [sequence]
        for i in range(1, n):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            seqs.append(self._engine.build_sequence(
                sequence.request_id, list(sequence.prompt_ids),
                dataclasses.replace(params, seed=seed), sequence.max_tokens,
                sequence.stop_token_ids,
            ))  # fmt: skip
        return seqs

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        # One call into the tokenizer for all of them: a few microseconds a token.
        return self.tokenizer.inner.decode_batch([[t] for t in token_ids])

    async def load(self) -> None:
        """Load weights and tokenizer, start the step thread; READY afterwards."""
        t0 = time.perf_counter()
        c = self.config
        assert c.path is not None  # the config requires one for a decoder model
        self.load_step = "locating the model's files"
        path = await run_off_loop(
            f"locating the files of model '{self.label}'", builtin.locate, c.path, self._base_dir
        )
        # Here, not at the top: the decoder imports torch, and the frontends that
        # route to this runtime must import without it (tests/test_torch_free.py).
        from aserve.engines.decoder import DecoderEngine
        from aserve.engines.decoder.chat_template import RenderBudget, TemplateBounds

        bounds = TemplateBounds.of(c.generation)
        self._new_budget = lambda: RenderBudget(bounds)
        self._template_thread = ThreadPoolExecutor(1, f"chat-template-{self.label}")

        engine = DecoderEngine(path, c.generation, c.device, c.dtype, c.cpu_threads)
        executor: Executor[StepJob]
        if c.generation.step_process:
            # The weights live in the child; this process keeps the tokenizer.
            self.load_step = "loading the tokenizer"
            await run_off_loop(f"loading the front of model '{self.label}'", engine.load_front)
            args = WorkerArgs(
                str(path), c.generation.model_dump(), c.device, c.dtype, c.cpu_threads, self.name,
                gpu=self.gpu.model_dump(),
            )  # fmt: skip
            executor = ProcessStepExecutor(args, on_lost=self._on_sequences_lost)
        else:
            self.load_step = "loading the weights and the tokenizer"
            await run_off_loop(f"loading model '{self.label}'", engine.load)
            executor = StepExecutor(engine, self.name)
        self._engine = engine
        self.load_step = f"starting the step {'process' if c.generation.step_process else 'thread'}"
        self._executor = executor  # before it starts: a load given up meanwhile stops it
        self._check = executor.check if isinstance(executor, SequenceCheck) else None
        await executor.start()
        self.batcher = ContinuousBatcher(self.label, c.generation, executor, self.stats)
        self.state = ModelState.READY
        log.info(
            "model %s loaded from %s on %s (decoder, %d slots x %d tokens, %.2fs)",
            self.label, path, c.device, c.generation.max_num_seqs,
            c.generation.max_model_len, time.perf_counter() - t0,
        )  # fmt: skip

    @property
    def worker_pids(self) -> list[int]:
        """The model's child processes: its step process, when it is up."""
        executor = self._executor
        return executor.pids if isinstance(executor, ChildProcesses) else []

    def _on_sequences_lost(self, error: BaseException) -> None:
        if self.batcher is not None:
            self.batcher.fail_running(error)

    # --- requests ---------------------------------------------------------------

    async def prepare(
        self,
        params: SamplingParams,
        prompt: str | list[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        client_id: str | None = None,
        *,
        priority: int = 0,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> EngineSequence:
        """Tokenize ``prompt`` (or render ``messages`` with the chat template,
        given ``tools`` when there are) and validate the request;
        :class:`InvalidArgument` names what is wrong.

        Nothing is queued yet, but a full queue refuses here already
        (QueueFull), before any per-token work, unless it holds one less urgent
        than ``priority`` (see :meth:`generate`). The prompt's size is checked
        first (:mod:`aserve.loop.prompt_size`). Short prompts are handled right here;
        long ones in a worker thread, tokenized with the GIL given up, so that
        the loop is not held up. A chat the model's own template renders is
        always rendered on the model's template thread, within the bounds of
        :class:`~aserve.engines.decoder.chat_template.TemplateBounds`; if the
        request is cancelled meanwhile, so is its render.
        """
        # The state alone: a request waits out a step process's restart. (Spelled
        # out rather than through the base's state_reason(): it runs per request.)
        if self._engine is None or self.state is not ModelState.READY:
            raise Unavailable(not_ready(self.label, self.state.value))
        # A full queue refuses before the prompt is rendered and tokenized: under
        # a retry storm that work was most of a refusal's time on the loop,
        # taken from the running streams. generate() checks again.
        size = check_prompt_size(self.generation, prompt, messages)
        own_template = messages is not None and self._engine.tokenizer.has_chat_template
        # A schema not compiled yet is compiled off the loop (about a millisecond
        # for a few fields, more for large ones); one in the cache costs a lookup.
        schema = params.constraint
        fresh = schema is not None and not self._engine.grammars.is_compiled(schema)
        inline = size <= _INLINE_PROMPT_BYTES and not own_template and not fresh
        if self.batcher is not None:
            # What waits for the template thread counts as queued: else a line of
            # chats whose templates run to their bound grew behind it without limit.
            self.batcher.check_room(0 if inline else self._preparing, priority)
        if inline:
            return self._prepare(params, prompt, messages, client_id, tools=tools)
        self._preparing += 1  # busy: a drain waits for it to be queued
        try:
            if messages is None:
                return await asyncio.to_thread(self._prepare, params, prompt, None, client_id, True)
            return await self._prepare_chat_off_loop(params, messages, client_id, tools)
        finally:
            self._preparing -= 1

    async def _prepare_chat_off_loop(
        self,
        params: SamplingParams,
        messages: Sequence[Mapping[str, Any]],
        client_id: str | None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> EngineSequence:
        assert self._template_thread is not None and self._new_budget is not None
        budget = self._new_budget()
        render = functools.partial(
            self._prepare, params, None, messages, client_id, True, budget, tools=tools
        )
        self._renders.add(budget)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._template_thread, render)
        except asyncio.CancelledError:
            budget.cancel()  # the render stops at its next step
            raise
        finally:
            self._renders.discard(budget)

    def _prepare(
        self,
        params: SamplingParams,
        prompt: str | list[int] | None,
        messages: Sequence[Mapping[str, Any]] | None,
        client_id: str | None,
        off_loop: bool = False,
        budget: RenderBudget | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> EngineSequence:
        assert self._engine is not None and self._new_budget is not None
        tok = self._engine.tokenizer
        if messages is not None:
            extra = {} if tools is None else {"tools": list(tools)}  # as transformers gives them
            text = tok.apply_chat_template(
                messages, add_generation_prompt=True, budget=budget or self._new_budget(), **extra
            )
            # A model's own template writes its special tokens (BOS); the
            # plain default format has none, so the tokenizer adds them.
            prompt = tok.encode(
                text, add_special_tokens=not tok.has_chat_template, release_gil=off_loop
            )
        elif isinstance(prompt, str):
            prompt = tok.encode(prompt, release_gil=off_loop)
        if prompt is None:
            raise InvalidArgument("prompt: is required")
        return self._engine.new_sequence(client_id or "", prompt, params)

    def generate(
        self,
        sequence: EngineSequence,
        timeout_s: float | None = None,
        client_id: str | None = None,
        *,
        arrival: float | None = None,
        priority: int = 0,
    ) -> GenerationRequest:
        """Queue a prepared sequence: its stream, or a refusal at once
        (QueueFull when ``generation.max_queue_size`` are waiting, Unavailable
        when the model is not loaded, DeadlineExceeded when its deadline,
        counted from ``arrival``, passed already). While the step process
        restarts the model reports not ready, but a request still queues for
        the new one, bounded by its deadline and the queue's size.

        ``priority`` (vLLM's, :func:`request_priority`): lower is admitted
        first; a running sequence is never preempted. At a full queue it takes
        the place of the least urgent one waiting, if that one is less urgent
        (which then fails with QueueFull)."""
        if self.state is not ModelState.READY or self.batcher is None:
            raise Unavailable(not_ready(self.label, self.state.value))
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        if self._check is not None:
            self._check(sequence)
        return self.batcher.submit(
            sequence, len(sequence.prompt_ids), timeout, client_id, arrival=arrival,
            priority=priority,
        )  # fmt: skip

    def end_streams(self) -> None:
        """End every queued and running stream as unavailable; refuse new ones."""
        if self.batcher is not None:
            self.batcher.close()

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        batch_size: int,
        shape_key: tuple[Any, ...],
        timeout_s: float,
        client_id: str | None = None,
        parameters: dict[str, Any] | None = None,
        *,
        arrival: float | None = None,
    ) -> dict[str, np.ndarray]:
        """KServe inference: the whole generation for ``text_input`` as ``text_output``
        (the ``priority`` parameter is vLLM's, as on the generation routes)."""
        refuse_sequence(parameters, self.label)
        params = sampling_from_parameters(parameters)
        priority = parameter_priority(parameters)
        prompt = text_input(inputs, self.generation.prompt_bytes_limit)
        seq = await self.prepare(params, prompt=prompt, client_id=client_id, priority=priority)
        async with self.generate(
            seq, timeout_s, client_id, arrival=arrival, priority=priority
        ) as req:
            text, _ = await req.collect()
        return {TEXT_OUTPUT: text_tensor(text)}

    # --- state seen by others -----------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._preparing > 0 or (self.batcher is not None and not self.batcher.idle)

    @staticmethod
    def reconfigurable(old: ModelConfig, new: ModelConfig) -> bool:
        """A decoder model takes no settings in place (but ``load_timeout_s``, which
        bounds a load that is over): any other change reloads it."""
        return load_timeout_only(old, new)

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": PLATFORM,
            "inputs": [{"name": TEXT_INPUT, "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": TEXT_OUTPUT, "datatype": "BYTES", "shape": [1]}],
        }

    def triton_config(self) -> dict[str, Any]:
        """Triton's ModelConfig of an LLM backend: no batch dimension, decoupled."""
        c, g = self.config, self.config.generation
        settings = {
            "version": self.version,
            "device": c.device,
            "dtype": c.dtype,
            "cpu_threads": c.cpu_threads,
            **g.model_dump(),
        }
        return {
            "name": self.name,
            "platform": PLATFORM,
            "backend": BACKEND,
            "max_batch_size": 0,
            "input": [{"name": TEXT_INPUT, "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": TEXT_OUTPUT, "data_type": "TYPE_STRING", "dims": [1]}],
            "instance_group": [instance_group(self.name, 1, c.device)],
            "model_transaction_policy": {"decoupled": True},
            "parameters": string_parameters(settings.items()),
        }

    def statistics(self) -> dict[str, Any]:
        """Triton's statistics, where an execution is one engine step of
        ``batch_size`` sequences; ``generation`` holds aserve's own gauges."""
        b = self.batcher
        doc = self.stats.as_dict(b.waiting if b else 0, int(b.step_in_flight) if b else 0)
        if b is not None:
            doc["generation"] = b.statistics()
            # Requests whose prompt is being tokenized (or chat rendered) off the loop.
            doc["generation"]["preparing_sequence_count"] = self._preparing
        return doc

    async def _stop(self) -> None:
        """End what is queued or running, stop the step thread or process, free the model."""
        if self.batcher is not None:
            self.batcher.close()
        for budget in self._renders:
            budget.cancel()
        if self._template_thread is not None:
            self._template_thread.shutdown(wait=False, cancel_futures=True)
        if self._executor is not None:
            await self._executor.stop(self.stop_timeout_s)
        if self._engine is not None:
            await self.free_off_loop(self._engine.unload)


def generation_runtime(registry: ModelRegistry, name: str, version: str | None = None) -> Generator:
    """The decoder model ``name``: NotFound if unknown, InvalidArgument if it does not generate."""
    runtime = registry.get(name, version or None)
    if not isinstance(runtime, Generator):
        raise InvalidArgument(
            f"model '{runtime.label}' does not generate text (engine "
            f"'{runtime.config.engine}'); use /v2/models/{runtime.name}/infer"
        )
    return runtime


def generation_body_limit(registry: ModelRegistry) -> int:
    """Largest JSON body a route that names its model in the body (OpenAI's)
    reads: the largest of the decoder models' limits (with none, just room
    for a request that names no model, which is then refused)."""
    limits = [body_limit(rt.generation) for rt in registry if isinstance(rt, Generator)]
    return max(limits, default=BODY_SLACK_BYTES)


def request_priority(value: Any) -> int:
    """A generation request's ``priority``, vLLM's: an integer within
    :data:`PRIORITY_RANGE`, lower admitted first; None (absent) is 0. Anything
    else (a bool, a float, a string) raises :class:`BadSetting` naming
    ``priority``, its message reading after the name, as the sampling settings'."""
    if value is None:
        return 0
    low, high = PRIORITY_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadSetting(
            "priority",
            f"must be an integer >= {low} and <= {high}, lower served first "
            f"(got {reprlib.repr(value)})",
        )
    return value


def parameter_priority(params: Mapping[str, Any] | None) -> int:
    """The ``priority`` of KServe-style request parameters (Triton's generate
    extension, ``/infer`` and ``ModelStreamInfer`` on a decoder model), checked
    by :func:`request_priority`; InvalidArgument names the parameter."""
    try:
        return request_priority(None if params is None else params.get("priority"))
    except BadSetting as exc:
        raise InvalidArgument(f"parameter 'priority' {exc.message}") from None


def text_input(inputs: Mapping[str, np.ndarray], limit_bytes: int | None = None) -> str:
    """The prompt of a KServe request: the one element of ``text_input``, as UTF-8;
    over ``limit_bytes`` it is refused (TooLarge) before it is decoded."""
    arr = inputs[TEXT_INPUT]
    if arr.size != 1:
        raise InvalidArgument(f"input '{TEXT_INPUT}' must hold exactly one string (got {arr.size})")
    value = arr.reshape(-1)[0]
    if limit_bytes is not None and isinstance(value, bytes) and len(value) > limit_bytes:
        raise TooLarge(
            f"input '{TEXT_INPUT}': {len(value)} bytes, over the limit "
            f"generation.max_prompt_bytes {limit_bytes}"
        )
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise InvalidArgument(f"input '{TEXT_INPUT}' is not valid UTF-8") from None


def text_tensor(text: str) -> np.ndarray:
    """``text_output`` for a KServe answer: BYTES of shape [1]."""
    out = np.empty(1, dtype=object)
    out[0] = text.encode("utf-8")
    return out
