"""Typed failures of a KV handoff. Every one leaves the caller's destination blocks untouched or
partly written; the caller frees them (the source side frees its own through its lease)."""

from __future__ import annotations

from enum import Enum


class TransferError(Exception):
    """Base of every error a pull or an offer raises. `lease_ids` names the parts of a read
    at fault when only some are (empty: the whole read)."""

    kind: ErrorKind

    def __init__(self, message: str = "", lease_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.lease_ids = tuple(lease_ids)


class TransferTimeout(TransferError):
    """The pull did not land every layer within its timeout."""


class LayoutMismatch(TransferError):
    """The two sides' KV layouts (or block counts) cannot be transferred between; nothing was
    written."""


class LeaseExpired(TransferError):
    """The source no longer holds the handoff's blocks: released, cancelled, expired or unknown."""


class PeerGone(TransferError):
    """The other side closed or lost the connection before the transfer finished."""


class InvalidDescriptor(TransferError):
    """A layout or handoff record is malformed (missing field, wrong type, bad value)."""


class TransportUnavailable(TransferError):
    """The configured transport cannot run here (missing package, no GPU for NCCL)."""


class ErrorKind(str, Enum):
    """How an error crosses the wire: the source sends the kind, the puller raises the class."""

    TIMEOUT = "timeout"
    LAYOUT_MISMATCH = "layout_mismatch"
    LEASE_EXPIRED = "lease_expired"
    PEER_GONE = "peer_gone"
    INVALID_DESCRIPTOR = "invalid_descriptor"
    UNAVAILABLE = "unavailable"


_CLASSES: dict[ErrorKind, type[TransferError]] = {
    ErrorKind.TIMEOUT: TransferTimeout,
    ErrorKind.LAYOUT_MISMATCH: LayoutMismatch,
    ErrorKind.LEASE_EXPIRED: LeaseExpired,
    ErrorKind.PEER_GONE: PeerGone,
    ErrorKind.INVALID_DESCRIPTOR: InvalidDescriptor,
    ErrorKind.UNAVAILABLE: TransportUnavailable,
}
for _kind, _cls in _CLASSES.items():
    _cls.kind = _kind
TransferError.kind = ErrorKind.PEER_GONE


def error_from_kind(kind: ErrorKind, message: str,
                    lease_ids: tuple[str, ...] = ()) -> TransferError:
    return _CLASSES[kind](message, lease_ids)
