"""A child process for tests/test_supervisor.py, scripted by attempt.

Not collected by pytest. Each start leaves a file in ``attempts`` and does what
``plan`` says for its attempt number (the last entry repeats): ``"ok"`` says
ready and echoes messages (``"die"`` exits with code 3, ``"fatal"`` says why
first and exits with 4), ``"load_error"`` fails its load, ``"exit"`` exits
with code 5 before any handshake.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack


def main(conn: Connection, attempts: str, plan: list[str]) -> None:
    n = len(os.listdir(attempts))
    (Path(attempts) / str(n)).touch()
    what = plan[min(n, len(plan) - 1)]
    if what == "exit":
        os._exit(5)
    if what == "load_error":
        conn.send_bytes(msgpack.packb(("load_error", f"cannot load (attempt {n})")))
        return
    conn.send_bytes(msgpack.packb(("ready", n)))
    while True:
        try:
            msg = msgpack.unpackb(conn.recv_bytes(), use_list=True)
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "die":
            os._exit(3)
        if msg[0] == "fatal":
            conn.send_bytes(msgpack.packb(("fatal", "SystemExit: bye")))
            os._exit(4)
        conn.send_bytes(msgpack.packb(("echo", n, msg[1])))
