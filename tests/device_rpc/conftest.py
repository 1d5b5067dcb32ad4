"""A TVM RPC tracker on loopback for each device test module."""

import pytest

from tightfit.device_rpc.tracker import TrackerAddress, free_port, start_tracker, stop_process_group


@pytest.fixture(scope="module")
def tracker():
    port = free_port(9290)
    process = start_tracker(port)
    yield TrackerAddress("127.0.0.1", port)
    stop_process_group(process.pid)
