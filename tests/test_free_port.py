"""``free_port`` never hands one process the same port twice, even when the OS offers it again."""

from __future__ import annotations

import socket
from typing import Self

import pytest

from hawk.integrations.vllm import servers


def test_a_port_offered_again_is_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    offered = iter([41001, 41001, 41001, 41002])

    class FakeSocket:
        def __enter__(self) -> Self:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, addr: tuple[str, int]) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(servers, "_handed_ports", set())
    monkeypatch.setattr(servers.socket, "socket", FakeSocket)
    assert [servers.free_port(), servers.free_port()] == [41001, 41002]


def test_free_ports_are_bindable_and_distinct() -> None:
    ports = [servers.free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
