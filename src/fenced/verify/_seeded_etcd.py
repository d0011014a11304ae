"""The seeded defect of the etcd coordinator (``fenced verify --mutants``).

Loaded by :func:`fenced.verify._seeded.coordinator_backend` only for an ``etcd:`` coordinator
with this defect (it needs the etcd extra).

``etcd-grant-no-revision-compare``: the grant transaction
(:func:`~fenced.coordinator.backends.etcd._plans.grant_plan`) writes the epoch it read + 1
without comparing the mod revision of the key it read it from (``P/res/NAME``): the
read-modify-write of a careless implementation. It still compares what such an implementation
would: that no lease key exists, the queue (empty, or the caller first in line), the request id
and the minimum epoch. A grant made from a stale view of the resource — a waiter or a newcomer
that did not see the grants made since it last read it, a fresh process that never read it —
succeeds whenever the resource is free, and writes an epoch that was issued already.
"""

from __future__ import annotations

import dataclasses

from fenced.coordinator.backend import GrantRequest
from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._backend import EtcdBackend
from fenced.coordinator.backends.etcd._ops import _cmp
from fenced.coordinator.backends.etcd._plans import GrantPlan
from fenced.coordinator.backends.etcd._waitqueue import EtcdTicket
from fenced.verify._seeded import ETCD_GRANT_NO_REVISION_COMPARE

__all__ = ["SeededEtcdBackend", "without_revision_compare"]


def without_revision_compare(plan: GrantPlan, res_key: bytes) -> GrantPlan:
    """``plan`` without its compare of ``res_key``'s mod revision (the revision it read).

    A plan without that compare exactly once (the transaction was rewritten) is a
    :class:`ValueError`: the defect must be written again, not run as the correct grant.
    """
    compare = _cmp(res_key, "MOD", plan.compared[0])
    compares = list(plan.request.compare)
    if compares.count(compare) != 1:
        raise ValueError(f"a seeded defect expects the compare {compare} exactly once")
    compares.remove(compare)
    request = rpc.TxnRequest(
        compare=compares, success=list(plan.request.success), failure=list(plan.request.failure)
    )
    return dataclasses.replace(plan, request=request)


class SeededEtcdBackend(EtcdBackend):
    """The etcd coordinator with ``etcd-grant-no-revision-compare`` (module docstring)."""

    def __init__(self, url: str, defects: frozenset[str]) -> None:
        super().__init__(url)
        self._careless = ETCD_GRANT_NO_REVISION_COMPARE in defects

    def _grant_plan(
        self, request: GrantRequest, ticket: EtcdTicket | None, lease_id: int, retention: int | None
    ) -> GrantPlan:
        plan = super()._grant_plan(request, ticket, lease_id, retention)
        if not self._careless:
            return plan
        return without_revision_compare(plan, self._keys.res(request.resource))
