"""A pipeline model (``"engine": "pipeline"``): requests flow through other models.

Layer: loop; runs on the event loop. Each step looks its model up in the registry when the
request reaches it, so a reload that swaps a step's model is followed at
once, and submits to that model's own batcher: a step is batched with every
other request for that model, pipelined or not. Tensors pass from step to
step as the arrays the previous model produced, never re-encoded.

The pipeline has no engine and no queue of its own; its statistics count
whole requests through all steps. Its deadline covers all of them: each step
gets what is left.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from aserve.codecs.sequence import refuse_sequence
from aserve.codecs.validate import check_batch
from aserve.config import GpuConfig, ModelConfig, PipelineStep
from aserve.engines.batching import check_outputs
from aserve.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from aserve.loop.runtimes.base import (
    ModelState,
    Runtime,
    batching_reconfigurable,
    string_parameters,
)
from aserve.loop.runtimes.batched import tensor_metadata, tensor_triton_config
from aserve.types.tensors import dtype_fits, shape_fits, shape_text

if TYPE_CHECKING:
    from aserve.loop.registry import ModelRegistry

log = logging.getLogger("aserve.pipeline")


class PipelineRuntime(Runtime):
    """No engine, pool or batcher of its own: each step is another runtime's request."""

    def __init__(
        self,
        config: ModelConfig,
        base_dir: Path,
        registry: ModelRegistry,
        gpu: GpuConfig | None = None,
    ) -> None:
        super().__init__(config, base_dir, gpu)
        self.input_specs = {s.name: s for s in config.inputs}
        self.output_specs = {s.name: s for s in config.outputs}
        self.max_batch_size = config.batching.max_batch_size
        self.variable_shapes = any(-1 in s.shape for s in config.inputs)
        self._registry = registry
        self.inflight = 0

    async def load(self) -> None:
        # Nothing to load: the steps' models are separate runtimes, looked up per request.
        self.state = ModelState.READY
        log.info(
            "pipeline %s ready: %s", self.label, " -> ".join(s.model for s in self.config.steps)
        )

    def not_ready_reason(self) -> str | None:
        """Why the pipeline cannot take requests now: not loaded, or a step's model
        unloaded or not ready (its requests would all be refused at that step)."""
        reason = self.state_reason()
        if reason is not None:
            return reason
        for index, step in enumerate(self.config.steps):
            where = f"pipeline '{self.label}' is not ready: step {index} ({step.model})"
            try:
                runtime = self._registry.get(step.model, step.version)
            except NotFound:
                return f"{where} is not loaded"
            step_reason = runtime.not_ready_reason()
            if step_reason is not None:
                return f"{where}: {step_reason}"
        return None

    @property
    def busy(self) -> bool:
        return self.inflight > 0

    # Its batching block holds only its deadline (timeout_ms), which applies in place.
    reconfigurable = staticmethod(batching_reconfigurable)

    async def _stop(self) -> None:
        pass  # nothing of its own: the steps' models unload by themselves

    def statistics(self) -> dict[str, Any]:
        return self.stats.as_dict(self.inflight, 0)

    def metadata(self) -> dict[str, Any]:
        return tensor_metadata(self, "ensemble")

    def triton_config(self) -> dict[str, Any]:
        # Triton describes ensembles in ``ensemble_scheduling``, which aserve's
        # ModelConfig message does not carry: the steps go in ``parameters``.
        c, b = self.config, self.config.batching
        steps = [s.model_dump(exclude_defaults=True) for s in c.steps]
        return {
            **tensor_triton_config(self),
            "parameters": string_parameters(
                (
                    ("version", self.version),
                    ("device", c.device),
                    ("cpu_threads", c.cpu_threads),
                    ("max_queue_size", b.max_queue_size),
                    ("timeout_ms", b.timeout_ms),
                    ("steps", orjson.dumps(steps).decode()),
                )
            ),
        }

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
        """Run the steps in order; a failing step fails the request with its error.
        The deadline, ``arrival`` (None: now) + ``timeout_s``, covers them all."""
        refuse_sequence(parameters, self.label)  # its steps are not run as sequences
        self.require_ready()
        self.inflight += 1
        start = time.monotonic()
        deadline = (start if arrival is None else arrival) + timeout_s
        try:
            tensors = dict(inputs)
            for index, step in enumerate(self.config.steps):
                outputs = await self._run_step(
                    index, step, tensors, deadline, client_id, parameters
                )
                published = step.outputs or {name: name for name in outputs}
                for name, tensor in published.items():
                    tensors[tensor] = outputs[name]
            result = {s.name: tensors[s.name] for s in self.config.outputs}
            try:
                check_outputs(result, self.config.outputs, batch_size, self.label)
            except ValueError as exc:
                raise InternalError(str(exc)) from None
        except Exception:
            self.stats.fail.add(int((time.monotonic() - start) * 1e9))
            raise
        finally:
            self.inflight -= 1
        elapsed_ns = int((time.monotonic() - start) * 1e9)
        self.stats.success.add(elapsed_ns)
        self.stats.record_batch(batch_size, 1, 0, elapsed_ns, 0)
        return result

    async def _run_step(
        self,
        index: int,
        step: PipelineStep,
        tensors: dict[str, np.ndarray],
        deadline: float,
        client_id: str | None,
        parameters: dict[str, Any] | None,
    ) -> dict[str, np.ndarray]:
        where = f"pipeline '{self.label}' step {index} ({step.model})"
        try:
            runtime = self._registry.get(step.model, step.version)
        except NotFound:
            raise Unavailable(f"{where}: the model is not loaded") from None
        step_inputs = {}
        for name, spec in runtime.input_specs.items():
            source = step.inputs.get(name, name)
            arr = tensors.get(source)
            if arr is None:  # the config check rules this out; a reloaded step may differ
                raise InternalError(f"{where}: no tensor '{source}' for input '{name}'")
            if not dtype_fits(arr.dtype, spec.datatype):
                raise InternalError(
                    f"{where}: tensor '{source}' is {arr.dtype}, input '{name}' takes "
                    f"{spec.datatype}"
                )
            if not shape_fits(arr.shape, spec.shape):
                raise InvalidArgument(
                    f"{where}: tensor '{source}' has shape {list(arr.shape)}, input '{name}' "
                    f"takes {shape_text(spec.shape)}"
                )
            step_inputs[name] = arr
        size, key = check_batch(
            step_inputs, runtime.input_specs, runtime.name, runtime.max_batch_size,
            runtime.variable_shapes,
        )  # fmt: skip
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"{where}: the request's deadline passed before this step")
        return await runtime.infer(step_inputs, size, key, left, client_id, parameters)
