"""The one contract of a model runtime, and what every runtime shares.

Layer: loop. Everything here runs on the event loop; what blocks (reading
weights, stopping threads) a runtime sends to a thread itself.

A runtime serves one model version. The registry routes to it, the reloader
loads, reconfigures, drains and unloads it, and the frontends ask it for its
metadata, readiness and statistics and hand it requests, all through
:class:`Runtime` alone; the generation routes also through :class:`Generator`,
the contract of a runtime that streams generated text, and the streaming
routes through :class:`Decoupled`, that of a runtime that answers a request
with any number of responses. The classes that keep it:

- :class:`~aserve.loop.runtimes.batched.ModelRuntime`: an engine on executor
  threads or worker processes behind a deadline batcher;
- :class:`~aserve.loop.runtimes.handler.HandlerRuntime`: a user's handler, its
  pre- and postprocessing stages composed around a batched runtime;
- :class:`~aserve.loop.runtimes.pipeline.PipelineRuntime`: other models in turn;
- :class:`~aserve.loop.runtimes.generation.GenerationRuntime`: a decoder model
  that streams tokens (a :class:`Generator`);
- :class:`~aserve.loop.runtimes.decoupled.DecoupledRuntime`: a user's handler
  that yields responses (a :class:`Decoupled`).
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from aserve.config import GpuConfig, ModelConfig, TensorSpec
from aserve.errors import Unavailable
from aserve.obs.stats import ModelStats
from aserve.workers.offload import run_off_loop

if TYPE_CHECKING:
    from aserve.config import GenerationConfig
    from aserve.engines.decoder import Sequence as EngineSequence
    from aserve.loop.continuous import GenerationRequest
    from aserve.loop.device_scheduler import DeviceScheduler
    from aserve.loop.runtimes.decoupled import ResponseStream
    from aserve.obs.handler_metrics import MetricSet
    from aserve.types.generation import SamplingParams

log = logging.getLogger("aserve.model")

# How often a drain looks whether a runtime that routing no longer reaches is idle.
DRAIN_POLL_S = 0.02
# How long an unload waits for each instance's batch in flight; after a load that
# was given up, whose warm-up batch may never end, only this long.
STOP_TIMEOUT_S = 10.0
CUT_SHORT_STOP_S = 0.5


class ModelState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


class LoadTimedOut(RuntimeError):
    """A model's load and warm-up did not finish within its ``load_timeout_s``."""


def not_ready(label: str, why: str) -> str:
    """The wording of a runtime that cannot take requests now (a 503 / UNAVAILABLE)."""
    return f"model '{label}' is not ready ({why})"


