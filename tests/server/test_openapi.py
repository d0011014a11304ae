"""The OpenAPI document of ``fenced serve`` (``/openapi.json``): generated from the code, and
the API tested against it property-based (schemathesis) on a live server: no 5xx, every answer
matches the document, every refusal is a problem document."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

from fenced.server._app import create_app
from fenced.testing.server import ServedCoordinator


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedCoordinator]:
    where: Path = tmp_path_factory.mktemp("openapi")
    stores = {"main": f"sqlite:///{where / 'store.db'}"}
    with ServedCoordinator(f"memory://{uuid.uuid4().hex}", poll=0.2, stores=stores) as server:
        yield server


@pytest.fixture(scope="module")
def document(served: ServedCoordinator) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(served.url + "/openapi.json").json()
    return found


def test_the_document_is_openapi_3_1_and_covers_the_api(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.1.")
    paths = set(document["paths"])
    for expected in (
        "/v1/leases/{resource}:acquire",
        "/v1/leases/{resource}:renew",
        "/v1/leases/{resource}:release",
        "/v1/leases/{resource}",
        "/v1/leases/{resource}:history",
        "/v1/coordinator",
        "/v1/events",
        "/healthz",
    ):
        assert expected in paths, expected
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert operation.get("summary") or operation.get("description"), (method, path)


def test_a_refusal_is_a_problem_document_with_a_stable_type(served: ServedCoordinator) -> None:
    with httpx.Client(base_url=served.url) as client:
        first = client.post("/v1/leases/jobs/a:acquire", json={"ttl": 5})
        assert first.status_code == 200
        busy = client.post("/v1/leases/jobs/a:acquire", json={"ttl": 5})
        bad = client.post("/v1/leases/jobs/a:acquire", json={"ttl": "five"})
        bad_name = client.post("/v1/leases/%20:acquire", json={"ttl": 5})
        release = {"epoch": first.json()["epoch"], "owner": first.json()["owner"]}
        assert client.post("/v1/leases/jobs/a:release", json=release).json() == {"released": True}
    assert busy.status_code == 409 and busy.headers["content-type"] == "application/problem+json"
    assert busy.json()["type"] == "urn:fenced:problem:busy"
    assert busy.json()["holder"] == first.json()["holder"]
    assert bad.status_code == 422 and bad.json()["type"] == "urn:fenced:problem:invalid-request"
    assert bad_name.status_code == 400
    assert bad_name.json()["type"] == "urn:fenced:problem:invalid-name"


# The document comes from the code (an app that is never started); the cases go to the live
# server above. The event stream never ends by design (tested in test_events.py).
schema = schemathesis.openapi.from_dict(create_app("memory://openapi").openapi()).exclude(
    path="/v1/events"
)


@schema.parametrize()
@hypothesis.settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_the_api_keeps_its_document(case: Any, served: ServedCoordinator) -> None:
    """No 5xx, and every answer (status, headers, body) is one the document promises.

    Not checked: that every schema-valid request is accepted. Some rules are not in the JSON
    schema: the alphabet of a resource name in the path, a ttl's upper bound, epochs past 2**53
    that a JSON number cannot carry exactly; such requests are refused with a 4xx problem
    document, which the checks above do verify."""
    case.call_and_validate(base_url=served.url, excluded_checks=[positive_data_acceptance])
