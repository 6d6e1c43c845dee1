import pytest

from epd.transport.wire.addresses import Addresses, is_tcp_address, parse_worker_id, tcp_address, worker_id
from epd.transport.wire.roles import Role


def test_ipc_layout():
    addrs = Addresses.for_run("abc123")
    assert addrs.worker("prefill", 0) == "ipc:///tmp/epd-abc123/prefill-0.sock"
    assert addrs.worker("encoder", 3) == "ipc:///tmp/epd-abc123/encoder-3.sock"
    assert addrs.collector() == "ipc:///tmp/epd-abc123/api.sock"


def test_tcp_addresses_are_distinct_and_in_range():
    addrs = Addresses.tcp(base_port=30000, max_workers_per_role=8)
    all_addrs = [addrs.collector()] + [addrs.worker(r, k) for r in Role for k in range(8)]
    assert len(set(all_addrs)) == len(all_addrs)
    assert all(a.startswith("tcp://127.0.0.1:") for a in all_addrs)
    ports = sorted(int(a.rsplit(":", 1)[1]) for a in all_addrs)
    assert ports[0] == 30000 and ports[-1] == 30000 + len(Role) * 8


def test_tcp_other_host():
    assert Addresses.tcp("10.1.2.3", 40000).collector() == "tcp://10.1.2.3:40000"


@pytest.mark.parametrize("role, index", [("vision", 0), ("prefill", -1), ("decode", 64)])
def test_bad_worker_rejected(role, index):
    with pytest.raises(ValueError):
        Addresses.tcp().worker(role, index)


def test_port_range_checked():
    with pytest.raises(ValueError):
        Addresses.tcp(base_port=65500)
    for port in (0, 65536):
        with pytest.raises(ValueError, match="outside 1..65535"):
            tcp_address("127.0.0.1", port)


def test_single_tcp_endpoints():
    assert tcp_address("10.1.2.3", 65535) == "tcp://10.1.2.3:65535"
    assert is_tcp_address("tcp://10.1.2.3:8001") and is_tcp_address(tcp_address("host-a", 1))
    for bad in ("10.1.2.3:8001", "ipc:///tmp/x.sock", "tcp://10.1.2.3", "tcp://:8001", "tcp://h:0", "tcp://h:99999",
                "tcp://h:port"):
        assert not is_tcp_address(bad), bad


def test_ipc_path_too_long():
    with pytest.raises(ValueError, match="too long"):
        Addresses.ipc("/tmp/" + "x" * 120).collector()


def test_worker_id_round_trip():
    assert worker_id("pd", 12) == "pd-12"
    assert parse_worker_id("pd-12") == ("pd", 12)
    assert parse_worker_id("aggregated-0")[0] is Role.AGGREGATED
    for bad in ("pd", "gpu-1", "prefill-x", "prefill--1"):
        with pytest.raises(ValueError):
            parse_worker_id(bad)
