"""The JSON config's schema: frozen pydantic models, one per block.

Layer ``config`` (above ``types`` and ``errors`` only): pure values, validated
once when a config is loaded and read anywhere afterwards (loop, executor
threads, child processes get them as dicts). A config is immutable once
loaded. Unknown keys are errors. Checks that need files, engines or handler
modules are :mod:`aserve.engines.checks`'s; reading files and formatting
errors is :mod:`aserve.config.load`'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from aserve.types.tensors import DATATYPES

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]  # fmt: skip
assert set(Datatype.__args__) == set(DATATYPES)  # type: ignore[attr-defined]

_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$"
_DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+)$")
_HANDLER = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HttpConfig(_Frozen):
    """Where the KServe V2 REST frontend listens."""

    host: str = "127.0.0.1"
    """The address it binds (``0.0.0.0``: every interface)."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8000  # 0 picks a free port
    header_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 10.0
    """Time a new connection has to send its first complete request head
    (request line and headers); one that has not is closed."""
    body_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 60.0
    """Time a request has to send its whole body once its head is complete;
    past it the request is answered 408 and its connection closed. (A body
    trickled in holds a ``limits.max_concurrency`` slot while it is read.)"""
    keepalive_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 75.0
    """Time an idle kept-alive connection stays open after its last answer:
    longer than common load balancers' idle timeouts (60 s), so that they,
    not aserve, close idle connections and never reuse one aserve closed."""
    workers: Annotated[int, Field(ge=0, le=64)] = 0
    """Frontend processes that accept and serve the HTTP connections, each with
    its own event loop, handing requests to the one core process (its loop
    owns the models, batchers and every request's future). ``0``: the core
    serves HTTP itself, on its own loop. With ``N > 0`` the core binds the
    port and the frontends share the listening socket; a frontend that exits
    is restarted. ``limits.max_connections``, ``max_pending_connections`` and
    the header and keep-alive timeouts then apply in each frontend; the other
    limits and the API keys stay the core's, server-wide. HTTP only: gRPC is
    served by the core as before (its frontends are a later step)."""


class GrpcConfig(_Frozen):
    """Where the KServe V2 gRPC frontend listens (on the same loop as HTTP)."""

    host: str = "127.0.0.1"
    """The address it binds (``0.0.0.0``: every interface)."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8001  # 0 picks a free port


class LimitsConfig(_Frozen):
    """Server-wide limits; a request over one is refused at once.

    ``max_request_bytes`` bounds an HTTP body and a gRPC message (each message
    of a stream) alike. The others are off unless set.
    """

    max_request_bytes: Annotated[int, Field(ge=1)] = 64 * 1024 * 1024
    max_connections: Annotated[int | None, Field(ge=1)] = None
    """HTTP connections open at once, and gRPC inference calls (unary or
    streams) in flight at once: each frontend refuses those over it (HTTP 429
    on the connection's first request, which closes it; gRPC RESOURCE_EXHAUSTED).
    An HTTP connection counts once it has sent a complete request head; those
    that have not yet are bounded by ``max_pending_connections`` instead."""
    max_pending_connections: Annotated[int, Field(ge=1)] = 1024
    """HTTP connections open at once that have not sent a complete request
    head yet (each has ``http.header_timeout_s`` to do so). A new one over it
    closes the one waiting longest, so idle or trickling sockets cannot keep
    out clients that send their request at once."""
    max_timeout_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600_000.0
    """The longest deadline a request gets, whatever it asks for (header,
    parameter, gRPC deadline) or its model's default is."""
    max_concurrency: Annotated[int | None, Field(ge=1)] = None
    """Inference requests being served at once, both frontends together (a
    stream's requests each count; a generation counts until its stream ends);
    more are refused: HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED."""
    max_tensor_elements: Annotated[int | None, Field(ge=1)] = None
    """Elements of one input tensor, batch dimension included; a larger
    input is refused: HTTP 413, gRPC RESOURCE_EXHAUSTED."""
    max_inflight_bytes: Annotated[int | None, Field(ge=1)] = None
    """Bytes of HTTP request bodies held at once, every route together, from
    a body's first bytes until its answer is sent (a body counts what of it
    arrived and what it inflated to, never its declared Content-Length); a
    request whose bytes would pass it is refused: HTTP 429 with Retry-After
    (what is left of its body is read and dropped). On by default: None means
    ``INFLIGHT_BODIES`` times ``max_request_bytes`` (256 MiB at the
    defaults). gRPC messages are bounded by ``max_request_bytes`` alone."""

    @model_validator(mode="after")
    def _inflight_fits_a_body(self) -> Self:
        if self.max_inflight_bytes is not None and self.max_inflight_bytes < self.max_request_bytes:
            raise ValueError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) is under max_request_bytes "
                f"({self.max_request_bytes}): a body of the largest size could never be read; "
                "raise it, or leave it out for the default"
            )
        return self

    @property
    def inflight_bytes_limit(self) -> int:
        """``max_inflight_bytes``, or its default."""
        if self.max_inflight_bytes is not None:
            return self.max_inflight_bytes
        return INFLIGHT_BODIES * self.max_request_bytes


# The default max_inflight_bytes, in bodies of max_request_bytes: a few of the
# largest at once, and thousands of ordinary ones.
INFLIGHT_BODIES = 4


class TensorSpec(_Frozen):
    """One input or output of a model. ``shape`` excludes the batch dimension."""

    name: Annotated[str, Field(pattern=_NAME)]
    """The tensor's name in requests and answers."""
    datatype: Datatype
    """Its KServe V2 datatype."""
    shape: list[int]

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        for d in shape:
            if d != -1 and d < 1:
                raise ValueError(f"dimension {d} must be >= 1, or -1 for a variable size")
        return shape


class QueuePolicy(_Frozen):
    """How one priority level's requests wait (Triton's ``ModelQueuePolicy``).

    ``default_timeout_microseconds`` is the timeout of a request at this level
    that names none (None: ``batching.timeout_ms``; a request that names exactly
    ``batching.timeout_ms`` counts as naming none); ``allow_timeout_override``
    false makes it the timeout whatever the request names. ``timeout_action``
    says what happens at the deadline to a request still queued: ``REJECT``
    answers it with a timeout (504); ``DELAY`` keeps it queued behind every
    request of any level still within its deadline, for as long again as its
    timeout, then times it out. ``max_queue_size`` bounds this level's queued
    requests (None: only ``batching.max_queue_size``, every level together).
    """

    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    default_timeout_microseconds: Annotated[int | None, Field(ge=1)] = None
    allow_timeout_override: bool = True
    max_queue_size: Annotated[int | None, Field(ge=1)] = None