class Runtime(abc.ABC):
    """One served model version: the contract, and the members every runtime shares.

    ``input_specs``, ``output_specs``, ``max_batch_size`` and ``variable_shapes``
    are what the KServe codecs check a request against before :meth:`infer`.
    """

    input_specs: dict[str, TensorSpec]
    output_specs: dict[str, TensorSpec]
    max_batch_size: int
    variable_shapes: bool

    def __init__(self, config: ModelConfig, base_dir: Path, gpu: GpuConfig | None = None) -> None:
        self.config = config
        self.gpu = gpu or GpuConfig()  # the server's "gpu" block, for child processes
        self.name = config.name
        self.version = config.version
        self.label = f"{config.name}/{config.version}"
        self.state = ModelState.LOADING
        self.stats = ModelStats(config.name, config.version)
        self.default_timeout_s = self.timeout_of(config)
        # When it was made, in seconds since the epoch (OpenAI's ``created``, on /v1/models).
        self.created = int(time.time())
        self._base_dir = base_dir
        # What the load is doing now, for the reason of a load that timed out.
        self.load_step = "starting"
        # The load was given up (timed out or cancelled): stopping what it started
        # does not wait for work that may never end (a warm-up batch stuck in the model).
        self.cut_short = False

    @staticmethod
    def timeout_of(config: ModelConfig) -> float:
        """The deadline, in seconds, of a request that sets none."""
        return config.batching.timeout_ms / 1000.0

    # --- readiness --------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether it takes requests now (DESIGN: "Running many of it")."""
        return self.not_ready_reason() is None

    def state_reason(self) -> str | None:
        """Why it cannot take requests by its state alone (not loaded, unloading)."""
        if self.state is not ModelState.READY:
            return not_ready(self.label, self.state.value)
        return None

    def not_ready_reason(self) -> str | None:
        """Why it cannot take requests now, or None when it can; subclasses add
        what else can stop them (every instance restarting, a step gone)."""
        return self.state_reason()

    def require_ready(self) -> None:
        """Raise Unavailable, saying why, unless it takes requests now."""
        reason = self.not_ready_reason()
        if reason is not None:
            raise Unavailable(reason)

    # Whether its last load read a parked runtime's weights back (no fresh load).
    restored = False

    @property
    def parked(self) -> bool:
        """Its weights released and the rest kept (an evicted on-demand model's
        runtime, see ``ModelRuntime.park``) until its next load reads them back."""
        return False

    async def park(self) -> int | None:
        """Release the weights, keep the rest for a fast load; the bytes released,
        or None where it cannot (the caller then unloads it)."""
        return None

    # --- draining ---------------------------------------------------------------

    @property
    @abc.abstractmethod
    def busy(self) -> bool:
        """Requests are queued, running, or in a stage before or after the queue."""

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or running (True), or ``timeout_s`` passed (False).

        Used on a runtime that routing no longer reaches: nothing new arrives,
        so polling only has to see the count fall to zero once.
        """
        deadline = time.monotonic() + timeout_s
        while self.busy:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    def use_stats(self, stats: ModelStats) -> None:
        """Count in ``stats`` from now on (called before :meth:`load`): an on-demand
        model keeps one set of statistics across the runtimes of its loads."""
        self.stats = stats

    @property
    def loads_on_demand(self) -> bool:
        """Loaded at its first request (``"load": "on_demand"``), not at startup:
        the server is ready without it (:mod:`aserve.loop.runtimes.on_demand`)."""
        return False

    @property
    def worker_pids(self) -> list[int]:
        """The model's child processes (none unless it runs in some)."""
        return []

    @property
    def handler_metrics(self) -> MetricSet | None:
        """A handler's own metrics (its ``context.metrics``), which the dashboard
        and ``/metrics`` export; None for a model without a handler."""
        return None

    # --- lifecycle --------------------------------------------------------------

    @abc.abstractmethod
    async def load(self) -> None:
        """Load and warm up; READY afterwards, or raise (then :meth:`unload` it)."""

    async def load_within(self, timeout_s: float) -> None:
        """:meth:`load`, given up after ``timeout_s`` (the model's ``load_timeout_s``)
        with :class:`LoadTimedOut`, which says what the load was doing.

        Given up (timed out or cancelled), the load's awaits end at once; what
        it was running on a thread runs on, since nothing interrupts a thread
        (:mod:`aserve.workers.offload`), and a worker process is killed when
        the caller unloads the runtime, as it must after any failed load.
        """
        load = asyncio.ensure_future(self.load())
        try:
            done, _ = await asyncio.wait([load], timeout=timeout_s)
        except asyncio.CancelledError:
            await self._give_up(load)
            raise
        if not done:
            await self._give_up(load)
            raise LoadTimedOut(
                f"load and warm-up did not finish within load_timeout_s ({timeout_s:g} s); "
                f"it was {self.load_step}"
            )
        load.result()  # its own error, if it failed

    async def _give_up(self, load: asyncio.Future[None]) -> None:
        # Marked before the cancellation runs the load's own cleanup, which then
        # stops what it started without waiting for it (stop_timeout_s).
        self.cut_short = True
        load.cancel()
        await asyncio.wait([load])
        if not load.cancelled():
            load.exception()  # an error of its cleanup: the load failed anyway

    @property
    def stop_timeout_s(self) -> float:
        """How long :meth:`unload` waits for the running batch of each instance
        before it gives the instance up (a thread is left, a process killed)."""
        return CUT_SHORT_STOP_S if self.cut_short else STOP_TIMEOUT_S

    async def free_off_loop(self, free: Callable[[], None]) -> None:
        """``free()`` (an engine's unload) on a thread, given up after
        :data:`STOP_TIMEOUT_S`: a handler's ``unload`` that hangs leaves its thread
        running but does not hold up the reload or the stop that unloads it."""
        call = run_off_loop(f"unloading model '{self.label}'", free)
        try:
            await asyncio.wait_for(call, STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning(
                "unloading model %s did not finish within %g s: left running", self.label,
                STOP_TIMEOUT_S,
            )  # fmt: skip

    async def unload(self) -> None:
        """Refuse new work, end what is queued or running, free the model."""
        self.state = ModelState.UNLOADING
        await self._stop()
        self.state = ModelState.UNAVAILABLE

    @abc.abstractmethod
    async def _stop(self) -> None:
        """What :meth:`unload` stops and frees, in order (a part never started is skipped)."""

    @staticmethod
    def reconfigurable(old: ModelConfig, new: ModelConfig) -> bool:
        """Whether ``new`` can be applied to a runtime of ``old`` in place, without
        a new runtime (the reloader asks the runtime's own class). Here: only
        ``load_timeout_s``, which bounds a load that is over."""
        return load_timeout_only(old, new)

    def reconfigure(self, config: ModelConfig) -> None:
        """Apply a config that :meth:`reconfigurable` allows in place.

        Queued requests keep their deadlines; new ones get the new settings.
        """
        assert config.key == self.config.key
        assert type(self).reconfigurable(self.config, config)
        self.config = config
        self.default_timeout_s = self.timeout_of(config)

    def share(self, device: DeviceScheduler | None) -> None:
        """Run batches on ``device``'s shared slots (None: as if the device were this
        model's alone). Only runtimes with a batcher take part; a decoder's steps
        and a pipeline's (each its step models') do not ask a device for slots."""
        del device  # this one has no batcher: nothing runs on the device's slots

    def end_streams(self) -> None:
        """End every queued and running stream now, each with an error its route
        sends (a drain's cut-off). Runtimes that stream (:class:`Generator`,
        :class:`Decoupled`) have streams to end; the others none."""
        return  # nothing streams here

    # --- requests and what is reported ------------------------------------------

    @abc.abstractmethod
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
        """One validated KServe request: its outputs, or its error raised.

        Its deadline is ``arrival + timeout_s``: ``arrival`` is the
        ``time.monotonic()`` at which the frontend read the request's first
        bytes (None: now, for callers that have no earlier time), so the time
        spent before this call counts against it.
        Refusals (queue full, deadline unmeetable or already passed, not ready)
        raise at once; cancelling the awaiting task withdraws the request.
        """

    @abc.abstractmethod
    def metadata(self) -> dict[str, Any]:
        """KServe's model metadata."""

    @abc.abstractmethod
    def triton_config(self) -> dict[str, Any]:
        """The model's config in Triton's ModelConfig vocabulary (its JSON form)."""

    @abc.abstractmethod
    def statistics(self) -> dict[str, Any]:
        """Triton's model statistics (with aserve's own extensions)."""


class Generator(Runtime):
    """A runtime that streams generated text: the contract of the generation routes.

    OpenAI's completions, Triton's generate and the decoupled gRPC infer
    route only to a runtime that is one (``isinstance(rt, Generator)``, tested
    once per request). A route turns its wire request into a prompt or chat
    messages and :class:`SamplingParams`, then::

        seq = await runtime.prepare(params, prompt=...)   # tokenize, validate
        req = runtime.generate(seq, timeout_s, arrival=t)  # admitted or refused at once
        async with req:                                    # leaving early cancels it
            async for delta in req: ...

    ``generation`` holds the model's generation settings (the limits a route
    checks before it reads a body or tokenizes a prompt), ``created`` when the
    runtime was made (seconds since the epoch, OpenAI's ``created``).

    An abstract class, not a ``typing.Protocol``: it is the Runtime contract
    and more, and tested per request, where a protocol's ``isinstance`` costs
    microseconds.
    """

    generation: GenerationConfig
    created: int

    @abc.abstractmethod
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
        """Tokenize ``prompt`` (or render ``messages``, with ``tools`` given to
        the chat template) and validate the request;
        refusals (InvalidArgument, TooLarge, QueueFull, Unavailable) raise here,
        before anything is queued. ``priority`` (vLLM's, lower first) decides
        whether a full queue has room for it."""

    @abc.abstractmethod
    def generate(
        self,
        sequence: EngineSequence,
        timeout_s: float | None = None,
        client_id: str | None = None,
        *,
        arrival: float | None = None,
        priority: int = 0,
    ) -> GenerationRequest:
        """Queue a prepared sequence: its stream (a context manager and an async
        iterator of deltas), or a refusal at once (QueueFull, Unavailable,
        DeadlineExceeded). Its deadline counts from ``arrival``, as
        :meth:`Runtime.infer`'s does; ``priority`` (vLLM's: lower first) orders
        it among the waiting ones."""

    @abc.abstractmethod
    def end_streams(self) -> None:
        """End every queued and running stream now, each with an error its route
        sends (a drain's cut-off); new requests are refused."""

    @abc.abstractmethod
    def choices(self, sequence: EngineSequence, n: int) -> list[EngineSequence]:
        """``sequence`` and ``n - 1`` more of its prompt and settings (a seeded
        one's seeds follow it: seed, seed + 1, ...), for a request with ``n``
        choices; queued together, their prompt is prefilled once."""

    @property
    @abc.abstractmethod
    def template_reads_tools(self) -> bool:
        """Whether the model's chat template renders ``tools`` and the messages'
        tool calls itself (its source names ``tools``); if not, a route that
        has them writes them into the messages as text."""

    @abc.abstractmethod
    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text (a token that is part of a character: U+FFFD
        for the bytes it lacks), for log probabilities' ``token`` fields."""


class Decoupled(Runtime):
    """A runtime that answers a request with any number of responses (Triton's
    decoupled models): the contract of gRPC ``ModelStreamInfer`` and HTTP
    ``generate_stream`` for models of tensors. Its :meth:`Runtime.infer`
    refuses, naming those routes. A route decodes a request as for ``infer``
    (against ``input_specs``), then::

        stream = runtime.stream(inputs, batch_size, timeout_s, arrival=t)  # or refused
        async with stream:                   # leaving early cancels it
            async for outputs in stream: ... # a dict of output arrays per response

    An abstract class, like :class:`Generator`, tested per request.
    """

    @abc.abstractmethod
    def stream(
        self,
        inputs: dict[str, np.ndarray],
        batch_size: int,
        timeout_s: float,
        client_id: str | None = None,
        parameters: dict[str, Any] | None = None,
        *,
        arrival: float | None = None,
    ) -> ResponseStream:
        """Queue a request: its stream of responses, or a refusal at once
        (Unavailable, QueueFull, DeadlineExceeded). Its deadline, ``arrival``
        + ``timeout_s`` as :meth:`Runtime.infer`'s, bounds the wait for the
        stream to start; the stream's error (the handler's, or a cut-off)
        is raised by its iteration."""


def load_timeout_only(old: ModelConfig, new: ModelConfig) -> bool:
    """``new`` differs from ``old`` at most in ``load_timeout_s``."""
    return old.model_copy(update={"load_timeout_s": new.load_timeout_s}) == new


def batching_reconfigurable(old: ModelConfig, new: ModelConfig) -> bool:
    """``new`` differs from ``old`` at most in batching settings that need no
    reload (all but ``max_batch_size``) and in ``load_timeout_s``: the rule of
    runtimes with a batcher. Priority levels and their policies shape the
    queue that holds requests now: they need a new runtime too."""
    ob, nb = old.batching, new.batching
    if ob.max_batch_size != nb.max_batch_size:
        return False
    if (ob.priority_levels, ob.default_priority_level, ob.default_queue_policy,
            ob.priority_queue_policy) != (nb.priority_levels, nb.default_priority_level,
                                          nb.default_queue_policy, nb.priority_queue_policy):  # fmt: skip
        return False
    return load_timeout_only(old.model_copy(update={"batching": new.batching}), new)


def instance_group(name: str, count: int, device: str) -> dict[str, Any]:
    """Triton's ``instance_group`` entry of ``count`` instances on ``device``."""
    group: dict[str, Any] = {"name": name, "count": count}
    if device == "cpu":
        group["kind"] = "KIND_CPU"
    else:
        group["kind"] = "KIND_GPU"
        group["gpus"] = [int(device.partition(":")[2] or 0)]
    return group


def string_parameters(settings: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Settings with no Triton field, as Triton's ``parameters`` (strings)."""
    return {k: {"string_value": str(v)} for k, v in settings}
