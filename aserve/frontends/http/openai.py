"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions
(and /v1/embeddings: :mod:`aserve.frontends.http.embeddings`).

``/v1/models`` lists the decoder models and the models whose config has
``openai.embeddings``.

Handlers run on the loop. Every check that can fail (the body, each field,
the model, tokenizing the prompt, admission) runs before the first byte, and
a failure answers ``{"error": {"message", "type", "param", "code"}}`` with
the status of :data:`aserve.frontends.status.HTTP_STATUS` (``param`` names
the field). Deterministic refusals carry ``x-should-retry: false``, so the
SDK does not send them again.

With ``"stream": true`` the answer is server-sent events: chunks, then (with
``stream_options.include_usage``) one chunk with ``"choices": []`` and the
usage, then ``data: [DONE]``, and the response ends. A failure after the
stream started is sent as ``data: {"error": {...}}`` and the stream ends.
With ``Accept: application/x-ndjson`` the same chunks come as one JSON
object per line, without ``[DONE]``, and a failure as a last line
``{"error": {...}}`` (:mod:`aserve.frontends.http.stream` chooses).
A client that goes away (or whose request is cancelled) cancels its
sequence, which leaves the batch at the next step.

Every field is honoured, or refused with 400 naming it unless its value asks
for nothing (``n: 1``, ``store: false``): the table is
:data:`aserve.frontends.http.openai_fields.FIELDS`, and a field it does not
know is refused too. One choice per request and one prompt per completion
request; ``max_tokens`` / ``max_completion_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop`` (at most 4), ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, log probabilities (chat's ``logprobs``
and ``top_logprobs``, completions' ``logprobs``: laid out by
:mod:`aserve.frontends.http.openai_logprobs`), chat's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (the calls generated under a
grammar and read from the answer: :mod:`aserve.frontends.http.openai_tools`),
and vLLM's extensions
``top_k``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos`` and
``priority`` (an integer, 0 by default: a lower one is admitted to the batch
first, and at a full queue takes the place of a less urgent one waiting; see
:mod:`aserve.loop.continuous`). aserve's own
``timeout_ms`` field bounds the request as the ``aserve-timeout-ms`` header
does (the earlier of the two applies; see
:func:`aserve.frontends.common.resolve_deadline`).

Frontends layer; handlers run on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from aserve.codecs.timeouts import parameter_timeout_s
from aserve.errors import AserveError, ErrorCode, InvalidArgument, NotFound
from aserve.frontends.common import TIMEOUT_HEADER, resolve_deadline, usage
from aserve.frontends.http.embedding_request import embedding_config
from aserve.frontends.http.kit import (
    ARRIVAL_KEY,
    RUNTIME_KEY,
    RouteKit,
    json_response,
)
from aserve.frontends.http.openai_fields import (
    FieldError,
    check_fields,
    check_message_fields,
    check_stream_options,
)
from aserve.frontends.http.openai_format import PARAM, response_schema
from aserve.frontends.http.openai_logprobs import Strings, chat_logprobs, completion_logprobs
from aserve.frontends.http.openai_tools import (
    CallReader,
    ToolPlan,
    check_results,
    history_calls,
    read_answer,
    render_as_text,
    tool_plan,
)
from aserve.frontends.http.stream import DONE, send_all
from aserve.frontends.status import HTTP_STATUS
from aserve.loop.prompt_size import check_prompt_size
from aserve.loop.runtimes.base import Generator, Runtime
from aserve.loop.runtimes.generation import (
    generation_body_limit,
    generation_runtime,
    request_priority,
)
from aserve.types.generation import (
    MAX_LOGPROBS,
    SAMPLING_KEYS,
    BadSetting,
    Delta,
    SamplingParams,
    TokenLogprob,
    sampling_settings,
)

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext
    from aserve.loop.continuous import GenerationRequest

