"""The coordinator's backends, one package each, chosen by URL (:mod:`fenced.coordinator._connect`).

Each implements :class:`fenced.coordinator.backend.CoordinatorBackend` and imports only that
contract, :mod:`fenced.coordinator._hostclock`, :mod:`fenced._drivers` and :mod:`fenced.core`
(enforced by import-linter): ``memory`` (the executable model), ``sqlite`` (embedded),
``postgres``, ``etcd``.
"""
