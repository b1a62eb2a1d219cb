"""A bounded token channel per generation request, consumed as an async iterator.

Runs on the loop only. The continuous batcher fills it with each step's
:class:`~aserve.types.generation.StepOutput` for the request (the outputs
crossed from the executor thread in :mod:`aserve.workers.handoff`, the one
handoff place); a frontend reads it with ``async for delta in channel``.

Reading takes everything buffered at once, merged into one :class:`~aserve.types.generation.Delta`:
a reader that keeps up gets one delta per step, a slower one gets fewer,
larger deltas and never replays a backlog chunk by chunk.

Backpressure: ``capacity`` is the number of unread step outputs the channel
may hold. When it holds that many, the batcher *pauses* the sequence: it
keeps its KV-cache slot but is left out of the decode steps, so it costs no
compute and its buffer stops growing, while the other sequences go on. The
reader's next read empties the buffer and resumes the sequence
(``on_resume``). A reader that never reads again is ended by the request's
deadline (or, for a client that has gone, by the frontend's cancellation).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from aserve.errors import AserveError
from aserve.types.generation import Delta, StepOutput


class TokenChannel:
    """One request's stream of step outputs; one writer (the batcher), one reader."""

    __slots__ = ("_buffer", "_error", "_finished", "_waiter", "capacity", "on_resume", "paused")

    def __init__(self, capacity: int, on_resume: Callable[[], None] | None = None) -> None:
        self.capacity = capacity
        self.on_resume = on_resume
        self.paused = False  # set by the batcher when it leaves the sequence out
        self._buffer: deque[StepOutput] = deque()
        self._finished = False  # the last output (or an error) is in
        self._error: AserveError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # --- writer side (the batcher) --------------------------------------------

    @property
    def full(self) -> bool:
        """The reader is ``capacity`` steps behind: time to pause the sequence."""
        return len(self._buffer) >= self.capacity

    @property
    def backlog(self) -> int:
        return len(self._buffer)

    @property
    def closed(self) -> bool:
        """No more outputs will come (finished, failed or cancelled)."""
        return self._finished

    def push(self, output: StepOutput) -> None:
        """Add one step's output; the one with ``finished`` set is the last."""
        if self._finished:
            return
        self._buffer.append(output)
        if output.finished:
            self._finished = True
        self._wake()

    def fail(self, error: AserveError) -> None:
        """End the stream with ``error``: the reader gets what is buffered, then the error."""
        if self._finished:
            return
        self._finished = True
        self._error = error
        self._wake()

    def close(self) -> None:
        """The reader has gone: drop everything, accept nothing more."""
        self._finished = True
        self._buffer.clear()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- reader side ------------------------------------------------------------

    def __aiter__(self) -> TokenChannel:
        return self

    async def __anext__(self) -> Delta:
        while not self._buffer:
            if self._finished:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        delta = _merge(self._buffer)
        self._buffer.clear()
        if self.paused:
            self.paused = False
            if self.on_resume is not None:
                self.on_resume()
        return delta


def _merge(outputs: deque[StepOutput]) -> Delta:
    last = outputs[-1]
    if len(outputs) == 1:
        text, ids = last.text, [last.token_id]
    else:
        text = "".join(o.text for o in outputs)
        ids = [o.token_id for o in outputs]
    reason = last.finish_reason
    # Every output of a request that asked for log probabilities carries its token's.
    logprobs = None if last.logprob is None else [o.logprob for o in outputs]  # type: ignore[misc]
    return Delta(
        text,
        ids,
        reason,
        last.prompt_tokens,
        last.completion_tokens,
        reason is not None,
        logprobs,
        last.cached_tokens,
    )
