"""A model's chat template renders at a bounded cost, off the loop (issue 26, item 2).

First the bounded environment alone: real templates render as Jinja's own
sandbox renders them, and hostile ones (loops for hours, values of gigabytes
made in one C call, recursion) are stopped by the bound they pass, while
they run, without the memory they asked for. Then real servers of real model
folders whose ``tokenizer_config.json`` holds a template that loops: chats to
them get a 400 naming the limit, the event loop stays live meanwhile
(``stall_watch``), other models' streams go on untouched, and SIGTERM ends
the server while renders are in flight.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import lm_models
import openai
import pytest
from conftest import ServerProcess, start_server, write_config
from gen_helpers import GENERATION, wait_gen
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from stall_watch import watch_loop

from aserve._proto import aserve_pb2 as apb
from aserve._proto import aserve_pb2_grpc as apb_grpc
from aserve.engines.decoder.chat_template import (
    ChatTemplate,
    RenderBudget,
    TemplateBounds,
    TemplateLimit,
)
from aserve.engines.decoder.template_sizes import value_size
from aserve.engines.decoder.tokenizer import DEFAULT_CHAT_FORMAT
from aserve.errors import Cancelled, InvalidArgument

pytestmark = pytest.mark.timeout(120)

# A chat template of the kind models ship: a namespace, a reversed pass over
# the messages, string methods, filters, a macro, a {% set %} block, tojson.
CHATML = """{%- macro turn(role, text) -%}<|im_start|>{{ role }}\n{{ text }}<|im_end|>\n{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages[::-1] -%}
  {%- if ns.last_user < 0 and m.role == 'user' -%}{%- set ns.last_user = messages|length - loop.index -%}{%- endif -%}
{%- endfor -%}
{%- set header -%}{{ bos_token }}# {{ messages|selectattr('role', 'equalto', 'user')|list|length }} turns{%- endset -%}
{{ header }}
{%- for m in messages -%}
  {%- set text = m['content'] | trim -%}
  {%- if '</think>' in text -%}{%- set text = text.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}
  {{ turn(m.role, text ~ (' (last)' if loop.index0 == ns.last_user else '')) }}
  {%- if m.name is defined %}{{ '%s=%d' % (m.name, loop.index) }}{{ '[{}]'.format(m.name|upper) }}{% endif -%}
{%- endfor -%}
{{ {'n': messages|length, 'roles': messages|map(attribute='role')|unique|list}|tojson }}
{%- for i in range(3) %}{% if i > 1 %}{% break %}{% endif %}{{ i }}{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"""


def _plain(source: str) -> Any:
    """The same template in Jinja's own sandbox, as the tokenizer set it up before."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env.from_string(source)


def _chat(n: int) -> list[dict[str, Any]]:
    roles = ("system", "user", "assistant")
    chat: list[dict[str, Any]] = []
    for i in range(n):
        msg: dict[str, Any] = {
            "role": roles[min(i, 1 + i % 2)],
            "content": f" turn {i} <think>hm</think>\nsaid {i} ",
        }
        if i % 3 == 1:
            msg["name"] = f"u{i}"
        chat.append(msg)
    return chat


@pytest.mark.parametrize("source", [CHATML, lm_models.LLAMA_CHAT_TEMPLATE, DEFAULT_CHAT_FORMAT])
@pytest.mark.parametrize("n", [1, 5, 300])
def test_real_templates_render_as_jinja_renders_them(source: str, n: int) -> None:
    variables = {
        "messages": _chat(n),
        "add_generation_prompt": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    budget = RenderBudget(TemplateBounds())
    got = ChatTemplate(source).render_threadsafe(budget, **variables)
    assert got == _plain(source).render(**variables)
    # Some tens of steps a message: far from the default bound.
    assert TemplateBounds().max_steps - budget.steps_left < 100 * (n + 2)


# What the counting hooks go through, written as templates use it: the same
# text as Jinja's own sandbox gives.
EVERYDAY = [
    "{{ 1 < 2 < 3 }} {{ 3 < 2 < 1 }} {{ 1 == 1.0 != 2 }} {{ [1, 2] == [1, 2] }} {{ (1, 2) < (1, 3) }}",
    "{{ 'a' in 'cat' }} {{ 'role' in messages[0] }} {{ 2 not in [1, 2] }} {{ 1 in {1: 2} }}",
    "{{ 3 in range(5)|map('int') }} {{ 9 in range(5)|select('odd') }} {{ 'x' in undefined_thing }}",
    "{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join('|') }}",
    "{{ messages|rejectattr('role', 'in', ['system'])|list|length }} {{ [3, 1, 2]|select('in', [1, 3])|list }}",
    "{{ messages|map(attribute='role')|unique|list }} {{ messages|sort(attribute='role')|map(attribute='role')|list }}",
    "{{ 'cba'|sort|join }} {{ {'b': 1, 'a': 2}|sort }} {{ {'b': 1, 'a': 2}|dictsort }} {{ [3, 1]|sort(reverse=true) }}",
    "{% for g in messages|groupby('role') %}{{ g.grouper }}={{ g.list|length }};{% endfor %}",
    "{{ [1, 5, 2]|max }} {{ [1, 5, 2]|min }} {{ []|max }} {{ [1, 2]|sum }} {{ 'ab'|list }} {{ {'k': 1}|list }}",
    "{{ range(7)|batch(3)|list }} {{ range(7)|slice(3)|list }} {{ range(7)|batch(3, 'x')|map('join')|list }}",
    "{% for m in messages %}{{ loop.changed(m['role']) }}{{ m.content.count('u') }}{% endfor %}",
    "{{ messages[1:]|length }} {{ (messages[::-1]|first).role }} {{ [1, 2, 3].index(2) }} {{ (1, 1).count(1) }}",
    "{{ [[1], [1]]|unique|list if false else 0 }} {{ [1, 1, 2]|unique|list }} {{ messages[0] is mapping }}",
    "{{ 2 is eq 2 }} {{ 2 is in [2] }} {{ [1] is eq [1] }} {{ 'a' is lower }} {{ 3 is divisibleby 3 }}",
    "{{ []|map('upper')|list }} {{ undefined_thing|list }} {{ undefined_thing|sort }} {{ ''|select|list }}",
]  # fmt: skip


@pytest.mark.parametrize("source", EVERYDAY)
def test_counted_builtins_give_what_jinjas_own_give(source: str) -> None:
    chat = _chat(5)
    got = ChatTemplate(source).render_threadsafe(RenderBudget(TemplateBounds()), messages=chat)
    assert got == _plain(source).render(messages=chat)


# Small bounds: each case trips its bound after little work.
BOUNDS = TemplateBounds(max_steps=200_000, max_chars=1 << 16, timeout_s=3600.0)
STEPS = "generation.max_chat_template_steps"
CHARS = "generation.max_chat_template_chars"
HOSTILE = [
    ("nested loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", STEPS),
    ("a loop's filter", "{% for i in range(100000) if i >= 0 %}"
                        "{% for j in range(100000) if j >= 0 %}{% endfor %}{% endfor %}", STEPS),
    ("recursive loop", "{% for x in range(100000) recursive %}"
                       "{% if x == 0 %}{{ loop(range(100000)) }}{% endif %}{% endfor %}", "recursed"),
    ("macro recursion", "{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", "recursed"),
    ("string times", "{{ 'x' * 10**10 }}", CHARS),
    ("list times", "{% for x in [messages] * 10**9 %}{% endfor %}", CHARS),
    ("power", "{{ 9 ** (10 ** 8) }}", "integer of more than 4096 bits"),
    ("doubling", "{% set ns = namespace(s='x') %}"
                 "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", CHARS),
    ("doubling macro", "{% macro d(s, n) %}{{ d(s + s, n - 1) if n else s|length }}{% endmacro %}"
                       "{{ d('x', 64) }}", CHARS),
    ("join", "{{ range(100000)|join('x' * 60000) }}", CHARS),
    ("str.join", "{% set s = 'x' * 60000 %}{{ s.join(range(20000)|map('string')) }}", CHARS),
    ("replace", "{% set s = 'x' * 60000 %}{{ s|replace('x', s) }}", CHARS),
    ("str.replace", "{% set s = 'x' * 60000 %}{{ s.replace('', s) }}", CHARS),
    ("center", "{{ 'x'|center(10**10) }}", CHARS),
    ("str.ljust", "{{ 'x'.ljust(10**10) }}", CHARS),
    ("expandtabs", "{{ ('\\t' * 60000).expandtabs(60000) }}", CHARS),
    ("to_bytes", "{{ (1).to_bytes(10**10, 'big') }}", CHARS),
    ("percent width", "{{ '%9999999999s' % 'a' }}", CHARS),
    ("percent star", "{{ '%*s' % (10**10, 'a') }}", CHARS),
    ("format filter", "{{ '%9999999999s'|format('a') }}", CHARS),
    ("str.format width", "{{ '{:>9999999999}'.format(1) }}", CHARS),
    ("str.format fields", "{% set s = 'x' * 60000 %}{{ ('{0}' * 100000).format(s) }}", CHARS),
    ("indent", "{{ ('\\n' * 60000)|indent(60000, true, true) }}", CHARS),
    ("batch fill", "{{ range(3)|batch(10**10)|list }}", CHARS),
    ("slice", "{{ range(3)|slice(10**10)|list }}", CHARS),
    ("slices", "{% for i in range(100) %}{{ range(3)|slice(60000)|list|length }}{% endfor %}", "16 x"),
    ("tojson indent", "{{ range(1000)|list|tojson(indent=10**6) }}", CHARS),
    ("list literal", "{% set s = 'x' * 60000 %}{{ [s, s, s, s] }}", CHARS),
    ("dict()", "{% set s = 'x' * 60000 %}{{ dict(a=s, b=s) }}", CHARS),
    ("cycler items", "{% set s = 'x' * 60000 %}{{ cycler(s, s, s).items }}", CHARS),
    ("set block", "{% set b %}{% for i in range(100000) %}{{ 'x' * 60000 ~ i }}{% endfor %}{% endset %}", "16 x"),
    ("output", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", CHARS),
    # C calls that go through a container: charged by its slots before they run.
    ("select in", "{{ ([0]*2000)|select('in', [1]*60000)|list|length }}", STEPS),
    ("in", "{% set b = [1]*60000 %}{% for i in range(100000) %}{% if 0 in b %}{% endif %}{% endfor %}", STEPS),
    ("not in", "{% set b = [1]*60000 %}{% for i in range(100000) if 0 not in b %}{% endfor %}", STEPS),
    ("in a generator", "{% for i in range(100000) if -1 in range(60000)|map('int') %}{% endfor %}", STEPS),
    ("equality", "{% set a = [1]*60000 %}{% set b = [1]*60000 %}"
                 "{% for i in range(100000) %}{% if a == b %}{% endif %}{% endfor %}", STEPS),
    ("chained", "{% set a = [1]*60000 %}{% for i in range(100000) if 0 < 1 < 2 and a <= a >= a %}{% endfor %}", STEPS),
    ("eq test", "{% set b = [1]*60000 %}{% for i in range(100000) if b is eq b %}{% endfor %}", STEPS),
    ("select eq", "{% set b = [1]*30000 %}"
                  "{% for i in range(100) %}{{ [b, b]|select('eq', b)|list|length }}{% endfor %}", STEPS),
    ("sort", "{% set b = [[1]*6000] * 10 %}{% for i in range(1000) %}{{ b|sort|length }}{% endfor %}", STEPS),
    ("unique", "{% set b = [(1,)*6000] * 10 %}"
               "{% for i in range(1000) %}{{ b|unique|list|length }}{% endfor %}", STEPS),
    ("list.count", "{% set b = [1]*60000 %}{% for i in range(100000) %}{{ b.count(1) }}{% endfor %}", STEPS),
    ("hashed key", "{% set k = (1,)*60000 %}{% set d = {} %}{% for i in range(100000) %}{{ d[k] }}{% endfor %}", STEPS),
    ("loop.changed", "{% set b = [1]*60000 %}{% for i in range(100000) %}{{ loop.changed(b) }}{% endfor %}", STEPS),
    ("lists of a range", "{% set r = [range(60000)] * 30 %}{{ r|map('list')|list|length }}", STEPS),
    ("filter chain", "{{ range(60000)" + "|batch(1)" * 10 + "|list|length }}", STEPS),
    ("markup escapes", "{% set s = '\"' * 60000 %}{{ ('x'|safe) + s }}", CHARS),
    ("markup method", "{% set s = '\"' * 60000 %}{{ ('x'|safe).ljust(2) ~ ('{}'|safe).format(s) }}", CHARS),
    ("sum of lists", "{{ range(100)|map('string')|map('list')|sum(start=[]) }}", "start must be a number"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "source", "named"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_template_is_stopped_by_its_bound_while_it_runs(
    name: str, source: str, named: str
) -> None:
    template = ChatTemplate(source)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument) as exc:
            template.render_threadsafe(RenderBudget(BOUNDS), messages=_chat(2))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert named in exc.value.message, exc.value.message
    assert exc.value.message.startswith("messages: the chat template")
    # Stopped before the value was made, not after: no gigabytes on the way.
    assert peak < 64 * 2**20, f"{name}: {peak / 2**20:.0f} MiB at the peak"


def test_the_containers_a_template_makes_count_toward_all_it_may_make() -> None:
    # Each list is within max_chars and the steps are plenty: what stops the
    # render is the lists made, not what was left once they all were.
    bounds = TemplateBounds(max_steps=10**12, max_chars=1 << 16, timeout_s=3600.0)
    template = ChatTemplate("{% set r = [range(10000)] * 2000 %}{{ r|map('list')|list|length }}")
    tracemalloc.start()
    try:
        with pytest.raises(TemplateLimit, match=r"made more than 16 x 65536 characters in all"):
            template.render_threadsafe(RenderBudget(bounds), messages=[])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB at the peak"  # 2000 lists would be 160 MiB


def test_a_value_is_measured_as_it_would_be_written_and_no_further_than_the_limit() -> None:
    assert value_size("abc", 10) == 3
    assert value_size(["ab", "c"], 100) == 2 + 3  # one per item, and the items' own
    assert value_size({"key": ["v"]}, 100) == 1 + 3 + 1 + 1
    assert value_size({}.items(), 10) == 0 and value_size({"a": "b"}.items(), 10) == 1 + 2 + 2
    assert value_size([2**300], 1000) == 1 + 100  # an integer by its digits, about
    assert value_size([[["x"]]], 100, indent=4) == (1 + 4) + (1 + 8) + (1 + 12) + 1
    # Past the limit it stops: a million items are not visited to learn that.
    assert value_size(["x" * 1000] * 10**6, 2000) > 2000
    assert 2000 < value_size(["x" * 1000] * 1000, 2000) < 2000 + 1000 + 1000


def test_the_time_bound_trips_on_the_budgets_clock() -> None:
    now = [0.0]

    def clock() -> float:  # each read is a millisecond later
        now[0] += 1e-3
        return now[0]

    bounds = TemplateBounds(max_steps=10**12, max_chars=1 << 16, timeout_s=0.25)
    budget = RenderBudget(bounds, clock=clock)
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(
        TemplateLimit, match=r"ran for more than 250 ms \(generation.chat_template_timeout_ms\)"
    ):
        ChatTemplate(source).render_threadsafe(budget, messages=[])
    assert 240 <= bounds.max_steps - budget.steps_left <= 260  # one clock read a step


def test_a_cancelled_budget_stops_the_render_at_its_next_step() -> None:
    turns = threading.Event()
    reads = [0]

    def clock() -> float:
        reads[0] += 1
        if reads[0] == 1000:
            turns.set()  # the render is under way on its thread
        return 0.0

    budget = RenderBudget(TemplateBounds(max_steps=10**12, timeout_s=1.0), clock=clock)
    template = ChatTemplate(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    outcome: list[BaseException] = []

    def render() -> None:
        try:
            template.render_threadsafe(budget, messages=[])
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=render)
    thread.start()
    assert turns.wait(60)
    budget.cancel()
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(outcome[0], Cancelled), outcome


def test_what_is_not_a_template_fails_at_load_or_as_a_bad_request() -> None:
    with pytest.raises(TemplateError, match="over the limit"):
        ChatTemplate("x" * (128 * 1024 + 1))
    with pytest.raises(TemplateError, match="urlize"):
        ChatTemplate("{{ 'a'|urlize }}")
    with pytest.raises(TemplateError, match="ValueError"):  # a literal past Python's int digits
        ChatTemplate("{{ " + "9" * 5000 + " }}")
    budget = RenderBudget(TemplateBounds())
    for source, message in [
        ("{{ raise_exception('no ' * 10000) }}", "the chat template failed: no no"),
        ("{{ 'a' - 1 }}", "TypeError"),
        ("{% include 'other.jinja' %}", "the chat template failed"),
        ("{{ lipsum(10**6) }}", "'lipsum' is undefined"),
    ]:
        with pytest.raises(InvalidArgument, match=message) as exc:
            ChatTemplate(source).render_threadsafe(budget, messages=[])
        assert len(exc.value.message) < 600  # a template's own message is cut short
    assert ChatTemplate("{{ namespace(a='x' * 1000) }}").render_threadsafe(budget) == "<Namespace>"


# --- real servers -----------------------------------------------------------------------------

LOOPING = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{{ messages[0]['content'] }}"
)
VICTIM_TOKENS = 16


def _looping_model(lms: Path, folder: Path) -> Path:
    """The tiny Llama, with a tokenizer_config.json whose chat template loops for hours."""
    folder = Path(shutil.copytree(lm_models.tiny_model("llama", lms), folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = LOOPING
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _config(tmp: pytest.TempPathFactory, name: str, **extra: Any) -> Path:
    lms = tmp.getbasetemp() / "lms"
    root = tmp.mktemp(name)
    looping = _looping_model(lms, root / "looping")
    models = [
        {"name": "gpt2", "engine": "decoder", "path": str(lm_models.tiny_model("gpt2", lms)),
         "generation": GENERATION},
        {"name": "llama", "engine": "decoder", "path": str(lm_models.tiny_model("llama", lms)),
         "generation": GENERATION},
        # The same looping template, stopped by its steps, and by its time.
        {"name": "loop-steps", "engine": "decoder", "path": str(looping),
         "generation": {**GENERATION, "max_chat_template_steps": 200_000}},
        {"name": "loop-time", "engine": "decoder", "path": str(looping),
         "generation": {**GENERATION, "max_chat_template_steps": 10**12,
                        "chat_template_timeout_ms": 300}},
    ]  # fmt: skip
    return write_config(root, {"grpc": {"port": 0}, "models": models, **extra})


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(_config(tmp_path_factory, "looping-template"))
    yield server
    server.stop()


async def _victim(client: openai.AsyncOpenAI, model: str) -> str:
    messages = [{"role": "user", "content": f"victim of {model}"}]
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=VICTIM_TOKENS, temperature=0, stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def _attacker(client: openai.AsyncOpenAI, model: str, limit: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert exc.value.status_code == 400 and exc.value.param == "messages", exc.value
    assert limit in exc.value.message, exc.value.message
    assert exc.value.response.headers["x-should-retry"] == "false"


async def _grpc_attacker(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        request = apb.GenerateRequest(
            model_name="loop-steps", messages=[apb.ChatMessage(role="user", content="hi")]
        )
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in apb_grpc.GenerationStub(channel).Generate(request):
                pass
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value
    assert STEPS in (exc.value.details() or ""), exc.value.details()


async def test_a_looping_chat_template_is_refused_and_never_stalls_the_loop(
    srv: ServerProcess,
) -> None:
    client = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
    alone = {m: await _victim(client, m) for m in ("gpt2", "llama")}
    async with watch_loop(srv.base):
        for _ in range(2):
            results = await asyncio.gather(
                *(_victim(client, m) for m in ("gpt2", "llama", "gpt2", "llama")),
                *(_attacker(client, "loop-steps", STEPS) for _ in range(3)),
                *(_attacker(client, "loop-time", "generation.chat_template_timeout_ms") for _ in range(2)),
                _grpc_attacker(srv.grpc_url),
            )  # fmt: skip
            assert results[:4] == [alone["gpt2"], alone["llama"]] * 2
    # The model's text route never renders the template: it still serves.
    r = await client.completions.create(model="loop-steps", prompt="Hello", max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    assert "Traceback" not in srv.log_text()


async def test_sigterm_ends_the_server_while_chat_templates_render(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Renders that would run for a minute are in flight on the template
    thread (one running, the others queued behind it); SIGTERM drains, gives
    up on them at drain_timeout_s, cancels their renders, and the process
    exits 0."""
    config = _config(tmp_path_factory, "looping-sigterm", drain_timeout_s=2)
    doc = json.loads(config.read_text())
    doc["models"][3]["generation"]["chat_template_timeout_ms"] = 60_000
    config.write_text(json.dumps(doc))
    server = start_server(config)
    try:
        url = server.base + "/v1/chat/completions"
        body = {"model": "loop-time", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            pending = [asyncio.create_task(session.post(url, json=body)) for _ in range(3)]
            await wait_gen(
                session, server.base, "loop-time",
                lambda s: s["generation"]["preparing_sequence_count"] == 3,
            )  # fmt: skip
            async with session.get(server.base + "/v2/health/live") as r:
                assert r.status == 200  # the loop is free while they render
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(server.proc.wait, 60)
            took = time.monotonic() - start
            for task in pending:  # answered (refused) or cut off by the exit
                try:
                    (await task).release()
                except aiohttp.ClientError:
                    pass
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert rc == 0, server.log_text()[-3000:]
    assert took < 30, f"{took:.1f} s from SIGTERM to exit (drain_timeout_s 2)"
