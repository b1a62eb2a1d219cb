"""API keys for both frontends (frontends layer; checked on the loop).

With ``"auth"`` in the config every request must carry one of the keys:
``Authorization: Bearer KEY`` over HTTP (an aiohttp middleware), metadata
``authorization: Bearer KEY`` over gRPC (a server interceptor). Paths in
``auth.open_paths`` (health and /metrics by default) are served without one;
over gRPC the health service is open when a health path is. A request
without a key, or with a wrong one, is answered 401 (``WWW-Authenticate:
Bearer``) / ``UNAUTHENTICATED`` before anything else happens. Without
``"auth"`` nothing is installed: the request path is unchanged. The HTTP
middleware is :mod:`aserve.frontends.http.auth`, the gRPC interceptor
:mod:`aserve.frontends.grpc.auth`; both check with :class:`ApiKeys`.

Keys are compared in constant time, each against every configured key.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from aserve.config import AuthConfig
from aserve.obs.log_throttle import Throttled

log = logging.getLogger("aserve.auth")

_BEARER = "bearer "
_MISSING = "missing API key: send 'authorization: Bearer <key>' (HTTP header or gRPC metadata)"
_WRONG = "invalid API key"
_NOT_TEXT = "the authorization must be 'Bearer <key>' in printable ASCII"
# Refusals need no credentials to cause: one line per interval, not one per request.
_refusals = Throttled(log, logging.WARNING)


class ApiKeys:
    """The accepted keys; :meth:`check` says why a credential is refused, or None."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None) -> str | None:
        """Why ``authorization`` (an ``Authorization`` value) is refused, or None if accepted."""
        if not authorization:
            return _MISSING
        # Undecodable bytes arrive as lone surrogates, which str.encode refuses.
        if not (authorization.isascii() and authorization.isprintable()):
            return _NOT_TEXT
        if authorization[: len(_BEARER)].lower() != _BEARER:
            return "the authorization must be 'Bearer <key>'"
        given = authorization[len(_BEARER) :].strip().encode()
        ok = False
        for key in self._keys:  # no early exit: the time does not tell which key matched
            ok |= hmac.compare_digest(given, key)
        return None if ok else _WRONG


def load_api_keys(auth: AuthConfig, base_dir: Path) -> ApiKeys:
    """Read the keys from the environment variable and/or the file; ValueError says what is wrong."""
    keys: list[str] = []
    if auth.api_keys_env is not None:
        value = os.environ.get(auth.api_keys_env)
        if value is None:
            raise ValueError(
                f"auth.api_keys_env: environment variable {auth.api_keys_env} is not set"
            )
        keys += [k.strip() for k in value.split(",") if k.strip()]
    if auth.api_keys_file is not None:
        path = base_dir / auth.api_keys_file
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"auth.api_keys_file: cannot read {path}: {exc.strerror}") from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if not keys:
        raise ValueError("auth: no API keys found in " + _sources(auth))
    return ApiKeys(keys)


def _sources(auth: AuthConfig) -> str:
    names = []
    if auth.api_keys_env is not None:
        names.append(f"${auth.api_keys_env}")
    if auth.api_keys_file is not None:
        names.append(auth.api_keys_file)
    return " and ".join(names)


def refused(message: str, *args: object) -> None:
    """Log a refusal, throttled: refusals need no credentials to cause."""
    _refusals.event(message, *args)