class BatchingConfig(_Frozen):
    """Dynamic batching of one model.

    ``max_delay_ms`` bounds how long a request may wait for company; with an
    instance idle the batcher waits only when the measured latencies say a
    bigger batch pays and requests arrive fast enough to fill it.

    Priorities, as Triton has them: with ``priority_levels`` N above 0, a request's
    ``priority`` parameter is a level from 1 (the highest) to N; 0 or none means
    ``default_priority_level``. A higher level is batched and scheduled first
    (earliest deadline first within a level); each level's queue follows its
    policy in ``priority_queue_policy`` (keys: levels), else ``default_queue_policy``.
    """

    max_batch_size: Annotated[int, Field(ge=1)] = 32
    """The largest batch the batcher cuts (a request's own batch dimension counts)."""
    max_delay_ms: Annotated[float, Field(ge=0)] = 2.0
    preferred_batch_sizes: list[int] = []
    """Sizes a batch is cut at once the queue holds one (the largest that fits)."""
    max_queue_size: Annotated[int, Field(ge=1)] = 1024
    """Requests waiting; past it a request is refused at once (429)."""
    timeout_ms: Annotated[float, Field(gt=0)] = 5000.0
    """The deadline of a request that names none (at most ``limits.max_timeout_ms``)."""
    priority_levels: Annotated[int, Field(ge=0, le=1000)] = 0
    default_priority_level: Annotated[int, Field(ge=0)] = 0
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: dict[Annotated[int, Field(ge=1)], QueuePolicy] = {}

    @model_validator(mode="after")
    def _preferred_fit(self) -> BatchingConfig:
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                raise ValueError(
                    f"preferred_batch_sizes: {size} must be between 1 and "
                    f"max_batch_size ({self.max_batch_size})"
                )
        return self

    @model_validator(mode="after")
    def _levels_fit(self) -> BatchingConfig:
        levels = self.priority_levels
        if levels == 0:
            if self.default_priority_level or self.priority_queue_policy:
                raise ValueError(
                    "default_priority_level and priority_queue_policy need priority_levels > 0"
                )
            return self
        if not 1 <= self.default_priority_level <= levels:
            raise ValueError(
                f"default_priority_level ({self.default_priority_level}) must be between 1 and "
                f"priority_levels ({levels})"
            )
        outside = sorted(k for k in self.priority_queue_policy if k > levels)
        if outside:
            raise ValueError(
                f"priority_queue_policy: level(s) {outside} above priority_levels ({levels})"
            )
        return self

    def queue_policy(self, level: int) -> QueuePolicy:
        """The policy of priority ``level`` (1..priority_levels)."""
        return self.priority_queue_policy.get(level, self.default_queue_policy)


class SequenceControls(_Frozen):
    """Which declared inputs the server fills for a sequence's request (Triton's
    ``control_input``): each names one of the model's ``inputs``, of shape [1],
    left out of what a client sends. ``start`` is 1 on a sequence's first
    request, ``end`` on its last, ``ready`` 1 on every request (0 on a padding
    row of a ``direct`` batch), ``corrid`` the sequence's id (UINT64 or INT64
    for a numeric id, BYTES for a string one). Each is None when not used."""

    start: Annotated[str | None, Field(pattern=_NAME)] = None
    """The input that is 1 on a sequence's first request, else 0."""
    end: Annotated[str | None, Field(pattern=_NAME)] = None
    """The input that is 1 on a sequence's last request, else 0."""
    ready: Annotated[str | None, Field(pattern=_NAME)] = None
    """The input that is 1 on every request of a sequence."""
    corrid: Annotated[str | None, Field(pattern=_NAME)] = None
    """The input that holds the sequence's id (its correlation id)."""

    def named(self) -> list[tuple[str, str]]:
        """(kind, input name) of each control given."""
        kinds = (("start", self.start), ("end", self.end), ("ready", self.ready),
                 ("corrid", self.corrid))  # fmt: skip
        return [(k, n) for k, n in kinds if n is not None]


class SequenceState(_Frozen):
    """One implicit state of a sequence (Triton's ``state``): the model's output
    ``output`` is kept by the server after each request and fed back as its
    input ``input`` on the sequence's next one; the first request gets
    ``initial_value`` everywhere. Both are declared tensors of the same
    datatype and shape; neither travels to or from the client."""

    input: Annotated[str, Field(pattern=_NAME)]
    """The input that receives the state."""
    output: Annotated[str, Field(pattern=_NAME)]
    """The output that holds the next state."""
    initial_value: float = 0.0
    """Every element of the state on a sequence's first request."""


class SequenceBatchingConfig(_Frozen):
    """Sequence batching for a stateful model (Triton's sequence batcher).

    Each request names its sequence with the parameters ``sequence_id`` (a
    positive integer below 2**64, or a non-empty string), ``sequence_start``
    and ``sequence_end``; a sequence holds a slot from its start to its end.
    A sequence's requests run in order, one at a time; requests of different
    sequences are batched together by the model's batcher (``batching``), a
    batch never holding two of one sequence.

    ``direct`` gives each sequence a slot of its own among ``max_batch_size``
    times ``instances`` (its index is the handler's ``request.sequence.slot``),
    bound to one instance and batch row: a model of tensors on instance
    threads gets each request at its sequence's row, padding between;
    ``oldest`` lets up to ``max_candidate_sequences`` sequences be active at
    once. A start that finds every slot held waits for one until its
    deadline, then is refused (503); ``batching.max_queue_size`` starts may
    wait at most (past it: 429). A sequence with no request for
    ``max_sequence_idle_microseconds`` is ended and its slot freed.
    """

    strategy: Literal["direct", "oldest"] = "direct"
    """How slots are counted: one per batch row of each instance, each sequence
    on its own row (``direct``), or ``max_candidate_sequences`` (``oldest``)."""
    max_candidate_sequences: Annotated[int | None, Field(ge=1, le=1_000_000)] = None
    """``oldest`` only: sequences active at once (default: max_batch_size times
    instances)."""
    max_sequence_idle_microseconds: Annotated[int, Field(ge=1)] = 1_000_000
    """How long a sequence may go without a request before it is ended and its
    slot freed (Triton's default: one second)."""
    control_inputs: SequenceControls = SequenceControls()
    state: list[SequenceState] = []
    """Implicit states: outputs kept by the server and fed back as inputs."""

    @model_validator(mode="after")
    def _candidates_for_oldest(self) -> SequenceBatchingConfig:
        if self.max_candidate_sequences is not None and self.strategy != "oldest":
            raise ValueError(
                "max_candidate_sequences: only for strategy 'oldest' (with 'direct' a "
                "sequence has a batch slot: max_batch_size times instances of them)"
            )
        return self

    def hidden_inputs(self) -> set[str]:
        """The inputs the server fills: controls and states, never sent by a client."""
        return {n for _, n in self.control_inputs.named()} | {s.input for s in self.state}


