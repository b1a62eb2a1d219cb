"""Routing from (model, version) to the runtime serving it (layer: loop; runs on the loop).

The routing table is an immutable snapshot: a dict that is never changed
once published, replaced as a whole by one assignment on the loop. A lookup
is one dict get; a reload builds the next table beside the current one and
swaps it in, so a request sees either the old routing or the new, never a
mix. Runtimes taken out of the table are not unloaded here: whoever swapped
them out drains and unloads them (``aserve/loop/reload.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from aserve.errors import NotFound, Unavailable
from aserve.loop.runtimes.base import Runtime

# (name, version) for an exact version; (name, None) for the highest version.
_Key = tuple[str, "str | None"]


class ModelRegistry:
    """Runtimes by name and version. A request without a version gets the highest."""

    def __init__(self) -> None:
        self._routes: dict[_Key, Runtime] = {}
        # Every routed runtime, in the order they were added (unload goes in reverse).
        self._runtimes: tuple[Runtime, ...] = ()
        # While the server starts (listening, models loading), a model not routed
        # yet may be one still loading: not ready (503), rather than unknown (404).
        self.starting = False

    def get(self, name: str, version: str | None = None) -> Runtime:
        runtime = self._routes.get((name, version or None))
        if runtime is not None:
            return runtime
        if self.starting:
            raise Unavailable(f"model '{name}' is not ready: the server is starting")
        # Worded as Triton's, which scripts match on; the versions served follow.
        if (name, None) not in self._routes:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        have = ", ".join(self.versions(name))
        raise NotFound(
            f"Request for unknown model: '{name}' version {version} is not found (versions: {have})"
        )

    def versions(self, name: str) -> list[str]:
        """The routed versions of ``name``, lowest first."""
        return sorted((rt.version for rt in self._runtimes if rt.name == name), key=int)

    def add(self, runtime: Runtime) -> None:
        self.swap(add=[runtime])

    def swap(self, add: Iterable[Runtime] = (), remove: Iterable[Runtime] = ()) -> list[Runtime]:
        """Route ``add`` and unroute ``remove`` in one step; returns what left the table.

        A runtime in ``add`` replaces the one routed under its name and version,
        which is returned with the removed ones. Call on the loop: there is no
        ``await`` between building the table and publishing it.
        """
        gone = {id(rt) for rt in remove}
        by_key = {(rt.name, rt.version): rt for rt in self._runtimes if id(rt) not in gone}
        left = [rt for rt in self._runtimes if id(rt) in gone]
        for rt in add:
            old = by_key.get((rt.name, rt.version))
            if old is not None and old is not rt:
                left.append(old)
                del by_key[(rt.name, rt.version)]  # re-added last: keeps load order honest
            by_key[(rt.name, rt.version)] = rt
        routes: dict[_Key, Runtime] = {}
        for (name, version), rt in by_key.items():
            routes[(name, version)] = rt
            latest = routes.get((name, None))
            if latest is None or int(version) > int(latest.version):
                routes[(name, None)] = rt
        self._runtimes = tuple(by_key.values())
        self._routes = routes  # the one assignment that publishes the new routing
        return left

    def __iter__(self) -> Iterator[Runtime]:
        return iter(self._runtimes)

    def __len__(self) -> int:
        return len(self._runtimes)
