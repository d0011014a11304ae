"""``fenced serve``: the HTTP/JSON service over any coordinator backend (docs/server.md).

``pip install 'fenced[server]'``. :func:`create_app` builds the ASGI application;
:func:`fenced.server.serve` runs it on uvicorn.
"""

from fenced.server._app import create_app
from fenced.server._run import serve

__all__ = ["create_app", "serve"]
