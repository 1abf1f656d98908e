"""The Ray dashboard URL rule, shared by the `ray` connection and the CLI's ``--address``.

It lives on the client side (httpx only) so that ``rayslice capacity --address URL`` checks a URL
with the connection's rules without importing Airflow, which a laptop or CI job may not even have.
"""

from __future__ import annotations

import httpx

from rayslice.core.exceptions import InvalidRequestError

HOST_HINT = "set the `ray` connection's host to the Ray dashboard URL, e.g. http://127.0.0.1:8265"


def dashboard_url(host: str | None, schema: str | None = None, port: int | None = None, *,
                  what: str = "the `ray` connection's host", hint: str = HOST_HINT) -> str:
    """The dashboard URL from a host, schema and port, with or without a scheme in host.

    ``what`` and ``hint`` name the input in errors: the connection's host, or a command's flag.
    """
    raw = (host or "").strip()
    host = raw.rstrip("/")
    if not host:
        raise InvalidRequestError(f"{what} is empty: {hint}")
    if "://" in raw and not raw.split("://", 1)[1].strip("/"):  # e.g. "http://": a scheme and no host name
        raise InvalidRequestError(f"{what} {raw!r} has no host name: {hint}")
    if "://" not in host:
        scheme = (schema or "").strip().lower()
        host = f"{scheme if scheme in ('http', 'https') else 'http'}://{host}"
    try:
        url = httpx.URL(host)
    except httpx.InvalidURL as exc:
        raise InvalidRequestError(f"{what} is not a URL ({exc}): {hint}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise InvalidRequestError(f"{what} must be http(s)://host:port: {hint}")
    if port and url.port is None:
        url = url.copy_with(port=int(port))
    return str(url.copy_with(username=None, password=None, query=None, fragment=None)).rstrip("/")
