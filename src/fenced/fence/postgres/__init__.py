"""``postgresql://`` stores, and the guard for the caller's own PostgreSQL transactions."""
