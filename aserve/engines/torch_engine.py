"""The PyTorch engine: TorchScript (``.pt``) and ``torch.export`` programs (``.pt2``).

Layer: ``engines``; runs on executor threads or in a worker process (and, on
the CPU, tiny batches inline on the loop's thread: ``inline_capable``).

Neither format runs code from the file: TorchScript loads through its own
unpickler, which knows no Python globals; a ``.pt2`` through
:mod:`aserve.engines.export_file`, which refuses what torch's own loader
would run. On CUDA every instance thread runs on its own ``torch.cuda.Stream``
and stages inputs and outputs through pinned host buffers with non-blocking
copies, so instances overlap copies and compute instead of serializing on the
default stream.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aserve.config import ModelConfig
from aserve.engines import cuda_graphs
from aserve.engines.base import Engine
from aserve.engines.export_file import load_exported_program
from aserve.engines.export_io import export_tensors
from aserve.engines.io_specs import reconcile
from aserve.engines.weight_park import WeightPark
from aserve.types.tensors import numpy_dtype

log = logging.getLogger("aserve.engines.torch")


class _Instance:
    """Per-thread state: the CUDA stream, pinned staging buffers and captured
    CUDA graphs by batch size (None/empty on CPU)."""

    __slots__ = ("graphs", "pinned_in", "stream")

    def __init__(
        self, stream: Any, pinned_in: dict[str, torch.Tensor], graphs: dict[int, Any] | None = None
    ) -> None:
        self.stream = stream
        self.pinned_in = pinned_in
        self.graphs = graphs or {}


class TorchEngine(Engine):
    def __init__(self, config: ModelConfig, model_path: Path) -> None:
        super().__init__(config, model_path)
        self.device = torch.device(config.device)
        # On the CPU an instance is only thread settings: tiny batches may run on the loop.
        self.inline_capable = self.device.type == "cpu"
        self._module: Any = None
        self._park: WeightPark | None = None  # found at the first park (TorchScript only)
        self._in_names = [s.name for s in config.inputs]
        self._out_names = [s.name for s in config.outputs]

    def load(self) -> None:
        cfg, path = self.config, self.model_path
        for spec in (*cfg.inputs, *cfg.outputs):
            if spec.datatype == "BYTES":
                raise ValueError(f"the torch engine cannot take BYTES tensors ('{spec.name}')")
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"device '{cfg.device}' requested, but this torch ({torch.__version__}) "
                    "sees no CUDA device"
                )
            index = self.device.index or 0
            if index >= torch.cuda.device_count():
                raise RuntimeError(
                    f"device '{cfg.device}' requested, but only "
                    f"{torch.cuda.device_count()} CUDA device(s) are visible"
                )
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        if path.suffix == ".pt2":
            program = load_exported_program(path)
            self._tensors_from(program)
            module = program.module()
            self._module = module.to(self.device)
        else:
            with warnings.catch_warnings():
                # torch 2.13 warns that TorchScript is deprecated on every load.
                warnings.simplefilter("ignore", category=DeprecationWarning)
                warnings.filterwarnings("ignore", message=".*TorchScript.*")
                module = torch.jit.load(str(path), map_location=self.device)
            module.eval()
            self._module = module

    def load_front(self) -> None:
        """In worker processes' server: a ``.pt2`` whose config lists no tensors has
        them read here, from the program (loaded for that alone, then dropped)."""
        cfg, path = self.config, self.model_path
        if path.suffix == ".pt2" and not (cfg.inputs and cfg.outputs):
            self._tensors_from(load_exported_program(path))

    def _tensors_from(self, program: Any) -> None:
        """Serve the tensors the program declares where the config lists none (a
        ``.pt2`` carries them, as an ONNX file does); those it lists are checked
        against the program's."""
        cfg = self.config
        if cfg.inputs and cfg.outputs:
            return
        max_batch = cfg.batching.max_batch_size
        ins, outs = export_tensors(program, max_batch)
        inputs = reconcile("inputs", cfg.inputs, ins, max_batch)
        outputs = reconcile("outputs", cfg.outputs, outs, max_batch)
        log.info(
            "model %s: tensors from the program: inputs %s, outputs %s", cfg.name,
            ", ".join(f"{s.name} {s.datatype} {s.shape}" for s in inputs),
            ", ".join(f"{s.name} {s.datatype} {s.shape}" for s in outputs),
        )  # fmt: skip
        # The served specs from here on (ModelRuntime and the executor read them).
        self.config = cfg.model_copy(update={"inputs": inputs, "outputs": outputs})
        self._in_names = [s.name for s in inputs]
        self._out_names = [s.name for s in outputs]

    def create_instance(self, index: int) -> _Instance:
        # Intra-op threads are set per thread: each instance thread runs its own pool.
        torch.set_num_threads(self.config.cpu_threads)
        if self.device.type != "cuda":
            return _Instance(None, {})
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(device=self.device)
        max_batch = self.config.batching.max_batch_size
        pinned = {}
        for spec in self.config.inputs:
            if -1 not in spec.shape:  # fixed shapes get a staging buffer sized for max batch
                dtype = torch.from_numpy(np.zeros(0, numpy_dtype(spec.datatype))).dtype
                pinned[spec.name] = torch.empty(
                    (max_batch, *spec.shape), dtype=dtype, pin_memory=True
                )
        graphs = {}
        if self.config.cuda_graphs:
            b = self.config.batching
            graphs = cuda_graphs.capture(
                self._module, self.config.inputs,
                cuda_graphs.capture_sizes(b.preferred_batch_sizes, b.max_batch_size),
                self.device, stream, self._as_list, f"{self.config.name} instance {index}",
            )  # fmt: skip
        return _Instance(stream, pinned, graphs)

    def run(self, inputs: dict[str, np.ndarray], instance: _Instance) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            if instance.stream is None:
                result = self._module(*[torch.from_numpy(inputs[n]) for n in self._in_names])
                return {
                    n: t.numpy()
                    for n, t in zip(self._out_names, self._as_list(result), strict=True)
                }
            return self._run_cuda(inputs, instance)

    def _run_cuda(self, inputs: dict[str, np.ndarray], inst: _Instance) -> dict[str, np.ndarray]:
        stream = inst.stream
        # A batch of a captured size replays its graph: uploads go straight into its inputs.
        graph = inst.graphs.get(inputs[self._in_names[0]].shape[0]) if inst.graphs else None
        with torch.cuda.stream(stream):
            args = []
            for i, name in enumerate(self._in_names):
                host = torch.from_numpy(inputs[name])
                staging = inst.pinned_in.get(name)
                if staging is not None:
                    staging = staging[: host.shape[0]]
                    staging.copy_(host)
                else:
                    staging = host.pin_memory()
                if graph is not None:
                    graph.inputs[i].copy_(staging, non_blocking=True)
                else:
                    args.append(staging.to(self.device, non_blocking=True))
            results = graph.replay() if graph is not None else self._as_list(self._module(*args))
            outs = []
            for t in results:
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                dst.copy_(t, non_blocking=True)
                outs.append(dst)
        # The only wait: this instance's own stream, not the whole device.
        stream.synchronize()
        return {n: t.numpy() for n, t in zip(self._out_names, outs, strict=True)}

    def _as_list(self, result: Any) -> list[torch.Tensor]:
        if isinstance(result, torch.Tensor):
            result = [result]
        elif isinstance(result, dict):
            missing = [n for n in self._out_names if n not in result]
            if missing:
                names = ", ".join(missing)
                raise ValueError(f"model '{self.config.name}' returned no output(s) {names}")
            result = [result[n] for n in self._out_names]
        elif not isinstance(result, (list, tuple)):
            raise ValueError(
                f"model '{self.config.name}' returned {type(result).__name__}, not tensors"
            )
        if len(result) != len(self._out_names):
            raise ValueError(
                f"model '{self.config.name}' returned {len(result)} output(s), "
                f"the config declares {len(self._out_names)}"
            )
        return list(result)

    def park(self) -> int | None:
        """A TorchScript module's weights released, the module kept
        (:mod:`aserve.engines.weight_park`); a ``.pt2`` program cannot."""
        # Captured CUDA graphs hold the weights' addresses: read back elsewhere,
        # a replay would read freed memory.
        if self._module is None or self.model_path.suffix == ".pt2" or self.config.cuda_graphs:
            return None
        if self._park is None:
            self._park = WeightPark.plan(self._module, self.model_path)
            if self._park is None:
                return None
        released = self._park.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return released

    def unpark(self) -> None:
        assert self._park is not None and self._park.parked
        self._park.restore(self.device)

    def unload(self) -> None:
        self._module = None
        self._park = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