class PipelineStep(_Frozen):
    """One step of a pipeline: a model, and how its tensors map to the pipeline's.

    ``inputs`` maps the step model's input names to pipeline tensor names
    (an input not listed takes the tensor of its own name); ``outputs`` maps
    the step model's output names to the names they are published under
    (when empty, every output is published under its own name).
    """

    model: Annotated[str, Field(pattern=_NAME)]
    """The config's model this step runs."""
    version: Annotated[str | None, Field(pattern=r"^[0-9]+$")] = None  # None: the highest
    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}


# Text per token of a prompt, for the default max_prompt_bytes: English runs about
# 4 bytes a token, code and other scripts up to ~8; 32 leaves room for runs of
# whitespace and long tokens while bounding what one request makes us tokenize.
PROMPT_BYTES_PER_TOKEN = 32


_MiB = 2**20


class CheckpointLimits(_Frozen):
    """What a decoder model folder may declare (``generation.checkpoint_limits``).

    Checked before anything is built from it: the sizes in ``config.json``
    before a layer is made, the size of each file before it is read. The
    defaults hold the largest GPT-2 and Llama checkpoints published (Llama
    3.1 405B: 126 layers, hidden size 16384, MLP 53248); raise one for a
    model past them. The weights the sizes imply are checked against the
    safetensors files' headers before any weight is read, so these bound only
    the work of getting that far.
    """

    max_layers: Annotated[int, Field(ge=1)] = 1024
    """Most transformer blocks (``n_layer``, ``num_hidden_layers``)."""
    max_hidden_size: Annotated[int, Field(ge=1)] = 65536
    """Largest hidden size (``n_embd``, ``hidden_size``) and ``head_dim``."""
    max_heads: Annotated[int, Field(ge=1)] = 1024
    """Most attention heads (``n_head``, ``num_attention_heads``,
    ``num_key_value_heads``)."""
    max_intermediate_size: Annotated[int, Field(ge=1)] = 1_048_576
    """Widest MLP (``n_inner``, ``intermediate_size``)."""
    max_vocab_size: Annotated[int, Field(ge=1)] = 2_097_152
    """Largest vocabulary (``vocab_size``)."""
    max_positions: Annotated[int, Field(ge=1)] = 16_777_216
    """Longest context the model may declare (``n_positions``,
    ``max_position_embeddings``); what is allocated follows ``max_model_len``."""
    max_tokenizer_bytes: Annotated[int, Field(ge=1)] = 16 * _MiB
    """Largest ``tokenizer.json``. ``tokenizers`` holds the GIL while it
    builds a tokenizer, so the event loop stops for as long as that takes
    (about 50-80 ms per MiB measured on 2 cores): a larger file is refused
    before it is read. Llama 3's is 9 MB."""
    max_config_file_bytes: Annotated[int, Field(ge=1)] = 4 * _MiB
    """Largest ``config.json``, ``generation_config.json``,
    ``tokenizer_config.json``, ``model.safetensors.index.json`` and
    ``chat_template.jinja``, each refused before it is read."""


