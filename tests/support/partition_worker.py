"""A worker for the real-partition tests, run inside a lab host (:mod:`fenced.testing.netlab`).

``python partition_worker.py COORDINATOR_URL STORE_URL``: reads one JSON command per line on
stdin and answers one JSON line each on stdout, so the test decides when each step happens
(``acquire``, ``renew``, ``fence``, ``put``, ``get``); an exception is answered as
``{"error": NAME, "message": …}``, never raised.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import fenced


def main(coordinator_url: str, store_url: str) -> None:
    coord = fenced.connect(coordinator_url)
    store = fenced.open_store(store_url)
    lease: Any = None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        result: dict[str, Any]
        try:
            if op == "acquire":
                lease = coord.acquire(command["resource"], command["ttl"], command.get("wait", 5))
                result = {"epoch": lease.epoch}
            elif op == "renew":
                lease = coord.renew(lease)
                result = {"epoch": lease.epoch}
            elif op == "fence":
                result = {"floor": store.fence(lease.token)}
            elif op == "put":
                value = command["value"].encode()
                version = store.put(lease.token, command["key"], value, op_id=command.get("op_id"))
                result = {"version": version.version, "epoch": version.epoch}
            else:
                result = {"error": "UnknownCommand", "message": op}
        except Exception as error:  # answered, for the test to judge
            result = {"error": type(error).__name__, "message": str(error)}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