_TYPES = {
    ErrorCode.INVALID_ARGUMENT: "invalid_request_error",
    ErrorCode.NOT_FOUND: "invalid_request_error",
    ErrorCode.TOO_LARGE: "invalid_request_error",
    ErrorCode.QUEUE_FULL: "rate_limit_error",
    ErrorCode.UNAVAILABLE: "server_overloaded",
    ErrorCode.DEADLINE_EXCEEDED: "timeout_error",
    ErrorCode.CANCELLED: "cancelled",
    ErrorCode.UNIMPLEMENTED: "invalid_request_error",
    ErrorCode.INTERNAL: "internal_server_error",
}
_RETRYABLE = (ErrorCode.QUEUE_FULL, ErrorCode.UNAVAILABLE)
_ROLES = ("system", "developer", "user", "assistant", "tool")
_MAX_STOP = 4
MAX_CHOICES = 128  # n and best_of, as OpenAI's; a model's max_num_seqs bounds them too
# Engine messages start with the field they are about: "max_tokens: ...", "messages[0]: ...".
_FIELD_PREFIX = re.compile(r"^([a-z_]+)(?:\[\d+\])?[: ]")
_FIELDS = frozenset(
    {"prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
     "timeout_ms"}
)  # fmt: skip


def error_doc(error: AserveError) -> dict[str, Any]:
    param = getattr(error, "param", None)
    if param is None and error.code is ErrorCode.INVALID_ARGUMENT:
        m = _FIELD_PREFIX.match(error.message)
        if m and m.group(1) in _FIELDS:
            param = m.group(1)
    code: str | None = error.code.value
    if isinstance(error, NotFound):
        code, param = "model_not_found", "model"
    return {
        "error": {
            "message": error.message,
            "type": _TYPES[error.code],
            "param": param,
            "code": code,
        }
    }


def error_response(error: AserveError) -> web.Response:
    headers = {} if error.code in _RETRYABLE else {"x-should-retry": "false"}
    if error.code is ErrorCode.QUEUE_FULL:
        headers["Retry-After"] = "1"
    return web.Response(
        status=HTTP_STATUS[error.code],
        body=orjson.dumps(error_doc(error)),
        content_type="application/json",
        headers=headers,
    )


def add_openai_routes(kit: RouteKit, ctx: FrontendContext) -> None:
    """Register the OpenAI-compatible API."""
    OpenAIApi(kit, ctx).add_routes(kit)


