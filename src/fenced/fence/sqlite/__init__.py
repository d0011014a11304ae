"""``sqlite:`` stores: objects and records in one SQLite database."""
