"""The OpenAPI document of the app: FastAPI's, with every refusal documented as what it is.

FastAPI documents a ``422`` with its own validation-error body on each route that takes input;
fenced answers every refusal (4xx) and failure (5xx) with an RFC 9457 problem document
(``application/problem+json``, :mod:`fenced.core._problems`) instead. The document therefore
replaces those entries with ``4XX`` and ``5XX`` responses whose body is the ``Problem`` schema,
and lists the problem types with their statuses in that schema's description.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from fenced.core._problems import PROBLEMS

__all__ = ["install_openapi"]

PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Problem",
    "description": "An RFC 9457 problem document. `type` is stable per fenced exception:\n\n"
    + "\n".join(f"- `{p.type}` ({p.status}): {p.title}" for p in PROBLEMS),
    "required": ["type", "title", "status"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
    },
    "additionalProperties": True,
}


def _problem(description: str) -> dict[str, Any]:
    reference = {"$ref": "#/components/schemas/Problem"}
    return {
        "description": description,
        "content": {"application/problem+json": {"schema": reference}},
    }


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the document described in the module docstring (built on
    first use, then cached, as FastAPI's own)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
        )
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                responses["4XX"] = _problem("Refused: nothing was changed (a problem document).")
                responses["5XX"] = _problem(
                    "Failed: 503 nothing happened (retry); 504 the outcome is unknown (retry "
                    "with the same request_id or Idempotency-Key)."
                )
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        schemas["Problem"] = PROBLEM_SCHEMA
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
