"""Routing from (model, version) to the runtime serving it."""

from __future__ import annotations

from aserve.errors import NotFound
from aserve.loop.model import ModelRuntime


class ModelRegistry:
    """Runtimes by name and version. A request without a version gets the highest."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], ModelRuntime] = {}
        self._latest: dict[str, ModelRuntime] = {}

    def add(self, runtime: ModelRuntime) -> None:
        self._by_key[(runtime.name, runtime.version)] = runtime
        current = self._latest.get(runtime.name)
        if current is None or int(runtime.version) > int(current.version):
            self._latest[runtime.name] = runtime

    def get(self, name: str, version: str | None = None) -> ModelRuntime:
        if version is None or version == "":
            runtime = self._latest.get(name)
        else:
            runtime = self._by_key.get((name, version))
        if runtime is not None:
            return runtime
        if name not in self._latest:
            raise NotFound(f"unknown model '{name}'")
        have = sorted((v for n, v in self._by_key if n == name), key=int)
        raise NotFound(f"model '{name}' has no version '{version}' (versions: {', '.join(have)})")

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._by_key.values()))

    def __len__(self) -> int:
        return len(self._by_key)
