"""http(s) media URLs (api/media_fetch.py): the address policy, and a fetch from a local server
when MLXCEL_ALLOW_PRIVATE_MEDIA_URLS=1 opens the private range."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlxcel.api import media_fetch
from mlxcel.api.media_fetch import MAX_REDIRECTS, FetchRefused, check_url, fetch, public
from mlxcel.cli.flags import parse_server_args

REFUSED = ["127.0.0.1", "0.0.0.0", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
           "192.0.0.8", "192.0.2.1", "198.18.0.1", "198.51.100.1", "203.0.113.1", "224.0.0.1", "240.0.0.1",
           "255.255.255.255", "::1", "::", "fc00::1", "fd12::1", "fe80::1", "2001:db8::1", "ff02::1",
           "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1", "::10.0.0.1",
           # IPv6 spellings that carry a private/loopback IPv4 address, and the rest of the table
           "::ffff:0:7f00:1", "::ffff:0:a00:1",  # IPv4-translated
           "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "64:ff9b::c0a8:101",  # NAT64 well-known prefix
           "64:ff9b:1::808:808",  # local-use NAT64, refused whole
           "2002:7f00:1::1", "2002:a00:1::1", "2002:a9fe:a9fe::", "2002:6440:1::1",  # 6to4 of private v4
           "2001::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
           "2001:2::1", "2001:10::1",  # benchmarking, ORCHID
           "fdff:ffff::1", "fe80::1%eth0", "febf::1", "fec0::1",  # ULA, link-local with zone, site-local
           "ff05::1", "ff0e::1",  # multicast
           "3fff::1", "100::1", "5f00::1",  # documentation (RFC 9637), discard-only, SRv6
           "0.1.2.3", "100.127.255.254", "192.88.99.1", "198.19.255.255", "239.255.255.250"]
PUBLIC = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "::8.8.8.8",
          "64:ff9b::808:808", "2002:808:808::1", "2001:4860:4860::8888", "100.128.0.1", "198.20.0.1"]


@pytest.mark.parametrize("address", REFUSED)
def test_non_public_addresses_are_refused(address):
    assert not public(address)
    with pytest.raises(FetchRefused, match="non-public"):
        url_host = f"[{address.replace('%', '%25')}]" if ":" in address else address
        asyncio.run(check_url(f"http://{url_host}/a.png", False))


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass(address):
    assert public(address)


def test_scheme_credentials_and_names():
    for url, words in (("ftp://8.8.8.8/a.png", "scheme"), ("http://u:p@8.8.8.8/a.png", "credentials"),
                       ("http://localhost/a.png", "non-public")):
        with pytest.raises(FetchRefused, match=words):
            asyncio.run(check_url(url, False))


def test_the_cli_reads_the_switch():
    assert not parse_server_args(["-m", "x"], {}).media.allow_private_media_urls
    assert parse_server_args(["-m", "x"], {"MLXCEL_ALLOW_PRIVATE_MEDIA_URLS": "1"}).media.allow_private_media_urls


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path.startswith("/hop"):
            n = int(self.path[4:] or 0)
            self.send_response(302)
            self.send_header("Location", f"/hop{n + 1}" if n < 10 else "/img")
            self.end_headers()
            return
        if self.path == "/img" or self.path == "/redirect":
            if self.path == "/redirect":
                self.send_response(301)
                self.send_header("Location", "/img")
                self.end_headers()
                return
            body = b"\x89PNG-bytes"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def local():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_local_fetch_needs_the_switch(local):
    with pytest.raises(FetchRefused, match="non-public"):
        asyncio.run(fetch(local + "/img", allow_private=False, max_bytes=1000))
    assert asyncio.run(fetch(local + "/img", allow_private=True, max_bytes=1000)) == b"\x89PNG-bytes"
    assert asyncio.run(fetch(local + "/redirect", allow_private=True, max_bytes=1000)) == b"\x89PNG-bytes"


def test_fetch_limits(local):
    with pytest.raises(FetchRefused, match="payload limit"):
        asyncio.run(fetch(local + "/img", allow_private=True, max_bytes=4))
    with pytest.raises(FetchRefused, match=f"more than {MAX_REDIRECTS}"):
        asyncio.run(fetch(local + "/hop0", allow_private=True, max_bytes=1000))
    with pytest.raises(FetchRefused, match="HTTP 404"):
        asyncio.run(fetch(local + "/nothing", allow_private=True, max_bytes=1000))


class _Recorder(BaseHTTPRequestHandler):
    """Records every request's Host header; serves /img."""
    hosts: list = []

    def do_GET(self):  # noqa: N802
        _Recorder.hosts.append(self.headers.get("Host"))
        body = b"\x89PNG-pinned"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    _Recorder.hosts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _fake_resolver(monkeypatch, answers):
    """Replaces the resolver seam: each call pops the next answer (a rebinding DNS server)."""
    calls = []

    async def resolve(host, port):
        calls.append(host)
        return answers.pop(0)
    monkeypatch.setattr(media_fetch, "resolve", resolve)
    return calls


def test_a_name_resolving_to_a_private_address_is_refused_before_connecting(monkeypatch, recorder):
    calls = _fake_resolver(monkeypatch, [["8.8.8.8", "127.0.0.1"]])
    with pytest.raises(FetchRefused, match=r"non-public address \(127\.0\.0\.1\)"):
        asyncio.run(fetch(f"http://media.example:{recorder}/img", allow_private=False, max_bytes=1000))
    assert calls == ["media.example"] and _Recorder.hosts == []  # resolved once, never connected


def test_the_fetch_connects_to_the_checked_address_with_the_original_host(monkeypatch, recorder):
    # 127.0.0.1 stands in for a permitted public address; the second answer (a rebinding to an
    # unreachable address) must never be asked for, since the name is resolved once.
    calls = _fake_resolver(monkeypatch, [["127.0.0.1"], ["203.0.113.9"]])
    monkeypatch.setattr(media_fetch, "public", lambda a: a == "127.0.0.1")
    got = asyncio.run(fetch(f"http://media.example:{recorder}/img", allow_private=False, max_bytes=1000))
    assert got == b"\x89PNG-pinned"
    assert calls == ["media.example"]
    assert _Recorder.hosts == [f"media.example:{recorder}"]


def test_https_keeps_the_name_for_sni_and_the_certificate():
    target, headers, ext = media_fetch.pinned("https://cdn.example/a.png?x=1", "2606:4700::1")
    assert str(target) == "https://[2606:4700::1]/a.png?x=1"
    assert headers == {"Host": "cdn.example"} and ext == {"sni_hostname": "cdn.example"}
    target, headers, ext = media_fetch.pinned("http://cdn.example:8080/a.png", "8.8.8.8")
    assert str(target) == "http://8.8.8.8:8080/a.png" and headers == {"Host": "cdn.example:8080"} and ext == {}


def test_an_unresolvable_name_is_quoted_truncated():
    with pytest.raises(FetchRefused) as e:
        asyncio.run(check_url("http://" + "a" * 300 + ".invalid/x.png", False))
    assert "does not resolve" in str(e.value) and len(str(e.value)) < 140
