"""What runs in the server's child processes: a worker process or a step process.

Layer: ``workers``, child side. Nothing here imports asyncio or runs on the
server's loop: each ``*_main`` is a child's whole life (set up, load, answer
the jobs that come down its blocking end of the pipe, until told to stop or
the pipe closes). The server's side of the same child is
:class:`aserve.workers.supervisor.Supervisor` and its owner
(:mod:`.batch_process` or :mod:`.step_process`).

A child says how its load went first: ``("ready", ...)`` or
``("load_error", text)``; a worker process that dies of a ``BaseException``
says ``("fatal", text)`` before it ends.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from aserve.config import GenerationConfig, GpuConfig, ModelConfig
from aserve.engines import create_engine
from aserve.engines.base import Engine
from aserve.engines.gpu_memory import CacheReleaser, apply_memory_limit, cuda_indices
from aserve.engines.python_handler import PythonHandlerEngine
from aserve.obs import logs
from aserve.workers.wire import pack_arrays, unpack_arrays

if TYPE_CHECKING:
    from aserve.engines.decoder import DecoderEngine, Sequence
    from aserve.types.generation import SamplingParams

log = logging.getLogger("aserve.executor")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build and load the same engine as the server's."""

    config: ModelConfig
    model_path: str | None
    base_dir: str
    gpu: dict[str, Any] = dataclasses.field(default_factory=dict)  # the server's "gpu" block


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    """What a step process needs to load the same engine as the parent's front."""

    model_path: str
    generation: dict[str, Any]
    device: str
    dtype: str
    cpu_threads: int
    name: str
    gpu: dict[str, Any] = dataclasses.field(default_factory=dict)  # the "gpu" block


