"""API keys and the bind address. The key comes from the environment of the process that builds the
application (``GRIFFIN_API_KEY``, or the variable ``serve.api_key_env`` names): ``griffin serve``'s,
``serve run``'s, or on KubeRay the Serve controller's pod, which gets it from a Secret. The ingress replica
is handed only its SHA-256 digest (``key_digest``), so the key itself is in no deployment argument, log or
dashboard; ``KeyCheck`` compares the digest of each request's ``Authorization: Bearer <key>`` with
``hmac.compare_digest``. Listening beyond loopback without a key is refused (``require_key``) unless
``serve.allow_unauthenticated`` says so."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os

from fastapi import Request
from fastapi.responses import JSONResponse

from pipeline.config import ServeSection

DEFAULT_KEY_ENV = "GRIFFIN_API_KEY"


def client_headers(section: ServeSection) -> dict[str, str]:
    """What a client of this endpoint in this environment sends (the evaluation through Serve): the key
    from ``serve.api_key_env``'s variable, when one is set."""
    key = os.environ.get(section.api_key_env, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``localhost``: reachable from this machine only. A hostname may resolve
    anywhere, so it counts as reachable from outside."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_key(section: ServeSection) -> str | None:
    """The digest of the API key in ``serve.api_key_env``'s variable, or None when it is unset or empty
    (no key: every request is served). Raises ValueError when ``serve.host`` is reachable from other
    machines without a key and ``serve.allow_unauthenticated`` is false."""
    key = os.environ.get(section.api_key_env, "").strip()
    if key:
        return key_digest(key)
    if not is_loopback(section.host) and not section.allow_unauthenticated:
        raise ValueError(
            f"serve.host={section.host} accepts connections from other machines, but no API key is set: "
            f"export {section.api_key_env} (serve.api_key_env; {DEFAULT_KEY_ENV} by default) to require "
            "'Authorization: Bearer <key>' on every route but /health, or set serve.allow_unauthenticated: "
            "true to serve without one (only behind something that authenticates)"
        )
    return None


class KeyCheck:
    """``denied(request)``: None when the request may go on (no key configured, or its bearer token is
    the key), else the 401 to answer, OpenAI-style (``code: invalid_api_key``)."""

    def __init__(self, digest: str | None):
        self.digest = digest

    def denied(self, request: Request) -> JSONResponse | None:
        if self.digest is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return _unauthorized("no API key: send the header 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(key_digest(token), self.digest):
            return _unauthorized("invalid API key")
        return None


def _unauthorized(message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