class GenerationConfig(_Frozen):
    """Capacity and limits of one decoder model (its ``"generation"`` block).

    The KV cache is preallocated for ``max_num_seqs`` x ``max_model_len``
    positions per layer, so these two numbers fix the engine's memory.
    """

    max_num_seqs: Annotated[int, Field(ge=1, le=4096)] = 32
    """Sequences decoded together (KV-cache slots)."""
    max_model_len: Annotated[int, Field(ge=2)] = 2048
    """Longest sequence, prompt plus generated tokens, in tokens."""
    max_tokens_default: Annotated[int, Field(ge=1)] = 256
    """Generated tokens when a request does not say ``max_tokens``."""
    max_tokens_cap: Annotated[int, Field(ge=1)] = 4096
    """Most tokens a request may ask for; a larger ``max_tokens`` is refused."""
    max_prefill_tokens: Annotated[int, Field(ge=1)] = 2048
    """Prompt tokens one step may prefill. The first sequence a step admits
    is admitted whatever its length, so a long prompt is never starved."""
    max_num_batched_tokens: Annotated[int | None, Field(ge=1)] = None
    """Chunked prefill: most tokens one engine step feeds, each running
    sequence's decode one and prompt tokens the rest (at least one). A prompt
    that does not fit is prefilled over several steps while the running
    sequences go on decoding, so a long prompt delays their next tokens by
    about one chunk's prefill instead of its whole prefill; the long prompt's
    own first token comes later. None (the default): every admitted prompt is
    prefilled whole in the step that admits it."""
    max_queue_size: Annotated[int, Field(ge=1)] = 256
    """Sequences waiting for a KV-cache slot; past it a request is refused (429)."""
    prefix_caching: bool = True
    """Reuse the K/V of a prompt prefix already in the KV cache (a system
    prompt, a chat's earlier turns): a new sequence takes the slot that holds
    the longest prefix of its prompt, or a copy of it, and only the rest is
    prefilled. A slot's contents stay when its sequence ends, until another
    takes it (least recently used first); the outputs are the same as
    without it. ``usage.prompt_tokens_details.cached_tokens`` says how many
    prompt tokens were reused. False: every prompt is prefilled whole."""
    prefix_block_tokens: Annotated[int, Field(ge=1, le=1024)] = 16
    """Granularity of prefix caching, in tokens: a prefix is reused in whole
    blocks of this many tokens (smaller finds longer prefixes; each block is
    a hash to compute and look up per prompt)."""
    max_prompt_bytes: Annotated[int | None, Field(ge=1)] = None
    """Largest prompt (UTF-8 bytes of its text, or of a chat's messages) that is
    tokenized; a larger one is refused (413) before any tokenizing. None:
    ``PROMPT_BYTES_PER_TOKEN`` x ``max_model_len``, more than any prompt that
    fits in ``max_model_len`` tokens takes in practice."""
    max_chat_messages: Annotated[int, Field(ge=1)] = 1024
    """Most messages a chat request may hold; more are refused (400) before
    they are read one by one. A chat template writes a role and markers for
    each, so the prompt of a longer chat would not fit in most models' context
    anyway; raise it for a model with a long context and a chat that needs it."""
    max_chat_template_steps: Annotated[int, Field(ge=1)] = 1_000_000
    """Most steps the model's chat template may take to render one chat (a
    step: a turn of a loop, a call, a lookup, an operator, a filter, a piece
    of output); past it the chat is refused (400). A real template takes some
    tens per message; a template that loops for ever stops here."""
    max_chat_template_chars: Annotated[int | None, Field(ge=1)] = None
    """Longest prompt the chat template may write, and largest value (string
    characters, or a container's items) it may make while it runs; past it the
    chat is refused (400). All the text it makes may come to 16 times this.
    None: twice ``max_prompt_bytes``'s limit, at least 1 MiB."""
    chat_template_timeout_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1000.0
    """Longest one render of the chat template may run (on a worker thread, never
    on the event loop); past it the chat is refused (400)."""
    timeout_ms: Annotated[float, Field(gt=0)] = 300_000.0
    """Deadline of a whole generation, waiting included, unless the request sets one."""
    stream_buffer_chunks: Annotated[int, Field(ge=1)] = 32
    """Steps of output a stream's reader may leave unread before its sequence
    is paused: it keeps its slot but is not decoded until the reader catches up."""
    step_process: bool = True
    """Run the engine's steps in a child process of its own (its own GIL), so
    the server's HTTP and gRPC work never slows a step down; false runs them
    on a thread of the server process (less memory, one process fewer)."""
    step_run_ahead: Annotated[int, Field(ge=0, le=64)] = 0
    """Steps the step process may decode on its own past the last answer the
    server has read: it goes on with its running sequences instead of waiting
    for a round trip of the pipe per step, and admissions, cancellations and
    paused readers reach it between any two steps. A few steps hide the loop's
    stalls (a burst of writes to the streams); each one costs at most a token
    of wasted work per cancelled sequence and a token over a paused reader's
    buffer. 0 (the default): one round trip per step. Off by default because,
    measured on 2 cores with the client beside the server (RESULTS-streaming.md),
    it gained at 1 stream and lost at 8 and 32, where the step process that
    never waits took the CPU the server needs to write the streams. The step
    thread never runs ahead."""
    checkpoint_limits: CheckpointLimits = CheckpointLimits()
    """What the model folder may declare; see :class:`CheckpointLimits`."""

    @cached_property
    def prompt_bytes_limit(self) -> int:
        """``max_prompt_bytes``, or what it defaults to.

        Computed once, when the config is validated: every generation request
        reads it on the loop, where a property would be a call per request.
        """
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.max_model_len

    @property
    def chat_template_chars_limit(self) -> int:
        """``max_chat_template_chars``, or what it defaults to (read at load)."""
        if self.max_chat_template_chars is not None:
            return self.max_chat_template_chars
        return max(2 * self.prompt_bytes_limit, _MiB)

    @model_validator(mode="after")
    def _default_within_cap(self) -> GenerationConfig:
        if self.max_tokens_default > self.max_tokens_cap:
            raise ValueError(
                f"max_tokens_default ({self.max_tokens_default}) must be <= "
                f"max_tokens_cap ({self.max_tokens_cap})"
            )
        self.prompt_bytes_limit  # noqa: B018  (cached now, not on the first request)
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy whose ``prompt_bytes_limit`` follows the updated fields, not the
        cached value of this one."""
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("prompt_bytes_limit", None)
        copy.prompt_bytes_limit  # noqa: B018
        return copy


# Engines whose models are not a weights file.
_NO_PATH_ENGINES = ("python", "pipeline")
# Engines whose instances can run in worker processes ("executor": "process").
_PROCESS_ENGINES = ("torch", "python")


_EMBEDDING_OUTPUTS = ("FP16", "FP32", "FP64")
_TOKEN_INPUTS = ("INT32", "INT64")


class EmbeddingsConfig(_Frozen):
    """A model that embeds text, served on OpenAI's ``POST /v1/embeddings``.

    Each item of a request's ``input`` is one request to the model, of batch
    size 1, through its batcher (so items batch with other clients' items):
    the model has this one input, either ``BYTES`` ``[1]`` (one text; the
    model tokenizes it) or ``INT32``/``INT64`` ``[-1]`` (token ids; a request
    sending text to it is refused, as one sending token ids to a text model
    is). Its ``output`` is the embedding, a float vector of fixed size.
    """

    input: Annotated[str, Field(pattern=_NAME)]
    """The model's input an item goes to (its only one): ``BYTES`` ``[1]`` for
    text, ``INT32`` or ``INT64`` ``[-1]`` for token ids."""
    output: Annotated[str, Field(pattern=_NAME)]
    """The output that is the embedding: ``FP16``, ``FP32`` or ``FP64`` of one
    fixed dimension ``[D]``, answered as float32."""
    dimensions: list[Annotated[int, Field(ge=1)]] = []
    """The sizes a request's ``dimensions`` may ask for, each at most ``D``:
    the embedding's first that many values, L2-normalised again (for a model
    trained so that its leading values embed on their own, as Matryoshka
    models are). Empty: only ``D`` itself."""
    token_count_output: Annotated[str | None, Field(pattern=_NAME)] = None
    """An ``INT32``/``INT64`` ``[1]`` output holding how many tokens the model
    made of the item, for ``usage``; without it a token list counts its ids and
    a text its UTF-8 bytes."""
    max_inputs: Annotated[int, Field(ge=1, le=65536)] = 2048
    """The most items one request's ``input`` may hold (OpenAI's limit is 2048);
    more is a 400."""
    max_input_bytes: Annotated[int, Field(ge=1)] = 65536
    """The longest text one item may be, in UTF-8 bytes; longer is a 413."""
    max_input_tokens: Annotated[int, Field(ge=1)] = 8192
    """The most token ids one item may hold; more is a 413."""

    @field_validator("dimensions")
    @classmethod
    def _distinct(cls, sizes: list[int]) -> list[int]:
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"each size once (got {sizes})")
        return sorted(sizes)


class OpenAIConfig(_Frozen):
    """How a model of tensors is offered on the OpenAI-compatible API (a decoder
    model is offered on completions and chat completions without it)."""

    embeddings: EmbeddingsConfig | None = None
    """Serve it on ``/v1/embeddings`` (and list it on ``/v1/models``)."""


def _check_embeddings(m: ModelConfig, e: EmbeddingsConfig) -> None:
    """The model's tensors are what ``openai.embeddings`` says they are."""
    where = "openai.embeddings"
    if m.engine == "decoder" or m.decoupled:
        kind = "a decoder" if m.engine == "decoder" else "a decoupled model"
        raise ValueError(f"{where}: {kind} does not embed (one answer of tensors per input)")
    if m.sequence_batching is not None:
        raise ValueError(
            f"{where}: a sequence-batched model keeps state per sequence; an embedding "
            "request names none (remove sequence_batching)"
        )
    if not (m.inputs and m.outputs):
        raise ValueError(f"inputs, outputs: list them for a model with {where}")
    if [s.name for s in m.inputs] != [e.input]:
        names = ", ".join(s.name for s in m.inputs)
        raise ValueError(
            f"{where}.input: '{e.input}' must be the model's only input (its inputs: {names}); "
            "each item of a request is sent to it alone"
        )
    spec = m.inputs[0]
    text = spec.datatype == "BYTES" and spec.shape == [1]
    tokens = spec.datatype in _TOKEN_INPUTS and spec.shape == [-1]
    if not (text or tokens):
        raise ValueError(
            f"{where}.input: '{e.input}' is {spec.datatype} {spec.shape}; an embedding input is "
            "BYTES [1] (one text) or INT32/INT64 [-1] (token ids)"
        )
    outputs = {s.name: s for s in m.outputs}
    out = outputs.get(e.output)
    if out is None:
        raise ValueError(f"{where}.output: the model has no output '{e.output}'")
    if out.datatype not in _EMBEDDING_OUTPUTS or len(out.shape) != 1 or out.shape[0] < 1:
        raise ValueError(
            f"{where}.output: '{e.output}' is {out.datatype} {out.shape}; an embedding is "
            "FP16, FP32 or FP64 of one fixed dimension [D]"
        )
    size = out.shape[0]
    if e.dimensions and e.dimensions[-1] > size:
        raise ValueError(
            f"{where}.dimensions: {e.dimensions[-1]} is more than the embedding's {size} values"
        )
    if e.token_count_output is not None:
        count = outputs.get(e.token_count_output)
        if count is None or count.datatype not in _TOKEN_INPUTS or count.shape != [1]:
            raise ValueError(
                f"{where}.token_count_output: '{e.token_count_output}' must be an INT32 or "
                "INT64 [1] output of the model"
            )


