"""Test-session set-up shared by every test module."""

from __future__ import annotations

import pytest

# The conformance suites live in the public package fenced.testing: rewrite their asserts too.
pytest.register_assert_rewrite("fenced.testing", "support.verify_networked")
from support.cli_processes import start_fenced  # noqa: E402, F401
from support.coordinators import open_coord  # noqa: E402, F401
from support.etcd_fixtures import etcd_cluster  # noqa: E402, F401
from support.local_users import public_dir, umask  # noqa: E402, F401
from support.postgres_fixtures import postgres_server  # noqa: E402, F401
from support.rgw_fixtures import rgw_server  # noqa: E402, F401
from support.zookeeper_fixtures import zk_ensemble, zk_url  # noqa: E402, F401
