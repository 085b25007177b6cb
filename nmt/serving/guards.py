"""Who may ask the server, checked on every request before its body is read.

- The API key, when one is set (any address but loopback needs one).
- The Origin: a browser names the page that sends a request in it. Any web page the user opens
  may send one to 127.0.0.1 (a POST of text/plain needs no CORS preflight), so a request whose
  Origin is not the server's own address is refused: the server serves no other site's pages.
- The Host: without a key, only a loopback name (localhost, 127.0.0.1, [::1]). A page can
  point a name of its own at 127.0.0.1 (DNS rebinding) and then be the server's own origin, but
  its requests still carry that name.
- The Content-Type of a body: application/json. A browser sends JSON only after a CORS preflight,
  which the server never answers.
"""

from __future__ import annotations

import ipaddress
import secrets
from urllib.parse import urlsplit

from nmt.serving.request import ApiError


def check_caller(headers, api_key: str | None) -> None:
    """An ApiError (403, 401) for a request a web page could have sent, or one without the key."""
    host = headers.get("host", "").strip().lower()
    origin = headers.get("origin")
    if api_key is None and host and not is_loopback_name(host):
        raise ApiError(403, f"the Host {host!r} is not a loopback name: without an API key the server answers "
                            "requests to localhost, 127.0.0.1 or [::1] only (a web page may rename this machine)")
    if origin is not None and not same_origin(origin, host):
        raise ApiError(403, f"requests from web pages of another origin ({origin[:100]!r}) are refused")
    if api_key is None:
        return
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    given = headers.get("x-api-key") or (credentials.strip() if scheme.lower() == "bearer" else "")
    if not secrets.compare_digest(given.encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY or X-API-Key: KEY)")


def check_json_body(headers) -> None:
    """A 415 unless the body is declared as JSON."""
    declared = headers.get("content-type", "")
    if declared.split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, f"send the body as Content-Type: application/json (got {declared[:100] or 'none'})")


def same_origin(origin: str, host: str) -> bool:
    """Whether a browser's Origin ("http://localhost:8080") is the address it sent the request to."""
    try:
        parts = urlsplit(origin.strip().lower())
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.netloc) and parts.netloc == host and \
        not (parts.path or parts.query or parts.fragment)


def is_loopback_name(host: str) -> bool:
    """A Host header naming this machine's loopback: localhost (or a name under it), 127.x.x.x, [::1];
    with or without a port."""
    name = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    name = name.rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
