from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import msgspec
import pytest

from kvconnect.errors import AuthenticationError, ProtocolError
from kvconnect.transfer.protocol import wire
from kvconnect.transfer.segment import (
    DESCRIPTOR_VERSION,
    RegionInfo,
    SegmentDescriptor,
    decode_descriptor,
    encode_descriptor,
    host_identity,
    process_identity,
)

ENGINE_ID = bytes(range(16))


def _pair(
    client_token: str | None, server_token: str | None
) -> tuple[Callable[[], bytes], list[BaseException]]:
    left, right = socket.socketpair()
    server_errors: list[BaseException] = []

    def serve() -> None:
        try:
            wire.server_handshake(right, server_token, ENGINE_ID, wire.deadline_after(5))
        except BaseException as exc:
            server_errors.append(exc)
        finally:
            right.close()

    thread = threading.Thread(target=serve)
    thread.start()

    def client() -> bytes:
        try:
            return wire.client_handshake(left, client_token, wire.deadline_after(5)).peer_id
        finally:
            left.close()
            thread.join()

    return client, server_errors


@pytest.mark.parametrize("token", [None, "t0ken"])
def test_handshake_succeeds_with_matching_tokens(token: str | None) -> None:
    client, server_errors = _pair(token, token)
    assert client() == ENGINE_ID
    assert server_errors == []


@pytest.mark.parametrize(
    ("client_token", "server_token", "client_error"),
    [
        ("wrong", "right", "rejected our cluster token"),
        (None, "right", "requires a cluster token"),
        ("mine", None, "does not use one"),
    ],
)
def test_handshake_refuses_token_mismatch(
    client_token: str | None, server_token: str | None, client_error: str
) -> None:
    client, server_errors = _pair(client_token, server_token)
    with pytest.raises(AuthenticationError, match=client_error):
        client()
    if client_token and server_token:
        assert isinstance(server_errors[0], AuthenticationError)


def test_server_proof_is_checked_by_the_client() -> None:
    """A listener that does not know the token cannot fake its proof."""
    left, right = socket.socketpair()

    def impostor() -> None:
        right.recv(wire.HELLO.size)
        right.sendall(
            wire.SERVER_HELLO.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 1, b"n" * 16, ENGINE_ID)
        )
        right.recv(wire.MAC_LEN)
        right.sendall(b"\x00" + b"\x00" * wire.MAC_LEN)

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(AuthenticationError, match="failed to prove"):
        wire.client_handshake(left, "t0ken", wire.deadline_after(5))
    thread.join()
    left.close()
    right.close()


def test_version_mismatch_is_a_protocol_error() -> None:
    left, right = socket.socketpair()
    right.sendall(wire.SERVER_HELLO.pack(wire.MAGIC, 99, 0, b"n" * 16, ENGINE_ID))
    with pytest.raises(ProtocolError, match="protocol 99"):
        wire.client_handshake(left, None, wire.deadline_after(5))
    left.close()
    right.close()


def test_not_a_listener_is_a_protocol_error() -> None:
    left, right = socket.socketpair()
    right.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64)
    with pytest.raises(ProtocolError, match="not a kvconnect listener"):
        wire.client_handshake(left, None, wire.deadline_after(5))
    left.close()
    right.close()


def test_entries_round_trip() -> None:
    flat = [1, 2, 3, 2**63, 0, 7]
    assert list(wire.unpack_entries(wire.pack_entries(flat), 2)) == flat


def _descriptor() -> SegmentDescriptor:
    return SegmentDescriptor(
        name="127.0.0.1:1",
        engine_id="ab" * 16,
        process_id=process_identity(),
        host_id=host_identity(),
        endpoints={"tcp": "127.0.0.1:1", "shm": "@x"},
        regions=(RegionInfo(1, 4096, "host", True, True),),
    )


def test_descriptor_round_trip_and_region_lookup() -> None:
    descriptor = _descriptor()
    decoded = decode_descriptor(encode_descriptor(descriptor))
    assert decoded == descriptor
    assert decoded.region(1) == RegionInfo(1, 4096, "host", True, True)
    assert decoded.region(2) is None


def test_descriptor_version_mismatch_and_garbage_are_refused() -> None:
    data = msgspec.msgpack.encode(
        {**msgspec.to_builtins(_descriptor()), "version": DESCRIPTOR_VERSION + 1}
    )
    with pytest.raises(ProtocolError, match="version"):
        decode_descriptor(data)
    with pytest.raises(ProtocolError, match="malformed"):
        decode_descriptor(b"\x93garbage")


def test_control_messages_reject_unknown_tags() -> None:
    assert wire.decode_request(wire.encode_control(wire.GetRegionFd(3))) == wire.GetRegionFd(3)
    with pytest.raises(ProtocolError):
        wire.decode_request(msgspec.msgpack.encode({"type": "drop_tables"}))


def test_process_and_host_identity_are_stable() -> None:
    assert host_identity() == host_identity()
    assert process_identity().startswith(host_identity())
