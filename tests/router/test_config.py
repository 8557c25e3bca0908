"""RouterConfig validation and the ``kvconnect router`` flags that build it."""

from __future__ import annotations

import argparse

import pytest

from kvconnect.errors import ConfigError
from kvconnect.router.command import add_arguments, config_from_args
from kvconnect.router.config import EventSource, PolicyName, RouterConfig
from kvconnect.router.types import Role

P, D, U = "http://p:8100", "http://d:8200", "http://u:8300"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_build_the_config_with_urls_normalised_and_roles() -> None:
    config = config_from_args(
        _args(
            "--prefill", P + "/", "--decode", D, "--unified", U,
            "--events", f"{P}=tcp://p:5557,tcp://p:5558", f"{D}/=tcp://d:5557",
            "--store-events", "tcp://m:5600",
            "--policy", "round-robin", "--ttft-slo", "2.5", "--block-size", "32",
        )
    )  # fmt: skip
    assert config.prefill == (P,)
    assert config.roles() == {P: Role.PREFILL, D: Role.DECODE, U: Role.UNIFIED}
    assert config.events == (
        EventSource(P, "tcp://p:5557", "tcp://p:5558"),
        EventSource(D, "tcp://d:5557", None),
    )
    assert config.store_events == EventSource("", "tcp://m:5600", None)
    assert config.policy is PolicyName.ROUND_ROBIN
    assert (config.ttft_slo, config.tbt_slo, config.block_size) == (2.5, None, 32)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill": (P,)}, "prefill and decode"),
        ({"unified": ("p:8100",)}, "http"),
        ({"unified": (U + "?x=1",)}, "query"),
        ({"prefill": (P,), "decode": (P + "/",)}, "twice"),
        ({"unified": (U,), "policy": "fastest"}, "cache, round-robin, random"),
        ({"unified": (U,), "health_interval": 0}, "health_interval"),
        ({"unified": (U,), "max_attempts": 0}, "max_attempts"),
        ({"unified": (U,), "ttft_slo": -1.0}, "ttft_slo"),
        ({"unified": (U,), "port": 70000}, "port"),
        ({"unified": (U,), "events": (EventSource(P, "tcp://p:1"),)}, "not an instance"),
        (
            {"unified": (U,), "events": (EventSource(U, "tcp://a:1"), EventSource(U, "tcp://b:1"))},
            "given twice",
        ),
    ],
)
def test_invalid_configs_are_refused_saying_why(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("item", ["tcp://p:5557", f"{P}=", f"{P}=,tcp://p:5558"])
def test_malformed_events_flags_are_refused(item: str) -> None:
    with pytest.raises(ConfigError, match=r"events|endpoint"):
        config_from_args(_args("--unified", P, "--events", item))


def test_the_config_is_frozen() -> None:
    config = RouterConfig(unified=(U,))
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
