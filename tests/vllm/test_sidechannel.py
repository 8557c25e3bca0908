"""The prefill side channel without the cluster token and under hostile input (real sockets)."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from kvconnect.errors import PeerUnreachable
from kvconnect.vllm import messages as msg
from kvconnect.vllm.sidechannel import SideChannelClient, SideChannelServer
from tests.support.dealer import RawDealer
from tests.support.waiting import wait_for

TOKEN = "side-channel-test-token"
_PURPOSE = "vllm side channel"  # its CURVE key label


@pytest.fixture
def served() -> Iterator[tuple[SideChannelServer, list[msg.Request]]]:
    seen: list[msg.Request] = []

    def handler(request: msg.Request) -> msg.Reply:
        seen.append(request)
        return msg.Ack(True)

    server = SideChannelServer("127.0.0.1", 0, handler, token=TOKEN)
    server.start()
    yield server, seen
    server.close()


def test_calls_without_the_token_never_reach_the_handler(
    served: tuple[SideChannelServer, list[msg.Request]],
    raw_dealer: RawDealer,
) -> None:
    server, seen = served
    endpoint = f"tcp://127.0.0.1:{server.port}"
    give_up = msgspec.msgpack.encode(msg.Envelope(msg.PROTOCOL_VERSION, 1, msg.GiveUp(["r1"])))
    plain = raw_dealer(endpoint, None, _PURPOSE)
    wrong = raw_dealer(endpoint, "a-wrong-token", _PURPOSE)
    for sock in (plain, wrong):
        sock.send(give_up)
    wait_for(lambda: server.refused >= 2, "refused handshakes not counted")
    assert not plain.poll(200)
    assert not wrong.poll(0)
    assert seen == []
    stranger = SideChannelClient(0.5, token="a-wrong-token")
    with pytest.raises(PeerUnreachable, match="cluster token"):
        stranger.call(endpoint, msg.GiveUp(["r2"]))
    stranger.close()
    assert seen == []
    friend = SideChannelClient(2.0, token=TOKEN)
    assert friend.call(endpoint, msg.GiveUp(["r3"])) == msg.Ack(True)
    friend.close()
    assert seen == [msg.GiveUp(["r3"])]


def test_hostile_messages_cost_only_themselves(
    served: tuple[SideChannelServer, list[msg.Request]],
    raw_dealer: RawDealer,
) -> None:
    server, seen = served
    endpoint = f"tcp://127.0.0.1:{server.port}"
    raw = raw_dealer(endpoint, TOKEN, _PURPOSE)
    raw.send(b"\x91" * 100_000 + b"\xc0")  # nesting deep enough to exhaust the decoder
    raw.send(b"\xc1" * 32)
    wait_for(lambda: server.malformed >= 2, "hostile messages not dropped")
    friend = SideChannelClient(2.0, token=TOKEN)
    assert friend.call(endpoint, msg.Renew(["r1"])) == msg.Ack(True)
    friend.close()
    assert seen == [msg.Renew(["r1"])]
