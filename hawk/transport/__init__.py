"""Transfer engines behind one small interface: NIXL, Mooncake, same-host copies.

Importing this package imports no engine; ``make_transport(name)`` loads the one asked for.
"""

from hawk.transport.base import (
    ConnectError,
    Desc,
    DescArray,
    RegionInfo,
    TransferError,
    TransferHandle,
    TransferTimeout,
    Transport,
    TransportError,
    TransportUnavailable,
)
from hawk.transport.registry import TRANSPORTS, available, make_transport

__all__ = [
    "TRANSPORTS",
    "ConnectError",
    "Desc",
    "DescArray",
    "RegionInfo",
    "TransferError",
    "TransferHandle",
    "TransferTimeout",
    "Transport",
    "TransportError",
    "TransportUnavailable",
    "available",
    "make_transport",
]
