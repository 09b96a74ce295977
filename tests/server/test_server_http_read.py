"""The request reader (tailguard.server.http_read) fed by hand: exact read boundaries, which the
socket tests (test_server_http.py, test_server_hostile.py) leave to the kernel."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tailguard.server.call import Call
from tailguard.server.http_read import BODY, HEAD, IDLE, RequestReader, blank_line_end, origin_form

MAX_HEAD = 4096


class Sink:
    """Records what the reader hands its connection."""

    def __init__(self) -> None:
        self.client = "127.0.0.1"
        self.deadline = 0.0
        self.calls: list[Call] = []
        self.continues = 0

    def enqueue(self, call: Call) -> None:
        self.calls.append(call)

    def send_continue(self) -> None:
        self.continues += 1

    def send_response(self, *a: Any) -> None:  # the Conn side: not used by the reader
        raise AssertionError("the reader never answers")

    def send_head(self, *a: Any) -> None:
        raise AssertionError("the reader never answers")

    async def send_chunk(self, *a: Any) -> None:
        raise AssertionError("the reader never answers")

    def statuses(self) -> list[int]:
        return [c.error.status if c.error else 200 for c in self.calls]


def reader() -> tuple[RequestReader, Sink]:
    server = SimpleNamespace(
        max_url=1024,
        max_head=MAX_HEAD,
        max_fields=100,
        max_body=65_536,
        max_body_wire=2 * 65_536 + MAX_HEAD,
        header_timeout_s=10.0,
        body_timeout_s=30.0,
        app=SimpleNamespace(precheck=lambda call: None),
    )
    sink = Sink()
    return RequestReader(server, sink), sink  # type: ignore[arg-type]


GET = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
PARTIAL = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: "


def post(body: bytes) -> bytes:
    return b"POST /v1/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def chunked(body: bytes) -> bytes:
    return (
        b"POST /v1/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (len(body), body)
    )


EMPTY_LINES = b'{"a":\r\n\r\n1}\n\n'  # a JSON body holding empty lines, ending with one


@pytest.mark.parametrize(
    ("before", "uncounted"),
    [
        (b"", 0),
        (GET, 0),
        (GET * 3, 0),
        (post(b"{}"), 0),
        (chunked(b"{}"), 0),
        # the count starts after the body's last empty line plus the body's length: here the
        # whole body too late (a lower bound: it can only refuse later, never wrongly)
        (post(EMPTY_LINES), len(EMPTY_LINES)),
    ],
    ids=["alone", "get", "3-gets", "post", "chunked", "post-with-empty-lines"],
)
def test_a_head_that_begins_inside_a_read_counts_from_its_first_byte(
    before: bytes, uncounted: int
) -> None:
    answered = [200] * before.count(b"HTTP")
    at_cap = MAX_HEAD - len(PARTIAL) + uncounted
    r, sink = reader()
    r.feed(before + PARTIAL + b"b" * at_cap, 0.0)  # a head of exactly the cap: read on
    assert r.phase == HEAD and not r.discard and sink.statuses() == answered
    r, sink = reader()
    r.feed(before + PARTIAL + b"b" * (at_cap + 1), 0.0)  # one byte over, same read: 431 now
    assert r.discard and sink.statuses() == [*answered, 431]


def test_the_head_keeps_counting_across_reads() -> None:
    r, sink = reader()
    r.feed(GET + PARTIAL + b"b" * 1000, 0.0)  # began inside this read: 1,000 + the line so far
    for _ in range(3):
        r.feed(b"b" * 1000, 0.1)
    assert r.phase == HEAD and sink.statuses() == [200]
    r.feed(b"b" * 100, 0.2)  # 4,100 + len(PARTIAL) > 4,096
    assert sink.statuses() == [200, 431]


def test_a_body_read_in_pieces_then_a_head_is_counted_after_the_body() -> None:
    r, sink = reader()
    body = b"\n\n" * 1000  # empty lines only
    r.feed(post(body)[:-500], 0.0)
    assert r.phase == BODY
    # the body's last 500 bytes, then a head: the head starts after them, not at its last "\n\n"
    r.feed(post(body)[-500:] + PARTIAL + b"b" * (MAX_HEAD - len(PARTIAL)), 0.1)
    assert r.phase == HEAD and sink.statuses() == [200]
    assert sink.calls[0].body == body


def test_a_complete_request_in_one_read_is_not_counted_as_a_head() -> None:
    r, sink = reader()
    r.feed(GET * 500, 0.0)  # 17 kB of small requests in one read
    assert r.phase == IDLE and sink.statuses() == [200] * 500


def test_blank_line_end_and_origin_form() -> None:
    assert blank_line_end(b"abc") == 0
    assert blank_line_end(b"a\r\n\r\nb") == 5
    assert blank_line_end(b"a\n\nb\r\n\r\ncd") == 8
    assert blank_line_end(b"a\r\n\r\nb\n\nc") == 8
    assert origin_form(b"http://h:1/p?q") == b"/p?q"
    assert origin_form(b"HTTPS://h?q") == b"/?q"
    assert origin_form(b"ftp://h/p") == b"ftp://h/p"