class ModelConfig(_Frozen):
    """One served model version.

    ``engine`` decides what else is needed: a ``path`` (torch), a ``handler``
    class (python, where ``path`` and ``parameters`` are optional and handed
    to the handler), or ``steps`` (pipeline).
    """

    name: Annotated[str, Field(pattern=_NAME)]
    """The model's name in every route."""
    version: Annotated[str, Field(pattern=r"^[0-9]+$")] = "1"
    """A number: versions are served side by side; a request naming none goes to
    the highest."""
    engine: Literal["torch", "python", "pipeline", "decoder", "onnx", "tensorrt"]
    path: Annotated[str | None, Field(min_length=1)] = None
    # The folder ``path`` and ``handler`` resolve against (default: the config's
    # folder); an ``.aserve`` entry sets it to the extracted archive.
    root: Annotated[str | None, Field(min_length=1)] = None
    handler: Annotated[str | None, Field(pattern=_HANDLER)] = None  # "package.module:Class"
    parameters: dict[str, Any] = {}  # python handlers only: given to load(context)
    steps: list[PipelineStep] = []  # pipelines only
    device: str = "cpu"
    """Where it runs: ``cpu``, ``cuda`` or ``cuda:N``."""
    instances: Annotated[int, Field(ge=1, le=64)] = 1
    """Executor threads (or worker processes) serving the model; on a GPU each
    has its own CUDA stream."""
    # Where the instances run: threads of the server, or one worker process each
    # (the model then never waits for the GIL the event loop holds).
    executor: Literal["thread", "process"] = "thread"
    cpu_threads: Annotated[int, Field(ge=1, le=256)] = 1
    """torch's intra-op threads per instance (1 is best on small machines)."""
    # A decoder model's tensors are fixed (text_input -> text_output); others must list theirs.
    inputs: Annotated[list[TensorSpec], Field(validate_default=True)] = []
    outputs: Annotated[list[TensorSpec], Field(validate_default=True)] = []
    batching: BatchingConfig = BatchingConfig()
    generation: GenerationConfig = GenerationConfig()  # decoder only
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"  # decoder only
    precision: Literal["fp32", "fp16"] = "fp32"  # tensorrt only: of an engine built from .onnx
    cuda_graphs: bool = False  # torch on CUDA only: replay captured graphs per batch size
    load_timeout_s: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = None
    """Longest this model's load and warm-up may take (default: the server's
    ``load_timeout_s``); past it the model fails to load, with that reason."""
    load: Literal["startup", "on_demand"] = "startup"
    """When the model is loaded: with the server (``startup``), or at its first
    request, which waits for it (``on_demand``; the server is ready without it).
    On a device with a ``memory_budget_mib``, an on-demand model idle the
    longest is unloaded when another needs its memory, and loads again at its
    next request; on a device without one it stays loaded once loaded (a lazy
    load). Models loaded at startup count against the budget and are never
    unloaded to make room. Not for pipelines and decoder models."""
    resident: bool = False
    """An on-demand model that, once loaded, is never unloaded to make room
    under the device's memory budget (startup models never are)."""
    decoupled: bool = False
    """A python handler that answers each request with any number of responses
    (none, one or many; Triton's ``model_transaction_policy.decoupled``): its
    ``stream(request)`` yields them. Served over gRPC ``ModelStreamInfer`` and
    HTTP ``generate_stream`` (``/infer`` refuses it). Its streams run in the
    server's threads, ``instances`` of them at once; more wait, by deadline."""
    sequence_batching: SequenceBatchingConfig | None = None
    """Serve the model's requests as sequences of a stateful model (None: each
    request on its own)."""
    openai: OpenAIConfig = OpenAIConfig()
    """How the model is offered on the OpenAI-compatible API
    (``embeddings``: on ``/v1/embeddings``)."""

    @field_validator("inputs", "outputs")
    @classmethod
    def _tensors_for_engine(cls, specs: list[TensorSpec], info: ValidationInfo) -> list[TensorSpec]:
        engine = info.data.get("engine")
        if engine == "decoder" and specs:
            raise ValueError(
                "a decoder model's tensors are fixed (text_input -> text_output): remove this key"
            )
        # An onnx model's tensors may be left out, and a torch.export program's (.pt2):
        # they are read from the model file.
        path = info.data.get("path") or ""
        from_file = engine == "onnx" or (engine == "torch" and path.endswith(".pt2"))
        if engine is not None and engine != "decoder" and not from_file and not specs:
            hint = " (a .pt2 program carries its own)" if engine == "torch" else ""
            raise ValueError(f"required with engine '{engine}': list at least one tensor{hint}")
        return specs

    @field_validator("batching", "instances", "generation", "dtype")
    @classmethod
    def _decoder_fields(cls, value: Any, info: ValidationInfo) -> Any:
        # Runs only for keys the config gives, not for defaults.
        engine = info.data.get("engine")
        if engine is None:
            return value
        if info.field_name in ("generation", "dtype") and engine != "decoder":
            raise ValueError(f"only for engine 'decoder' (this model's engine is '{engine}')")
        if engine == "decoder" and info.field_name == "batching":
            raise ValueError("not for engine 'decoder': its scheduling is set in 'generation'")
        if engine == "decoder" and info.field_name == "instances" and value != 1:
            raise ValueError("engine 'decoder' runs on exactly one instance")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if not _DEVICE.match(device):
            raise ValueError(f"'{device}' is not a device: use cpu, cuda or cuda:N")
        return device

    @model_validator(mode="after")
    def _unique_tensor_names(self) -> ModelConfig:
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [s.name for s in specs]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{kind}: duplicate tensor name(s) {', '.join(dupes)}")
        return self

    @model_validator(mode="after")
    def _engine_fields(self) -> ModelConfig:
        engine = self.engine
        if engine not in _NO_PATH_ENGINES and self.path is None:
            raise ValueError(f"path: required with engine '{engine}'")
        if (engine == "python") != (self.handler is not None):
            raise ValueError(
                "handler: required with engine 'python'"
                if engine == "python"
                else f"handler: only for engine 'python' (this model's engine is '{engine}')"
            )
        if self.executor == "process" and engine not in _PROCESS_ENGINES:
            raise ValueError(
                f"executor: 'process' is for engines {', '.join(_PROCESS_ENGINES)} (this "
                f"model's engine is '{engine}'; a decoder's steps use generation.step_process)"
            )
        if self.parameters and engine != "python":
            raise ValueError(f"parameters: only for engine 'python' (this one is '{engine}')")
        if (engine == "pipeline") != bool(self.steps):
            raise ValueError(
                "steps: a pipeline needs at least one step"
                if engine == "pipeline"
                else f"steps: only for engine 'pipeline' (this model's engine is '{engine}')"
            )
        if engine == "pipeline" and self.path is not None:
            raise ValueError("path: a pipeline has no file; its steps name models")
        if self.load == "on_demand" and engine in ("pipeline", "decoder"):
            raise ValueError(
                f"load: 'on_demand' is for models that run batches (engine '{engine}' loads "
                "at startup; a pipeline's step models may load on demand)"
            )
        if self.load == "on_demand" and not (self.inputs and self.outputs):
            raise ValueError(
                "inputs, outputs: list them for a model with load 'on_demand': its requests "
                "are checked against them before it loads"
            )
        if self.decoupled:
            _check_decoupled(self)
        if self.openai.embeddings is not None:
            _check_embeddings(self, self.openai.embeddings)
        _check_accelerator_fields(self)
        if self.sequence_batching is not None:
            _check_sequence_batching(self, self.sequence_batching)
        return self

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.version)

    def folder(self, base_dir: Path) -> Path:
        """Where this model's ``path`` and ``handler`` resolve: ``root``, else ``base_dir``."""
        return base_dir / self.root if self.root else base_dir


