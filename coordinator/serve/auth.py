"""`--api-key`: a bearer token on every `/v1` route and on `/tokenize`, `/detokenize`, `/version`; `/health` and
`/metrics` stay open (as vLLM serves them, for probes and scrapers). Compared in constant time."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Optional

from common.endpoints import is_loopback

OPEN_PATHS = ("/health", "/metrics")
GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/version")


def needs_key(path: str) -> bool:
    return path == "/v1" or path.startswith(GUARDED_PREFIXES)


def authorized(header: Optional[str], api_key: str) -> bool:
    """`Authorization: Bearer <key>` carrying `api_key`."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


def is_loopback_host(host: str) -> bool:
    """An HTTP listen address every resolution of which is loopback (a name is resolved, not read)."""
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
        return literal.is_loopback
    except ValueError:
        return is_loopback(f"tcp://{host}:0")
