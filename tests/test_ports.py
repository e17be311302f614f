"""The ports a run's services bind: a fixed block below the ephemeral range (megareason/ports.py)."""

from __future__ import annotations

import socket
from contextlib import ExitStack
from datetime import timedelta

import pytest
import torch.distributed as dist

from megareason import ports
from megareason.ports import BLOCK, PortError

LINUX = (32768, 60999)


def _listen(stack: ExitStack, port: int) -> None:
    s = stack.enter_context(socket.socket())
    s.bind(("127.0.0.1", port))
    s.listen()


def test_run_blocks_lie_below_the_ephemeral_range_and_apart():
    blocks = ports.local_blocks(LINUX)
    assert blocks[0] == 20000 and blocks.step == 64
    assert blocks[-1] + BLOCK <= 32768  # the last block ends below 32768
    assert ports.run_block(0, LINUX) == 20000 and ports.run_block(1, LINUX) == 20064
    assert ports.run_block(len(blocks), LINUX) == 20000  # wraps around
    # A site whose ephemeral range starts at 25000: every block ends at or below 25000.
    assert ports.local_blocks((25000, 60999))[-1] + BLOCK <= 25000


def test_an_ephemeral_range_that_leaves_no_block_is_an_error_naming_the_setting():
    with pytest.raises(PortError, match=r"ip_local_port_range\) starts at 20030; set MEGAREASON_PORT_BASE"):
        ports.local_blocks((20030, 60999))


@pytest.mark.parametrize("text, why", [
    ("abc", r"MEGAREASON_PORT_BASE='abc': expected a port number"),
    ("40000", r"40000-40063 must lie within 1024-65535 and outside the ephemeral range 32768-60999"),
    ("32740", r"32740-32803 must lie"),  # reaches into the range
    ("500", r"500-563 must lie within 1024-65535"),
])
def test_a_bad_port_base_is_an_error_naming_the_variable(text, why):
    with pytest.raises(PortError, match=why):
        ports.block_base({"MEGAREASON_PORT_BASE": text}, LINUX)


def test_the_port_base_from_the_environment_is_used_as_given():
    assert ports.block_base({"MEGAREASON_PORT_BASE": "2136"}, LINUX) == 2136
    assert ports.block_base({"MEGAREASON_PORT_BASE": "61000"}, LINUX) == 61000  # above the range is fine


def test_engine_and_server_ports_do_not_overlap_the_rendezvous_ports():
    base = 2136
    engines = [ports.engine_port(k, base) for k in range(ports.ENGINES)]
    assert engines == [base + 16 + 4 * k for k in range(10)]  # 2152, 2156, ..., 2188
    assert ports.engine_port(ports.ENGINES, base) == engines[0]
    assert ports.server_ports(base) == range(base + 56, base + 64)
    assert engines[-1] + ports.ENGINE_PORTS <= ports.server_ports(base).start


def test_the_rendezvous_store_takes_the_first_port_nothing_listens_on():
    base = ports.run_block(12345)
    with ExitStack() as stack:
        _listen(stack, base)
        _listen(stack, base + 1)
        store = ports.rendezvous_store("127.0.0.1", 1, timedelta(seconds=10), base=base)
        assert store.port == base + 2
        store.set("k", "v")
        assert dist.TCPStore("127.0.0.1", base + 2, 1, is_master=False).get("k") == b"v"


def test_a_full_rendezvous_range_is_an_error_naming_it():
    base = ports.run_block(777)
    with ExitStack() as stack:
        for port in range(base, base + ports.RENDEZVOUS):
            _listen(stack, port)
        with pytest.raises(PortError, match=rf"rendezvous on 127.0.0.1: every port in {base}-{base + 15} is in use"):
            ports.rendezvous_store("127.0.0.1", 1, timedelta(seconds=10), base=base)


def test_an_unused_server_port_skips_one_in_use():
    base = ports.run_block(4242)
    with ExitStack() as stack:
        _listen(stack, base + 56)
        assert ports.unused_server_port(base=base) == base + 57


def test_bind_first_passes_on_errors_other_than_a_port_in_use():
    def bind(port):
        raise RuntimeError("connection refused")

    with pytest.raises(RuntimeError, match="connection refused"):
        ports.bind_first(bind, range(3000, 3002), "x")