def _check_decoupled(m: ModelConfig) -> None:
    """A decoupled model is a python handler whose streams run in the server's threads."""
    if m.engine != "python":
        raise ValueError(f"decoupled: only for engine 'python' (this one is '{m.engine}')")
    if m.executor != "thread":
        raise ValueError(
            "decoupled: a decoupled handler's streams run in the server's threads: "
            "remove executor 'process'"
        )
    if m.load != "startup":
        raise ValueError("decoupled: a decoupled model loads at startup: remove load 'on_demand'")
    if m.sequence_batching is not None:
        raise ValueError("decoupled: not with sequence_batching yet (a decoupled model's "
                         "requests are each a stream of their own)")  # fmt: skip


# The datatypes a control input may have: a flag's, and the sequence id's.
_FLAG_TYPES = ("BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32",
               "UINT64", "FP16", "FP32", "FP64")  # fmt: skip
_CORRID_TYPES = ("UINT64", "INT64", "BYTES")


def _check_sequence_batching(m: ModelConfig, sb: SequenceBatchingConfig) -> None:
    """Controls and states name declared tensors of a fitting kind."""
    if m.engine in ("pipeline", "decoder"):
        raise ValueError(
            f"sequence_batching: not for engine '{m.engine}' (a pipeline's step models, "
            "and models with tensors, may have it)"
        )
    if m.load == "on_demand":
        raise ValueError(
            "sequence_batching: not with load 'on_demand' yet (an eviction would end the "
            "model's sequences); load it at startup"
        )
    inputs = {s.name: s for s in m.inputs}
    outputs = {s.name: s for s in m.outputs}
    if (sb.control_inputs.named() or sb.state) and not inputs:
        raise ValueError(
            "sequence_batching: list the model's inputs, the control and state inputs among them"
        )
    seen: dict[str, str] = {}
    for kind, name in sb.control_inputs.named():
        where = f"sequence_batching.control_inputs.{kind}"
        if name in seen:
            raise ValueError(f"{where}: input '{name}' is already the {seen[name]} control")
        seen[name] = kind
        spec = inputs.get(name)
        if spec is None:
            raise ValueError(
                f"{where}: '{name}' is not among the model's inputs ({', '.join(inputs)})"
            )
        allowed = _CORRID_TYPES if kind == "corrid" else _FLAG_TYPES
        if spec.datatype not in allowed:
            raise ValueError(
                f"{where}: input '{name}' is {spec.datatype}; a {kind} control is one of "
                f"{', '.join(allowed)}"
            )
        if spec.shape != [1]:
            raise ValueError(f"{where}: input '{name}' has shape {spec.shape}; a control has [1]")
    for i, st in enumerate(sb.state):
        where = f"sequence_batching.state[{i}]"
        spec_in, spec_out = inputs.get(st.input), outputs.get(st.output)
        if spec_in is None:
            raise ValueError(f"{where}.input: '{st.input}' is not among the model's inputs")
        if spec_out is None:
            raise ValueError(f"{where}.output: '{st.output}' is not among the model's outputs")
        if st.input in seen:
            raise ValueError(f"{where}.input: '{st.input}' is the {seen[st.input]} control")
        seen[st.input] = "state"
        if (spec_in.datatype, spec_in.shape) != (spec_out.datatype, spec_out.shape):
            raise ValueError(
                f"{where}: input '{st.input}' ({spec_in.datatype} {spec_in.shape}) and output "
                f"'{st.output}' ({spec_out.datatype} {spec_out.shape}) must have the same "
                "datatype and shape"
            )
        if -1 in spec_in.shape or spec_in.datatype == "BYTES":
            raise ValueError(f"{where}: a state has a fixed shape and a numeric datatype")
    if len(seen) == len(inputs):
        raise ValueError(
            "sequence_batching: every input is a control or a state; a client must send one"
        )


