"""The client of ``fenced serve``: ``fenced.connect("http://host:port")`` (docs/server.md)."""
