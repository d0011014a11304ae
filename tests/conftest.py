"""Test-session set-up shared by every test module."""

from __future__ import annotations

import pytest

# The conformance suites live in the public package fenced.testing: rewrite their asserts too.
pytest.register_assert_rewrite("fenced.testing", "verify_networked")
from etcd_fixtures import etcd_cluster  # noqa: E402, F401
from postgres_fixtures import postgres_server  # noqa: E402, F401
