"""Session hygiene: a 50-step loop in a subprocess with ResourceWarning as error and asyncio debug on.

Regression: a transport that rebuilt its HTTP session per event loop without closing the old one
printed dozens of "unclosed" warnings per run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_LOOP = textwrap.dedent(
    """
    import asyncio, sys, warnings
    import torch
    torch.set_num_threads(1)
    from icefloe.client import AsyncClient, Client, build_batch
    from icefloe.config import ClientConfig

    backend = {"type": "remote", "base_url": sys.argv[1], "poll_interval_s": 0.02, "poll_max_interval_s": 0.1}
    config = ClientConfig.build(model="tiny:arith", backend=backend)
    batch = build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0)

    client = AsyncClient(config)  # built outside the loop: its first build imports httpx (slow, blocking)
    # Debug mode's slow-callback report measures wall time, so on shared CI cores it reports the
    # scheduler; a 2 s bar, on this loop and the client's own I/O loop, still catches a blocking call.
    # Everything else stays strict. (A loop sets its own 0.1 s bar when built, so the bar goes in there.)
    _build_loop = asyncio.base_events.BaseEventLoop.__init__
    def _build_loop_with_bar(self, *args, **kwargs):
        _build_loop(self, *args, **kwargs)
        self.slow_callback_duration = 2.0
    asyncio.base_events.BaseEventLoop.__init__ = _build_loop_with_bar

    async def main() -> None:
        async with client:
            for step in range(50):
                await asyncio.gather(client.fwd_bwd(batch), client.step())
                if step % 10 == 0:
                    await client.sync_weights()
                    await client.generate([[1, 2, 3]], {"max_tokens": 2})

    asyncio.run(main(), debug=True)
    with Client(config) as client:  # the blocking flavour, and a second loop after the first closed
        for _ in range(5):
            client.fwd_bwd(batch)
            client.step()
    shared = AsyncClient(config)
    async def step() -> None:
        await shared.fwd_bwd(batch)
        await shared.step()

    for _ in range(3):
        asyncio.run(step(), debug=True)
    asyncio.run(shared.shutdown(), debug=True)
    print("loop-ok")
    """
)


def test_remote_fifty_step_loop_prints_no_warning(service):
    env = {**os.environ, "PYTHONASYNCIODEBUG": "1", "PYTHONWARNINGS": "error::ResourceWarning"}
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", _LOOP, service.base_url],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("loop-ok")
    noisy = [
        line
        for line in done.stderr.splitlines()
        if any(word in line for word in ("Warning", "unclosed", "Exception ignored", "Executing", "never awaited"))
    ]
    assert noisy == [], "\n".join(noisy[:20])
