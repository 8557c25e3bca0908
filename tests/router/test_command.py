"""``kvconnect router`` as users run it: a real process in front of a stand-in instance."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import aiohttp
import pytest

from tests.router.standin import StandIn, completion_text

pytestmark = pytest.mark.integration


def test_the_command_serves_until_sigterm_and_exits_cleanly() -> None:
    async def main() -> None:
        instance = StandIn("a")
        await instance.start()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvconnect.cli", "router", "--unified", instance.url,
            "--port", "0", "--policy", "round-robin",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert process.stdout is not None
            line = await asyncio.wait_for(process.stdout.readline(), timeout=60)
            url = json.loads(line)["router"]
            async with aiohttp.ClientSession() as client:
                body = {"prompt": "from the command line"}
                async with client.post(url + "/v1/completions", json=body) as reply:
                    assert reply.status == 200
                    text = (await reply.json())["choices"][0]["text"]
                    assert text == completion_text("from the command line")
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), timeout=30) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await instance.stop()

    asyncio.run(main())


def test_an_invalid_fleet_is_a_configuration_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvconnect.cli", "router", "--prefill", "http://p:1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 2
    assert "prefill and decode" in result.stderr