class OpenAIApi:
    def __init__(self, kit: RouteKit, ctx: FrontendContext) -> None:
        self._ctx = ctx
        self._read_json = kit.read_json
        self._max_timeout_s = ctx.config.limits.max_timeout_ms / 1e3

    def add_routes(self, kit: RouteKit) -> None:
        kit.route("GET", "/v1/models", self.list_models)
        kit.route("GET", "/v1/models/{model}", self.get_model)
        completions = kit.counted("openai", self.completions, error_response)
        kit.route("POST", "/v1/completions", completions)
        chat = kit.counted("openai", self.chat_completions, error_response)
        kit.route("POST", "/v1/chat/completions", chat)

    # --- models -----------------------------------------------------------------

    def _models(self) -> dict[str, Runtime]:
        """The decoder models and the models that embed, each at its highest version."""
        latest: dict[str, Runtime] = {}
        for rt in self._ctx.registry:
            if isinstance(rt, Generator) or embedding_config(rt) is not None:
                have = latest.get(rt.name)
                if have is None or int(rt.version) > int(have.version):
                    latest[rt.name] = rt
        return latest

    @staticmethod
    def _model_doc(rt: Runtime) -> dict[str, Any]:
        doc = {"id": rt.name, "object": "model", "created": rt.created, "owned_by": "aserve"}
        if isinstance(rt, Generator):
            doc["max_model_len"] = rt.generation.max_model_len
        return doc

    async def list_models(self, request: web.Request) -> web.Response:
        models = sorted(self._models().items())
        return json_response({"object": "list", "data": [self._model_doc(rt) for _, rt in models]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        rt = self._models().get(name)
        if rt is None:
            return error_response(NotFound(f"The model '{name}' does not exist"))
        return json_response(self._model_doc(rt))

    # --- completions ------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            registry = self._ctx.registry
            body = await self._read_json(request, generation_body_limit(registry))
            model = _model(body)
            try:
                runtime = generation_runtime(registry, model)
            except NotFound:
                raise NotFound(f"The model '{model}' does not exist") from None
            except InvalidArgument as exc:
                raise FieldError("model", exc.message) from None
            request[RUNTIME_KEY] = runtime
            # The prompt's size before any per-token or per-message parsing.
            if chat:
                check_prompt_size(runtime.generation, messages=body.get("messages"))
            else:
                check_prompt_size(runtime.generation, prompt=body.get("prompt"))
            parsed = _parse(body, chat)
            messages, tools = parsed.messages, parsed.tools
            if parsed.tools_in_chat and not runtime.template_reads_tools:
                assert messages is not None
                messages, tools = render_as_text(messages, tools, parsed.parallel), None
            try:
                seq = await runtime.prepare(
                    parsed.params, prompt=parsed.prompt, messages=messages,
                    priority=parsed.priority, tools=tools,
                )  # fmt: skip
            except InvalidArgument as exc:
                # A tool's parameters the grammar engine refuses: the engine names
                # response_format, whose schema it compiles; the request gave tools.
                if parsed.tool_plan is not None and getattr(exc, "param", None) == PARAM:
                    rest = exc.message.removeprefix(PARAM + ": ")
                    raise FieldError("tools", f"tools: a tool's parameters: {rest}") from None
                # The engine names the limit max_tokens; the request may have named it otherwise.
                if parsed.limit_field != "max_tokens" and exc.message.startswith("max_tokens"):
                    rest = exc.message.removeprefix("max_tokens")
                    raise FieldError(parsed.limit_field, parsed.limit_field + rest) from None
                raise
            timeout = resolve_deadline(
                request.headers.get(TIMEOUT_HEADER),
                parsed.timeout_s,
                None,
                runtime.default_timeout_s,
                self._max_timeout_s,
            )
            count = parsed.best_of or parsed.n
            most = runtime.generation.max_num_seqs
            if count > most:
                name = "best_of" if parsed.best_of else "n"
                raise FieldError(
                    name, f"{name}: {count} choices are more than this model runs at once "
                    f"(generation.max_num_seqs {most})",
                )  # fmt: skip
            reqs: list[GenerationRequest] = []
            try:
                for s in runtime.choices(seq, count) if count > 1 else [seq]:
                    reqs.append(
                        runtime.generate(
                            s, timeout, arrival=request[ARRIVAL_KEY], priority=parsed.priority
                        )
                    )
            except AserveError:
                for r in reqs:  # all or none: the choices queued already leave
                    r.cancel()
                raise
        except AserveError as exc:
            return error_response(exc)
        prefix = "chatcmpl-" if chat else "cmpl-"
        head = {
            "id": prefix + uuid.uuid4().hex,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        strings = runtime.token_strings if parsed.logprobs_asked else None
        async with contextlib.AsyncExitStack() as stack:
            for r in reqs:
                await stack.enter_async_context(r)  # leaving cancels every choice
            calls = parsed.tool_plan is not None  # the answer is read for its calls
            if not parsed.stream:
                return await _whole(reqs, head, chat, strings, parsed.n, calls)
            return await _stream(request, reqs, head, chat, parsed.include_usage, strings, calls)


async def _deltas(reqs: list[GenerationRequest]) -> AsyncIterator[tuple[int, Delta]]:
    """Each choice's deltas as they come, with the choice's index. Several
    choices are read at once, each by a task that hands its deltas over one
    at a time: a slow reader holds every choice back (their channels fill and
    their sequences pause) rather than buffer here."""
    if len(reqs) == 1:
        async for delta in reqs[0]:
            yield 0, delta
        return
    handed: asyncio.Queue[tuple[int, Delta | None, AserveError | None]] = asyncio.Queue(1)

    async def read(index: int, req: GenerationRequest) -> None:
        try:
            async for delta in req:
                await handed.put((index, delta, None))
        except AserveError as exc:
            await handed.put((index, None, exc))
            return
        await handed.put((index, None, None))

    readers = [asyncio.create_task(read(i, r)) for i, r in enumerate(reqs)]
    try:
        left = len(reqs)
        while left:
            index, delta, error = await handed.get()
            if error is not None:
                raise error
            if delta is None:
                left -= 1
            else:
                yield index, delta
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


class _Choice:
    """One choice's text, tokens and log probabilities so far, and its last delta."""

    __slots__ = ("ids", "last", "logprobs", "parts")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.last: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.parts.append(delta.text)
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        self.last = delta

    @property
    def score(self) -> float:
        """best_of's rank: the log probability of everything it generated."""
        return sum(float(lp) for lp, _ in self.logprobs)


def _usage(lasts: list[Delta | None]) -> dict[str, Any]:
    """Usage of a request's choices: the prompt once, every choice's tokens, and
    the prompt tokens the prefix cache gave (the first choice's: the others
    copied its prompt)."""
    first = next((d for d in lasts if d is not None), None)
    cached = {"cached_tokens": first.cached_tokens if first else 0}
    if len(lasts) == 1:
        return {**usage(lasts[0]), "prompt_tokens_details": cached}
    prompt = first.prompt_tokens if first else 0
    completion = sum(d.completion_tokens for d in lasts if d is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": cached,
    }


async def _whole(
    reqs: list[GenerationRequest],
    head: dict[str, Any],
    chat: bool,
    strings: Strings | None,
    n: int,
    calls: bool = False,
) -> web.Response:
    got = [_Choice() for _ in reqs]
    try:
        async for index, delta in _deltas(reqs):
            got[index].add(delta)
    except AserveError as exc:
        return error_response(exc)
    # best_of: the n whose generations are the most likely, in that order.
    kept = got if len(got) == n else sorted(got, key=lambda c: c.score, reverse=True)[:n]
    choices = []
    for index, c in enumerate(kept):
        text = "".join(c.parts)
        reason = c.last.finish_reason if c.last else None
        lp = _logprobs(chat, c.ids, c.logprobs, strings)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:  # generated under the tools' grammar: the calls read from it
                message["content"], made, reason = read_answer(text, reason)
                if made:
                    message["tool_calls"] = made
            choices.append(
                {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}
            )
        else:
            choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": reason})
    return json_response({**head, "choices": choices, "usage": _usage([c.last for c in got])})


def _logprobs(
    chat: bool,
    ids: list[int],
    logprobs: list[TokenLogprob] | None,
    strings: Strings | None,
    offset: int = 0,
) -> dict[str, Any] | None:
    """The choice's ``logprobs`` of these tokens: None unless the request asked."""
    if strings is None:
        return None
    if chat:
        return chat_logprobs(ids, logprobs or [], strings)
    return completion_logprobs(ids, logprobs or [], strings, offset)


async def _stream(
    request: web.Request,
    reqs: list[GenerationRequest],
    head: dict[str, Any],
    chat: bool,
    include_usage: bool,
    strings: Strings | None = None,
    calls: bool = False,
) -> web.StreamResponse:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    if include_usage:
        head["usage"] = None
    # Completions: where each choice's next chunk's tokens start, in their texts.
    offsets = [0] * len(reqs)

    def chunk(
        index: int, piece: str | None, reason: str | None, delta: Delta | None = None
    ) -> dict[str, Any]:
        lp = None
        if delta is not None and strings is not None:
            lp = _logprobs(chat, delta.token_ids, delta.logprobs, strings, offsets[index])
            if lp is not None and not chat:
                offsets[index] += sum(len(t) for t in lp["tokens"])
        if chat:
            body = {} if piece is None else {"content": piece}
            choice = {"index": index, "delta": body, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": lp,
                      "finish_reason": reason}  # fmt: skip
        return {**head, "choices": [choice]}

    # Under the tools' grammar: what could be a call is held until its block is complete.
    readers = [CallReader() for _ in reqs] if chat and calls else None

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        lasts: list[Delta | None] = [None] * len(reqs)
        if chat:
            for index in range(len(reqs)):
                first = chunk(index, "", None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield first
        async for index, delta in _deltas(reqs):
            lasts[index] = delta
            # Tokens whose text is held back still send their log probabilities.
            tokens = strings is not None and bool(delta.token_ids)
            if readers is not None:
                reader = readers[index]
                text, made = reader.push(delta.text)
                reason = delta.finish_reason
                if delta.finished:
                    left, reason = reader.end(reason)
                    text += left
                if text or tokens:
                    yield chunk(index, text or None, None, delta)
                first = reader.calls - len(made)
                for k, call in enumerate(made):
                    piece = chunk(index, None, None)
                    piece["choices"][0]["delta"] = {"tool_calls": [{"index": first + k, **call}]}
                    yield piece
                if delta.finished:
                    yield chunk(index, None, reason)
            elif chat:
                if delta.text or tokens:
                    yield chunk(index, delta.text, None, delta)
                if delta.finished:
                    yield chunk(index, None, delta.finish_reason)
            elif delta.text or delta.finished or tokens:
                yield chunk(index, delta.text, delta.finish_reason, delta)
        if include_usage:
            yield {**head, "choices": [], "usage": _usage(lasts)}

    return await send_all(request, chunks(), error_doc, DONE)


# --- request parsing -------------------------------------------------------------------


class _Parsed:
    __slots__ = (
        "best_of", "include_usage", "limit_field", "logprobs_asked", "messages", "n", "parallel",
        "params", "priority", "prompt", "stream", "timeout_s", "tool_plan", "tools",
        "tools_in_chat",
    )  # fmt: skip

    def __init__(self) -> None:
        self.prompt: str | list[int] | None = None
        self.messages: list[dict[str, Any]] | None = None
        self.params = SamplingParams()
        self.stream = False
        self.include_usage = False
        self.timeout_s: float | None = None  # aserve's timeout_ms field, if given
        self.priority = 0  # vLLM's: lower is admitted first
        self.limit_field = "max_tokens"  # or max_completion_tokens, as the request named it
        self.n = 1  # choices answered
        self.best_of: int | None = None  # completions: choices generated, the n best kept
        self.logprobs_asked = False  # the answer shows log probabilities
        self.tool_plan: ToolPlan | None = None  # chat: the grammar of the calls
        self.tools: list[dict[str, Any]] | None = None  # chat: given to the template
        self.parallel = True  # chat: several calls in one answer
        self.tools_in_chat = False  # chat: tools, or calls or results in the history


def _parse(body: dict[str, Any], chat: bool) -> _Parsed:
    """Validate the fields in OpenAI's terms; every error names its field."""
    out = _Parsed()
    _model(body)
    check_fields(body, "chat" if chat else "completions")
    if chat:
        out.messages, out.tools_in_chat = _messages(body.get("messages"))
    else:
        out.prompt = _prompt(body.get("prompt"))

    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise FieldError("stream", f"must be true or false (got {stream!r})")
    out.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not out.stream:
            raise FieldError("stream_options", "is only allowed when stream is true")
        if not isinstance(options, dict):
            raise FieldError("stream_options", "must be an object")
        check_stream_options(options, "chat" if chat else "completions")
        include = options.get("include_usage", False)
        if not isinstance(include, bool):
            raise FieldError("stream_options", "include_usage must be true or false")
        out.include_usage = include

    limit = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        limit = "max_completion_tokens"
        given = body.get("max_tokens")
        if given is not None and given != body["max_completion_tokens"]:
            raise FieldError(
                "max_tokens",
                "max_tokens: give max_tokens or max_completion_tokens, not both "
                f"(got {given!r} and {body['max_completion_tokens']!r})",
            )
    out.limit_field = limit
    settings = {k: body.get(k) for k in SAMPLING_KEYS}
    settings["max_tokens"] = body.get(limit)
    seed = settings["seed"]
    if _is_int(seed) and -(2**63) <= seed < 0:
        settings["seed"] = seed + 2**64  # OpenAI's seed is an int64: the same 64 bits
    try:
        kw = sampling_settings(settings, max_stop=_MAX_STOP)
    except BadSetting as exc:
        param = limit if exc.param == "max_tokens" else exc.param
        raise FieldError(param, f"{param}: {exc.message}") from None
    kw["logprobs"] = _logprobs_asked(body, chat)
    out.logprobs_asked = kw["logprobs"] is not None
    out.n = _choices("n", body.get("n"), 1)
    if not chat and body.get("best_of") is not None:
        out.best_of = _choices("best_of", body["best_of"], 1)
        if out.best_of < out.n:
            raise FieldError(
                "best_of", f"best_of: must be at least n ({out.n}) (got {out.best_of})"
            )
        if out.stream and out.best_of > out.n:
            raise FieldError("best_of", "best_of: more than n cannot be streamed")
        if out.best_of > out.n and kw["logprobs"] is None:
            kw["logprobs"] = 0  # best_of ranks the choices by their tokens' log probabilities
    if (fmt := body.get("response_format")) is not None:  # off the common path's walk
        kw["json_schema"] = response_schema(fmt)
    if chat and (
        body.get("tools") or body.get("tool_choice") is not None
        or body.get("parallel_tool_calls") is not None
    ):  # fmt: skip
        parallel = body.get("parallel_tool_calls")
        out.tool_plan, out.tools = tool_plan(body.get("tools"), body.get("tool_choice"), parallel)
        out.parallel = parallel is not False
        out.tools_in_chat |= out.tools is not None
        if out.tool_plan is not None:
            if kw.get("json_schema") is not None:
                raise FieldError(
                    "response_format", "response_format: give it or tools (with a tool_choice "
                    "other than 'none'), not both",
                )  # fmt: skip
            kw["grammar"] = out.tool_plan.grammar
    out.params = SamplingParams(**kw)
    try:
        out.priority = request_priority(body.get("priority"))
    except BadSetting as exc:
        raise FieldError("priority", f"priority: {exc.message}") from None
    if body.get("timeout_ms") is not None:
        try:
            out.timeout_s = parameter_timeout_s({"timeout_ms": body["timeout_ms"]})
        except InvalidArgument as exc:
            raise FieldError("timeout_ms", exc.message) from None
    return out


def _logprobs_asked(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives per token the request asks log probabilities for
    (None: no log probabilities): chat's ``logprobs`` (true or false) and
    ``top_logprobs``, completions' ``logprobs`` (a count; false as null)."""
    asked = body.get("logprobs")
    if not chat:
        if asked is None or asked is False:
            return None
        return _count("logprobs", asked)
    if asked is not None and not isinstance(asked, bool):
        raise FieldError("logprobs", f"logprobs: must be true or false (got {asked!r})")
    top = body.get("top_logprobs")
    nothing = top is None or (_is_int(top) and top == 0)  # clients send 0 by default
    if not nothing and not asked:
        raise FieldError("top_logprobs", "top_logprobs: is only allowed when logprobs is true")
    if not asked:
        return None
    return 0 if top is None else _count("top_logprobs", top)


def _choices(param: str, value: Any, default: int) -> int:
    """``n`` or ``best_of``: 1 to MAX_CHOICES (null: ``default``)."""
    if value is None:
        return default
    if not _is_int(value) or not 1 <= value <= MAX_CHOICES:
        raise FieldError(
            param, f"{param}: must be an integer from 1 to {MAX_CHOICES} (got {value!r})"
        )
    return value


def _count(param: str, value: Any) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise FieldError(
            param, f"{param}: must be an integer from 0 to {MAX_LOGPROBS} (got {value!r})"
        )
    return value


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise FieldError("model", "is required (a model name from /v1/models)")
    return model


def _prompt(value: Any) -> str | list[int]:
    """One prompt: a string, or token ids; a list of one of those is that one."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return value
    if (
        isinstance(value, list)
        and len(value) > 1
        and all(isinstance(p, (str, list)) for p in value)
    ):
        raise FieldError(
            "prompt", f"one prompt per request is supported (got {len(value)}); send one each"
        )
    if value is None:
        raise FieldError("prompt", "is required")
    raise FieldError("prompt", "must be a string, a list of token ids, or a list of one of those")


def _messages(value: Any) -> tuple[list[dict[str, Any]], bool]:
    """The chat's messages, checked, and whether any has tool calls or a tool's result."""
    if not isinstance(value, list) or not value:
        raise FieldError("messages", "must be a non-empty list of messages")
    out = []
    tooled = False
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise FieldError("messages", f"{where} must be an object")
        check_message_fields(m, where)
        role = m.get("role")
        if role not in _ROLES:
            raise FieldError(
                "messages", f"{where}.role must be one of {', '.join(_ROLES)} (got {role!r})"
            )
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise FieldError(
                        "messages",
                        f"{where}.content[{j}]: only text parts are supported (got {kind!r})",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            if role != "assistant":
                raise FieldError("messages", f"{where}.content is required")
            content = ""
        elif not isinstance(content, str):
            raise FieldError(
                "messages", f"{where}.content must be a string or a list of text parts"
            )
        msg: dict[str, Any] = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):  # given to the chat template as they are
            if (text := m.get(key)) is not None:
                if not isinstance(text, str):
                    raise FieldError("messages", f"{where}.{key} must be a string")
                msg[key] = text
        calls = m.get("tool_calls")
        if calls is not None and calls != []:
            if role != "assistant":
                raise FieldError("messages", f"{where}.tool_calls: only an assistant calls tools")
            msg["tool_calls"] = history_calls(calls, where)
            tooled = True
        elif role == "tool":
            if "tool_call_id" not in msg:
                raise FieldError("messages", f"{where}.tool_call_id is required in a tool message")
            tooled = True
        out.append(msg)
    if tooled:
        check_results(out)
    return out, tooled


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