def settle_child(device: str, gpu: dict[str, Any]) -> CacheReleaser | None:
    """In the child, first: signals, logs, and the server's ``"gpu"`` block for ``device``.

    The server decides when a child ends (a stop message, or its pipe
    closing), so SIGINT/SIGTERM sent to the whole group are ignored. The
    memory cap is per process, so the server's is applied here too; the
    returned releaser (None without one) empties the cache periodically.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.configure("WARNING", os.environ.get(logs.FORMAT_ENV, "text"))
    indices = cuda_indices([device])
    if not indices:
        return None
    import torch  # here: only a child on a CUDA device needs it (a handler may not)

    config = GpuConfig(**gpu)
    apply_memory_limit(torch.cuda, config, indices)
    if config.empty_cache_interval_s is None:
        return None
    return CacheReleaser(torch.cuda, config.empty_cache_interval_s)


# --- a batched model's worker process ---


def batch_main(conn: Connection, spec: WorkerSpec, index: int) -> None:
    """The child's whole life: load, then run batches until told to stop or the pipe closes."""
    try:
        releaser = settle_child(spec.config.device, spec.gpu)
        engine = worker_engine(spec)
        engine.load_worker()
        instance = engine.create_instance(index)
    except Exception as exc:
        conn.send_bytes(msgpack.packb(("load_error", f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(msgpack.packb(("ready", _drain(engine))))
    try:
        _serve_batches(conn, engine, instance, releaser)
    except (EOFError, OSError):
        pass  # the server has gone


def worker_engine(spec: WorkerSpec) -> Engine:
    """The engine of ``spec``, built as the server builds it (loads nothing yet)."""
    path = Path(spec.model_path) if spec.model_path is not None else None
    if spec.config.engine == "python":
        return PythonHandlerEngine(spec.config, path, Path(spec.base_dir))
    assert path is not None
    return create_engine(spec.config, path)


def _serve_batches(
    conn: Connection, engine: Engine, instance: Any, releaser: CacheReleaser | None
) -> None:
    perf = time.perf_counter_ns
    while True:
        msg = msgpack.unpackb(conn.recv_bytes(), use_list=True)
        if msg[0] == "stop":
            return
        _, packed_parts, size = msg
        try:
            t0 = perf()
            parts = [unpack_arrays(p, writable=True) for p in packed_parts]
            inputs = engine.stack_inputs(parts)
            t1 = perf()
            outputs = engine.run(inputs, instance)
            t2 = perf()
            engine.check_outputs(outputs, size)
            answer = msgpack.packb(("ok", pack_arrays(outputs), t1 - t0, t2 - t1, _drain(engine)))
        except Exception as exc:  # this batch fails; the child serves the next
            answer = msgpack.packb(("error", str(exc) or type(exc).__name__, _drain(engine)))
        except BaseException as exc:  # SystemExit & co.: the child ends; say why first
            conn.send_bytes(msgpack.packb(("fatal", f"{type(exc).__name__}: {exc}")))
            raise
        conn.send_bytes(answer)
        if releaser is not None:
            releaser.maybe()  # after answering: the release is off the batch's latency


def _drain(engine: Engine) -> Any:
    """What a handler's custom metrics changed since the last answer (None: nothing)."""
    metrics = getattr(engine, "metrics", None)
    return None if metrics is None else metrics.drain()


# --- a decoder model's step process ---


def step_main(conn: Connection, args: WorkerArgs) -> None:
    """The child's whole life: load, then run steps until told to stop or the pipe closes."""
    try:
        releaser = settle_child(args.device, args.gpu)
        # Here, not at the top: the decoder imports torch, which a batched model's
        # worker process (a python handler, say) must not pay for.
        import torch

        from aserve.engines.decoder import DecoderEngine
        from aserve.types.generation import SamplingParams

        torch.set_num_interop_threads(1)
        generation = GenerationConfig(**args.generation)
        engine = DecoderEngine(
            args.model_path,
            generation,
            args.device,
            args.dtype,
            args.cpu_threads,
        )
        engine.load()
        engine.create_instance(0)
    except Exception as exc:
        conn.send_bytes(msgpack.packb(("load_error", f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(msgpack.packb(("ready",)))
    try:
        _serve_steps(conn, engine, releaser, SamplingParams, generation.step_run_ahead)
    except (EOFError, OSError):
        pass  # the server has gone


def _serve_steps(
    conn: Connection,
    engine: DecoderEngine,
    releaser: CacheReleaser | None,
    params_type: type[SamplingParams],
    run_ahead: int,
) -> None:
    """Run steps as the server says, and between its word run ahead of it.

    The server sends ``("step", acked, free, new, running)`` when what runs
    changes (admissions, cancellations and expiries to free, paused readers
    left out, resumed ones back) and ``("ack", acked)`` as it reads answers;
    ``acked`` counts the answers it has taken in. With no message waiting,
    the child decodes its running sequences again on its own, up to
    ``run_ahead`` answers past ``acked``: the server no longer makes a round
    trip of the pipe per step. Each answer names its sequences by key, and
    says whether it is the first step after a ``"step"`` message (the
    server's job); a key the server has freed meanwhile is dropped there.
    """
    seqs: dict[int, Sequence] = {}
    active: list[int] = []  # the keys the next step decodes, in order
    sent = acked = 0
    perf = time.perf_counter_ns
    while True:
        job = None
        # Take in all that is waiting; wait when there is nothing to run or the
        # server is run_ahead answers behind.
        while True:
            can_run = job is not None or (bool(active) and sent - acked < run_ahead)
            if can_run and not conn.poll():
                break
            msg = msgpack.unpackb(conn.recv_bytes(), use_list=True)
            if msg[0] == "stop":
                return
            acked = max(acked, msg[1])
            if msg[0] == "step":
                job = msg
        new: list[Sequence] = []
        new_keys: list[int] = []
        built: dict[int, str] = {}  # new keys that failed to build: why
        if job is not None:
            _, _, free, new_specs, running_keys = job
            for key in free:
                seq = seqs.pop(key, None)
                if seq is not None:
                    engine.free(seq)
            # A new sequence that cannot be built fails alone; the step runs for the rest.
            for key, request_id, prompt_ids, params, max_tokens, stop_ids in new_specs:
                new_keys.append(key)
                try:
                    seq = engine.build_sequence(
                        request_id, prompt_ids, _params(params, params_type), max_tokens, stop_ids
                    )
                except Exception as exc:
                    built[key] = f"{type(exc).__name__}: {exc}"
                    continue
                seqs[key] = seq
                new.append(seq)
            # One that finished while the server's word was on its way is gone already.
            active = [k for k in running_keys if k in seqs]
        try:
            running = [seqs[k] for k in active]
            t0 = perf()
            outputs = iter(engine.step(new, running))
            infer_ns = perf() - t0
        except Exception as exc:
            for key in new_keys:  # the step gave their slots back; the parent forgets them too
                seq = seqs.pop(key, None)
                if seq is not None:
                    engine.free(seq)
            # The running ones keep their slots until the server frees them;
            # nothing runs ahead on them.
            failed, active = active, []
            conn.send_bytes(
                msgpack.packb(("error", f"{type(exc).__name__}: {exc}", job is not None, failed))
            )
            sent += 1
            continue
        answer = []
        still: list[int] = []
        for key in [*new_keys, *active]:
            failed_build = built.get(key)
            if failed_build is not None:
                answer.append((key, -1, "", True, None, 0, 0, failed_build, "invalid_argument"))
                continue
            out = next(outputs)
            if out.finished:
                seqs.pop(key, None)
            else:
                still.append(key)
            answer.append(
                (
                    key,
                    out.token_id,
                    out.text,
                    out.finished,
                    out.finish_reason,
                    out.prompt_tokens,
                    out.completion_tokens,
                    out.error,
                    out.error_code,
                    out.logprob,
                    out.cached_tokens,
                    out.prefilling,
                )
            )
        active = still
        conn.send_bytes(msgpack.packb(("step", answer, infer_ns, job is not None)))
        sent += 1
        if releaser is not None:
            releaser.maybe()  # after answering: the release is off the step's latency


def _params(fields: list[Any], cls: type[SamplingParams]) -> SamplingParams:
    """SamplingParams (``cls``, passed in: see step_main) from the wire (msgpack
    brings the tuples back as lists)."""
    p = cls(*fields)
    return dataclasses.replace(
        p, stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids),
        logit_bias=tuple((int(t), float(b)) for t, b in p.logit_bias),
    )  # fmt: skip