def _check_accelerator_fields(m: ModelConfig) -> None:
    """``precision`` and ``cuda_graphs`` only where they mean something; TensorRT on a GPU."""
    if m.precision != "fp32" and m.engine != "tensorrt":
        raise ValueError(f"precision: only for engine 'tensorrt' (this one is '{m.engine}')")
    if m.engine == "tensorrt":
        if m.device == "cpu":
            raise ValueError("device: the tensorrt engine runs on a GPU: use cuda or cuda:N")
        for spec in (*m.inputs, *m.outputs):
            if -1 in spec.shape:
                raise ValueError(
                    f"'{spec.name}' has shape {spec.shape}: the tensorrt engine needs fixed "
                    "dimensions besides the batch"
                )
    if m.cuda_graphs:
        if m.engine != "torch" or m.device == "cpu":
            raise ValueError(
                f"cuda_graphs: only for engine 'torch' on a CUDA device "
                f"(this model: engine '{m.engine}' on '{m.device}')"
            )
        variable = [s.name for s in m.inputs if -1 in s.shape]
        if variable:
            raise ValueError(
                f"cuda_graphs: needs fixed input shapes; {', '.join(variable)} has a variable "
                "dimension"
            )


class AuthConfig(_Frozen):
    """API keys that every request must carry (HTTP ``Authorization: Bearer KEY``,
    gRPC metadata ``authorization: Bearer KEY``), but those to ``open_paths``.

    Two roles: inference keys (``api_keys_*``) infer and read metadata; admin
    keys (``admin_keys_*``) may do that too, and alone may use the model
    repository API and the config routes. The keys never appear in the
    config: each role's come from an environment variable (comma-separated)
    and/or a file (one per line, ``#`` comments; relative to the config's
    folder), read at startup.
    """

    api_keys_env: Annotated[str | None, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = None
    """The environment variable holding the inference keys."""
    api_keys_file: str | None = None
    """The file holding the inference keys."""
    admin_keys_env: Annotated[str | None, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = None
    """The environment variable holding the admin keys (none: admin routes answer 403)."""
    admin_keys_file: str | None = None
    """The file holding the admin keys."""
    open_paths: list[str] = [
        "/v2/health/live",
        "/v2/health/ready",
        "/metrics",
        "/",  # the dashboard page: no data in it
        "/v2/dashboard/stats",  # what the dashboard polls: no more than /metrics says
    ]
    """HTTP paths served without a key; over gRPC, the health service
    (``grpc.health.v1.Health``) is open while these include a health path."""

    @model_validator(mode="after")
    def _some_source(self) -> AuthConfig:
        sources = (self.api_keys_env, self.api_keys_file, self.admin_keys_env, self.admin_keys_file)
        if all(s is None for s in sources):
            raise ValueError(
                "set api_keys_env and/or api_keys_file, for admin keys admin_keys_env and/or "
                "admin_keys_file (keys never go in the config)"
            )
        if self.admin_keys_env is not None and self.admin_keys_env == self.api_keys_env:
            raise ValueError("admin_keys_env must name another variable than api_keys_env")
        if self.admin_keys_file is not None and self.admin_keys_file == self.api_keys_file:
            raise ValueError("admin_keys_file must name another file than api_keys_file")
        return self


class TlsConfig(_Frozen):
    """TLS for both frontends: a PEM certificate (chain) and its private key,
    relative to the config's folder."""

    cert_file: str
    """The PEM certificate (chain), relative to the config's folder."""
    key_file: str
    """Its private key (PEM), relative to the config's folder."""


class LoggingConfig(_Frozen):
    """What the server logs, and how (the ``"logging"`` block)."""

    format: Literal["text", "json"] = "text"
    """"json": one JSON object per line (time, level, logger, message or fields)."""
    access_log: bool = False
    """One line per answered request: request id, protocol, model, version,
    status, duration, time queued and computing. Off by default: for tiny
    models a log line costs more than the inference."""


class GpuConfig(_Frozen):
    """Memory of each CUDA device the models use (the ``"gpu"`` block).

    Applied through torch's caching allocator, in the server process and in
    every step process; ignored (with a log line) where torch sees no GPU.
    """

    mem_limit_mib: Annotated[int | None, Field(ge=1)] = None
    """Most memory torch may hold on each device. An allocation past it fails
    with torch's out-of-memory error, which fails that batch or step only."""
    empty_cache_interval_s: Annotated[float | None, Field(gt=0)] = None
    """How often cached blocks no tensor uses go back to the driver
    (``torch.cuda.empty_cache``), for other processes on the same GPU."""


class DashboardConfig(_Frozen):
    """The dashboard's history, kept by the server (the ``"dashboard"`` block), so that
    a page opened late still shows the last ``history_s`` seconds."""

    history_s: Annotated[float, Field(ge=10, le=86_400, allow_inf_nan=False)] = 900.0
    """How far back the server's ring of snapshots (and the page's charts) reach."""
    sample_interval_s: Annotated[float, Field(ge=0.1, le=60, allow_inf_nan=False)] = 5.0
    """How often a snapshot goes into the ring; the open page itself polls every second."""

    @model_validator(mode="after")
    def _bounded_ring(self) -> DashboardConfig:
        samples = self.history_s / self.sample_interval_s
        if samples > 3600:
            raise ValueError(
                f"history_s / sample_interval_s is {samples:.0f} snapshots, over the limit 3600: "
                "sample less often or keep less"
            )
        return self


class ArchivesConfig(_Frozen):
    """What an ``.aserve`` archive that a model entry names may write to the cache
    (the ``"archives"`` block); checked from the zip before anything is extracted."""

    max_extracted_bytes: Annotated[int | None, Field(ge=1)] = None
    """An archive's extracted total. None: ``$ASERVE_ARCHIVE_MAX_BYTES``, else
    4 GiB (a handler project with its code and a model of up to some 2 billion
    fp16 parameters); raise it for larger ones."""
    max_compression_ratio: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 100.0
    """How many times its compressed size one member may expand to (members up
    to 4 KiB aside). Weights barely compress (1-3x), code and JSON 3-10x; a
    zip bomb of zeros deflates about 1000x."""


class DeviceConfig(_Frozen):
    """How the models on one device share it (an entry of the ``"devices"`` block).

    ``independent`` (the default): each model has its own instances, which run
    their batches whenever they have one, as if the device were theirs alone.
    ``shared``: at most ``slots`` batches run on the device at once, all its
    models together, and each slot that frees up goes to the batch whose
    deadline comes first among those that can still meet theirs (a higher
    priority level first). ``memory_budget_mib`` bounds the memory the
    device's models hold together, as measured at their loads: before a load
    that would pass it, idle on-demand models are unloaded, in the order
    ``eviction`` says.
    """

    scheduling: Literal["independent", "shared"] = "independent"
    """``independent``: each model runs its batches on its own instances;
    ``shared``: at most ``slots`` batches at once, all the device's models
    together, the next free slot to the most urgent batch."""
    slots: Annotated[int, Field(ge=1, le=256)] = 1
    memory_budget_mib: Annotated[int | None, Field(ge=1)] = None
    eviction: Literal["cost", "lru"] = "cost"
    """Which idle model leaves first to make room under ``memory_budget_mib``:
    ``cost``, the one whose eviction costs least, its recent request rate (a
    request counting half after 30 s) times its mean load time, ties least
    recently used first; ``lru``, the least recently used, whatever its rate.
    Applies in place on a reload."""
    park_evicted: bool | None = None
    """Whether an evicted TorchScript model is parked: its weights released,
    its compiled module, instance and latency estimates kept, and its next
    load reads the weights back from its file (no ``torch.jit.load``, no
    warm-up), what it still holds counted against ``memory_budget_mib``.
    None (the default): on CUDA devices, where what a parked model holds is
    host memory; not on the CPU, where it is the budget's own memory and,
    measured under Zipf traffic, parking left the hot models' tail no better.
    Applies in place on a reload."""


class ServerConfig(_Frozen):
    """The whole server config (the JSON file)."""

    http: HttpConfig = HttpConfig()
    grpc: GrpcConfig | None = None  # absent: no gRPC frontend
    limits: LimitsConfig = LimitsConfig()
    auth: AuthConfig | None = None  # absent: no API keys asked
    tls: TlsConfig | None = None  # absent: plain HTTP and gRPC
    drain_grace_s: Annotated[float, Field(ge=0)] = 5.0
    """After SIGTERM: how long the server, already not ready, serves on before
    its listeners close (load balancers take it out of rotation meanwhile)."""
    drain_timeout_s: Annotated[float, Field(ge=0)] = 30.0
    """Then: how long the requests in flight get to be answered."""
    load_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600.0
    """Longest a model's load and warm-up may take, unless its own
    ``load_timeout_s`` says otherwise; past it the model fails to load (at
    startup the server exits 1, on a reload the change is rejected). Ten
    minutes: a large model read from a network volume or a TensorRT engine
    built from ONNX can take several; raise it for those."""
    gpu: GpuConfig = GpuConfig()
    logging: LoggingConfig = LoggingConfig()
    dashboard: DashboardConfig = DashboardConfig()
    archives: ArchivesConfig = ArchivesConfig()
    devices: dict[str, DeviceConfig] = {}
    """How the models of each device (``cpu``, ``cuda``, ``cuda:N``, named as the
    models name theirs) share it; a device not listed is ``independent``."""
    models: list[ModelConfig] = []

    def device_of(self, model: ModelConfig) -> DeviceConfig:
        """The ``devices`` entry of ``model``'s device (the default when none is listed)."""
        return self.devices.get(model.device, _INDEPENDENT)

    def load_timeout_of(self, model: ModelConfig) -> float:
        """Seconds ``model``'s load and warm-up may take: its own setting, else the server's."""
        return model.load_timeout_s if model.load_timeout_s is not None else self.load_timeout_s

    @field_validator("devices")
    @classmethod
    def _device_names(cls, devices: dict[str, DeviceConfig]) -> dict[str, DeviceConfig]:
        for name in devices:
            if not _DEVICE.match(name):
                raise ValueError(f"'{name}' is not a device: use cpu, cuda or cuda:N")
        return devices

    @model_validator(mode="after")
    def _unique_models(self) -> ServerConfig:
        seen: set[tuple[str, str]] = set()
        for m in self.models:
            if m.key in seen:
                raise ValueError(f"model '{m.name}' version '{m.version}' is configured twice")
            seen.add(m.key)
        return self


_INDEPENDENT = DeviceConfig()
