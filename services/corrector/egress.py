"""Where corrector calls may go, and what of a remote's answer is kept or shown.

Outbound calls refuse loopback, private, link-local (cloud metadata at 169.254.169.254 included),
multicast, reserved and unspecified addresses, checked on every address the host name resolves
to, so a name, a decimal-encoded IP (``http://2130706433/``) or an IPv6 form embedding an IPv4
address (IPv4-mapped, 6to4, NAT64, Teredo: judged by that IPv4 address) cannot reach them
either. An operator with a corrector on the same host or LAN allows them with
GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS=true.

Redirects are never followed (a public host answering 307 to an internal one would otherwise
carry a step there): the HTTP client of every corrector kind comes from ``http_client``, which
answers a 3xx as it is, and checks the destination of every request it sends.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx

if TYPE_CHECKING:
    import httpx2

from services.corrector.base import CorrectorError
from shared.settings import Settings, get_settings

_METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
_HTTP_STATUS = re.compile(r"HTTP (\d{3})")
_SECRETISH = re.compile(r"(?i)(bearer\s+\S+|authorization\S*\s*\S+|sk-[A-Za-z0-9_\-]+)")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries: IPv4-mapped (``::ffff:a.b.c.d``), 6to4
    (``2002::/16``), NAT64 (``64:ff9b::/96``, ``64:ff9b:1::/48``) or Teredo's client
    (``2001::/32``); None for a plain IPv6 address."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if any(address in net for net in _NAT64):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def blocked(address: IpAddress) -> bool:
    """An address a corrector call may not reach unless private networks are allowed; an IPv6
    form embedding an IPv4 address is judged by the IPv4 address it leads to."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if inner is not None:
            return blocked(inner)
    return (
        address in _METADATA
        or address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or not address.is_global
    )


def check_destination(url: str, settings: Settings | None = None) -> None:
    """Raises CorrectorError('config') when `url`'s host resolves to a blocked address."""
    settings = settings or get_settings()
    if settings.corrector_allow_private_networks:
        return
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except (OSError, ValueError, UnicodeError) as e:
        raise CorrectorError("transport", "the corrector's host name does not resolve") from e
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if blocked(address):
            raise CorrectorError(
                "config",
                "the corrector's address is loopback, private, link-local or reserved; "
                "allow it with GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS=true",
            )


def http_client(
    timeout: float, headers: dict[str, str] | None = None, connections: int = 100
) -> httpx.Client:
    """The HTTP client of every outbound corrector call: redirects are not followed, and each
    request's host passes ``check_destination`` just before it is sent. ``connections``: as
    many as requests may be in flight (httpx's default of 100 would queue the rest)."""

    def check(request: httpx.Request) -> None:
        check_destination(str(request.url))

    return httpx.Client(
        timeout=timeout,
        headers=headers,
        follow_redirects=False,
        event_hooks={"request": [check]},
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def openai_http_client(timeout: float, connections: int = 100) -> httpx2.Client:
    """``http_client`` for the OpenAI SDK, which speaks httpx2 (its own default follows
    redirects)."""
    import httpx2  # loaded with the SDK, which is imported only when an openai kind is used

    def check(request: httpx2.Request) -> None:
        check_destination(str(request.url))

    return httpx2.Client(
        timeout=timeout,
        follow_redirects=False,
        event_hooks={"request": [check]},
        limits=httpx2.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def redirect_note(status: int) -> str:
    """Said beside a 3xx: the endpoint redirected and we did not follow."""
    return " (a redirect: corrector calls do not follow redirects)" if 300 <= status < 400 else ""


def stored_error(e: CorrectorError) -> str:
    """The `corrections.error` text: our own reason, without the remote's words (an error body
    may echo request headers, keys included); the HTTP status stays."""
    reason = re.sub(r"(HTTP \d{3}):.*", r"\1", e.reason, flags=re.DOTALL)
    if e.kind in ("transport", "malformed"):
        reason = re.sub(r"unreadable response \(.*", "unreadable response", reason, flags=re.DOTALL)
    return f"{e.kind}: {_SECRETISH.sub('[redacted]', reason)[:500]}"


def public_error(e: CorrectorError) -> str:
    """A category for `/test`: enough to fix a setting, never a remote answer or a port scan."""
    if e.kind == "transport":
        status = _HTTP_STATUS.search(e.reason)
        if status:
            code = status.group(1)
            return f"transport: the endpoint answered HTTP {code}{redirect_note(int(code))}"
        if "does not resolve" in e.reason:
            return "transport: the host name does not resolve"
        return "transport: the endpoint could not be reached (refused, reset or timed out)"
    return stored_error(e)  # malformed: our parser's reason ("answer is not JSON" ...)
