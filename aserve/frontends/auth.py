"""API keys for both frontends (frontends layer; checked on the loop).

With ``"auth"`` in the config every request must carry one of the keys:
``Authorization: Bearer KEY`` over HTTP (an aiohttp middleware), metadata
``authorization: Bearer KEY`` over gRPC (a server interceptor). Paths in
``auth.open_paths`` (health and /metrics by default) are served without one;
over gRPC the health service is open when a health path is. A request
without a key, or with a wrong one, is answered 401 (``WWW-Authenticate:
Bearer``) / ``UNAUTHENTICATED`` before anything else happens; one whose key
is valid but of a role the route does not allow (an inference key on an
admin route, :mod:`aserve.frontends.roles`), 403 / ``PERMISSION_DENIED``.
Without ``"auth"`` nothing is installed: the request path is unchanged. The
HTTP middleware is :mod:`aserve.frontends.http.auth`, the gRPC interceptor
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
from aserve.frontends.roles import Role, is_admin_path
from aserve.obs.log_throttle import Throttled

log = logging.getLogger("aserve.auth")

_BEARER = "bearer "
_MISSING = "missing API key: send 'authorization: Bearer <key>' (HTTP header or gRPC metadata)"
_WRONG = "invalid API key"
_NOT_TEXT = "the authorization must be 'Bearer <key>' in printable ASCII"
# Refusals need no credentials to cause: one line per interval, not one per request.
_refusals = Throttled(log, logging.WARNING)


class ApiKeys:
    """The accepted keys and their roles; :meth:`check` says a credential's role, or why
    it is refused."""

    def __init__(self, keys: Iterable[str], admin_keys: Iterable[str] = ()) -> None:
        self._keys = tuple((k.encode(), Role.INFERENCE) for k in keys) + tuple(
            (k.encode(), Role.ADMIN) for k in admin_keys
        )
        self.has_admin_keys = any(role is Role.ADMIN for _, role in self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def by_role(self) -> dict[str, list[str]]:
        """The keys by role (``inference``, ``admin``): what the core hands each HTTP
        frontend process over its control channel, so that both check the same keys."""
        roles: dict[str, list[str]] = {"inference": [], "admin": []}
        for key, role in self._keys:
            roles["admin" if role is Role.ADMIN else "inference"].append(key.decode())
        return roles

    def check(self, authorization: str | None) -> Role | str:
        """The role of the key ``authorization`` (an ``Authorization`` value) carries,
        or why it is refused (a str)."""
        if not authorization:
            return _MISSING
        # Undecodable bytes arrive as lone surrogates, which str.encode refuses.
        if not (authorization.isascii() and authorization.isprintable()):
            return _NOT_TEXT
        if authorization[: len(_BEARER)].lower() != _BEARER:
            return "the authorization must be 'Bearer <key>'"
        given = authorization[len(_BEARER) :].strip().encode()
        inference = admin = False
        for key, role in self._keys:  # no early exit: the time does not tell which key matched
            match = hmac.compare_digest(given, key)
            inference |= match and role is Role.INFERENCE
            admin |= match and role is Role.ADMIN
        if admin:
            return Role.ADMIN
        return Role.INFERENCE if inference else _WRONG


def load_api_keys(auth: AuthConfig, base_dir: Path) -> ApiKeys:
    """Read the inference keys and the admin keys from their environment variables and/or
    files; ValueError says what is wrong."""
    for path in auth.open_paths:
        if is_admin_path(path):
            raise ValueError(
                f"auth.open_paths: {path} is an admin route, which always needs an admin "
                "key: remove it from open_paths"
            )
    keys = _read_keys(auth.api_keys_env, auth.api_keys_file, "api_keys", base_dir)
    admin = _read_keys(auth.admin_keys_env, auth.admin_keys_file, "admin_keys", base_dir)
    if set(keys) & set(admin):
        raise ValueError(
            f"auth: {len(set(keys) & set(admin))} key(s) are both inference and admin keys "
            f"(in {_sources(auth.api_keys_env, auth.api_keys_file)} and "
            f"{_sources(auth.admin_keys_env, auth.admin_keys_file)}): give admins keys of "
            "their own"
        )
    return ApiKeys(keys, admin)


def _read_keys(env: str | None, file: str | None, field: str, base_dir: Path) -> list[str]:
    """The keys of one role: none when neither source is configured, else at least one."""
    keys: list[str] = []
    if env is not None:
        value = os.environ.get(env)
        if value is None:
            raise ValueError(f"auth.{field}_env: environment variable {env} is not set")
        keys += [k.strip() for k in value.split(",") if k.strip()]
    if file is not None:
        path = base_dir / file
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"auth.{field}_file: cannot read {path}: {exc.strerror}") from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if not keys and (env is not None or file is not None):
        what = "admin keys" if field == "admin_keys" else "API keys"
        raise ValueError(f"auth: no {what} found in " + _sources(env, file))
    return keys


def _sources(env: str | None, file: str | None) -> str:
    names = []
    if env is not None:
        names.append(f"${env}")
    if file is not None:
        names.append(file)
    return " and ".join(names)


def refused(message: str, *args: object) -> None:
    """Log a refusal, throttled: refusals need no credentials to cause."""
    _refusals.event(message, *args)
