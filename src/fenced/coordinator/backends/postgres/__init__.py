"""``postgresql://``: the PostgreSQL coordinator: the backend and its schema (tables, functions)."""
