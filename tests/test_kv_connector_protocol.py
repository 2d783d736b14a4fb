"""The engines' KV connectors implement the named interface of ``hawk/engine/kv_connector.py`` whole.

The protocols are what the engines call; a connector missing a member would fail only on the path
that calls it (``drop`` on an abort, ``keep_alive`` under memory pressure), so check every member.
"""

from __future__ import annotations

import inspect

import pytest

from hawk.engine.block_manager import BlockManager
from hawk.engine.decode_engine import LocalKV, RemoteKV
from hawk.engine.kv_connector import DecodeKVConnector


def _members(protocol: type) -> set[str]:
    methods = {n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}
    return methods | set(getattr(protocol, "__annotations__", {}))


@pytest.mark.parametrize("make", [lambda b: LocalKV(b), lambda b: RemoteKV(b, receiver=object())], ids=["LocalKV", "RemoteKV"])
def test_decode_connectors_have_every_member_of_the_protocol(make) -> None:
    kv = make(BlockManager(num_blocks=4, block_size=16))
    members = _members(DecodeKVConnector)
    assert {"blocks", "kv_here", "blocks_needed", "admit", "keep_alive", "drop", "release"} <= members
    missing = [m for m in sorted(members) if not hasattr(kv, m)]
    assert not missing, f"{type(kv).__name__} lacks {missing}"
    for m in sorted(members):
        want = getattr(DecodeKVConnector, m, None)
        if inspect.isfunction(want):
            assert list(inspect.signature(getattr(kv, m)).parameters) == list(inspect.signature(want).parameters)[1:], m
