"""http(s) media URLs: the address policy and the bounded fetch.

A request naming a URL makes the server fetch it, so the server must not become a proxy into
its own network. Each hop (the URL, then every redirect, followed by hand, at most five) is
resolved once, every address it resolves to is checked, and the connection goes to a checked
IP with the original Host header (and, for https, the original name as SNI and for the
certificate): a DNS answer that changes after the check is never consulted. The peer reached
is checked again before a body byte is read. A public address is one outside
`REFUSED_NETWORKS`; an IPv6 spelling that carries an IPv4 address (mapped, compatible,
translated, NAT64 64:ff9b::/96, 6to4 2002::/16) is also judged as the IPv4 address it carries. `allow_private`
(MLXCEL_ALLOW_PRIVATE_MEDIA_URLS=1, read by the CLI) turns every address check into a pass.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urljoin, urlsplit

FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 5


class FetchRefused(ValueError):
    """A URL that is not fetched, or a fetch that failed (the message is the client's)."""


# Refused ranges, spelled out rather than left to a library's notion of "global" (the IANA
# special-purpose registries, IPv4 and IPv6, conservatively: a range is refused whole).
REFUSED_NETWORKS = [ipaddress.ip_network(n) for n in (
    "0.0.0.0/8",  # this network / unspecified
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # private
    "100.64.0.0/10",  # carrier-grade NAT
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local (cloud metadata at 169.254.169.254)
    "192.0.0.0/24",  # IETF protocol assignments
    "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24",  # documentation
    "192.88.99.0/24",  # deprecated 6to4 relay anycast
    "198.18.0.0/15",  # benchmarking
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, and the broadcast address
    "::/128", "::1/128",  # unspecified, loopback
    "64:ff9b:1::/48",  # local-use NAT64 (the well-known 64:ff9b::/96 is judged by its IPv4 below)
    "100::/64",  # discard-only
    "2001::/23",  # IETF protocol assignments: Teredo 2001::/32, benchmarking 2001:2::/48, ORCHID
    "2001:db8::/32", "3fff::/20",  # documentation
    "5f00::/16",  # SRv6 segment identifiers
    "fc00::/7",  # unique-local
    "fe80::/10", "fec0::/10",  # link-local, deprecated site-local
    "ff00::/8",  # multicast
)]
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SIIT = ipaddress.ip_network("::ffff:0:0:0/96")  # IPv4-translated (RFC 2765)


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 spelling carries to an IPv4 host, judged in its place: mapped,
    compatible, translated, NAT64 and 6to4 (Teredo is refused whole by the table)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or ip in _SIIT or (int(ip) >> 32 == 0 and int(ip) > 1):  # last: ::a.b.c.d
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if any(ip in net for net in REFUSED_NETWORKS if net.version == 6):
            return False
        ip = _embedded_v4(ip) or ip
    return not any(ip in net for net in REFUSED_NETWORKS if net.version == ip.version)


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (the seam tests replace); an IP literal is itself."""
    try:
        return [ipaddress.ip_address(host).compressed]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # UnicodeError: a label IDNA cannot encode (over 63 bytes)
        raise FetchRefused(f"the media URL host {_quote(host)} does not resolve") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


async def check_url(url: str, allow_private: bool) -> list[str]:
    """The addresses to connect to for `url`, resolved once and every one checked."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise FetchRefused(f"media URL scheme {_quote(parts.scheme)} is not fetched; use http(s), file:// or data:")
    if parts.username is not None or parts.password is not None:
        raise FetchRefused("a media URL may not carry credentials")
    host = parts.hostname
    if not host:
        raise FetchRefused("the media URL has no host")
    addresses = await resolve(host, parts.port or (443 if parts.scheme == "https" else 80))
    if not allow_private:
        for a in addresses:
            if not public(a):
                raise FetchRefused(f"the media URL resolves to a non-public address ({a}); this server fetches "
                                   f"public addresses only")
    return addresses


def pinned(url: str, address: str):
    """`url` aimed at the checked `address`: the same request with the original Host header,
    and for https the original name as SNI and for certificate verification."""
    import httpx

    original = httpx.URL(url)
    target = original.copy_with(host=address.split("%", 1)[0])
    extensions = {"sni_hostname": original.raw_host.decode("ascii")} if original.scheme == "https" else {}
    return target, {"Host": original.netloc.decode("ascii")}, extensions


async def fetch(url: str, *, allow_private: bool, max_bytes: int) -> bytes:
    """GET `url` under the address policy, following at most five checked redirects. Each hop
    resolves once and connects to an address it checked, never resolving the name again."""
    import httpx

    async with httpx.AsyncClient(follow_redirects=False, timeout=FETCH_TIMEOUT_S, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            addresses = await check_url(url, allow_private)
            try:
                r, body = await _get_first(client, url, addresses, allow_private, max_bytes)
            except httpx.HTTPError as e:
                raise FetchRefused(f"fetching the media URL failed: {type(e).__name__}") from None
            if body is not None:
                return body
            url = urljoin(url, r.headers.get("location", ""))
    raise FetchRefused(f"the media URL redirected more than {MAX_REDIRECTS} times")


async def _get_first(client, url: str, addresses: list[str], allow_private: bool, max_bytes: int):
    """GET from the first checked address that accepts a connection; (response, body), the
    body None for a redirect."""
    import httpx

    for i, address in enumerate(addresses):
        target, headers, extensions = pinned(url, address)
        try:
            async with client.stream("GET", target, headers=headers, extensions=extensions) as r:
                if not allow_private:  # defence in depth: the peer reached is the address checked
                    peer = _peer(r)
                    if peer is None or not public(peer):
                        raise FetchRefused("the media URL connected to a non-public address; this server "
                                           "fetches public addresses only")
                if r.is_redirect:
                    return r, None
                return r, await _body(r, max_bytes)
        except httpx.ConnectError:
            if i == len(addresses) - 1:
                raise
    raise FetchRefused("the media URL host has no address")


async def _body(r, max_bytes: int) -> bytes:
    if r.status_code != 200:
        raise FetchRefused(f"fetching the media URL answered HTTP {r.status_code}")
    if int(r.headers.get("content-length") or 0) > max_bytes:
        raise FetchRefused(f"the media URL's body is larger than the image payload limit of {max_bytes} bytes")
    body = bytearray()
    async for chunk in r.aiter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise FetchRefused(f"the media URL's body is larger than the image payload limit of "
                               f"{max_bytes} bytes")
    return bytes(body)


def _quote(text: str, limit: int = 64) -> str:
    """Client text quoted in an error, truncated so an answer never echoes unbounded input."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _peer(response) -> str | None:
    stream = response.extensions.get("network_stream")
    addr = stream.get_extra_info("server_addr") if stream is not None else None
    return addr[0] if addr else None
