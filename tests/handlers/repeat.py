"""A decoupled python handler, as Triton's repeat example: an array of ints in,
one response per element (``"decoupled": true``).

Not collected by pytest; tests copy it beside the config that names it.
``IN`` (INT32 ``[-1]``) -> per element ``OUT`` (INT32 ``[1]``, the element)
and ``IDX`` (UINT32 ``[1]``, its index). Request parameters: ``delay_ms``
between responses; ``endless`` (true: repeat the elements for as long as
the client reads); ``fail_at`` (raise after that many responses);
``bad_yield`` (yield an output the model does not declare). Its metrics
count the streams started, run to their end, and closed early (the client
went: ``GeneratorExit`` at a ``yield``).
"""

from __future__ import annotations

import itertools
import time

import numpy as np


class Repeat:
    def load(self, context):
        m = context.metrics
        self.started = m.counter("repeat_started", "Streams begun.")
        self.finished = m.counter("repeat_finished", "Streams run to their end.")
        self.closed = m.counter("repeat_closed", "Streams closed early: the client went.")

    def stream(self, request):
        values = [int(v) for v in request.inputs["IN"][0]]
        p = request.parameters
        delay_s = float(p.get("delay_ms", 0)) / 1e3
        fail_at = p.get("fail_at")
        self.started.inc()
        if p.get("bad_yield"):
            yield {"NOPE": np.zeros((1, 1), np.int32)}
        order = itertools.cycle(enumerate(values)) if p.get("endless") else enumerate(values)
        try:
            for n, (i, v) in enumerate(order):
                if n == fail_at:
                    raise ValueError(f"asked to fail after {n} responses")
                if delay_s and n:
                    time.sleep(delay_s)
                yield {"OUT": np.array([[v]], np.int32), "IDX": np.array([[i]], np.uint32)}
        except GeneratorExit:
            self.closed.inc()
            raise
        self.finished.inc()
