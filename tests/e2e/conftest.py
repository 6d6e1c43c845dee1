"""The shared server of each mode (tests/testkit/mode_servers.py says who shares it
and why each flag is there). Session-scoped and parametrized: pytest runs
every test of one mode, whatever its module, before it starts the next mode's
server, and stops each server once its mode's tests are done."""
from __future__ import annotations

import pytest
from testkit.mode_servers import MODES, start_mode_server


@pytest.fixture(scope="session", params=MODES)
def mode_server(request, tiny_model, tmp_path_factory):
    srv = start_mode_server(tiny_model, request.param, tmp_path_factory.mktemp(request.param))
    yield srv
    assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"
