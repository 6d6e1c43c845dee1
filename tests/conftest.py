"""Shared fixtures: a tiny random Qwen3-VL checkpoint made once per session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_draft(tiny_model, tmp_path_factory) -> str:
    """A draft model for `tiny_model` (speculative decoding's draft_model): its first 2 of 3 layers."""
    from epd.tools.make_draft import make_draft

    return str(make_draft(tiny_model, tmp_path_factory.mktemp("ckpt") / "tiny-draft", num_layers=2))


# Two test processes (pytest-xdist, scripts/test.sh) are each given whole groups of
# tests, a group being what shares a server: the shared mode servers' modules
# (tests/e2e/conftest.py) one group, tests/e2e/hardening (package-scoped servers)
# another, every other module its own (module-scoped servers, Ray clusters, network
# namespaces). So no shared server starts in both processes, and a module's tests keep
# their order. The controller sees test ids only, so the groups are known by path;
# `pytest_collection_modifyitems` checks every test that uses a shared server is in its group.
PACKAGE_GROUPS = ("tests/e2e/hardening/",)


def share_group(nodeid: str) -> str:
    from testkit.mode_servers import SHARING_MODULES

    path = nodeid.split("::")[0]
    if path in SHARING_MODULES:
        return "mode_servers"
    return next((package for package in PACKAGE_GROUPS if path.startswith(package)), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ShareGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return share_group(nodeid)

    # Groups in collection order (tests/e2e first: the long server tests start while the
    # unit tests wait to fill the gaps), not xdist's most-tests-first, which left the
    # long e2e groups for last, one process busy and the other idle.
    config.option.loadscopereorder = False
    return ShareGroups(config, log)


def pytest_collection_modifyitems(config, items):
    """A test sharing a server across modules outside its group would start it in both processes."""
    for item in items:
        group = share_group(item.nodeid)
        if "mode_server" in item.fixturenames and group != "mode_servers":
            raise pytest.UsageError(f"{item.nodeid} uses mode_server: add its module to "
                                    f"testkit.mode_servers.SHARING_MODULES")
        for defs in item._fixtureinfo.name2fixturedefs.values():
            if defs[-1].scope == "package" and group != defs[-1].baseid + "/":  # the package, not its module
                raise pytest.UsageError(f"{item.nodeid} uses the package fixture {defs[-1].argname}: "
                                        f"add {defs[-1].baseid}/ to PACKAGE_GROUPS (tests/conftest.py)")
