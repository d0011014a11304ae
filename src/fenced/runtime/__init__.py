"""Keeping leases alive: background renewal, loss signalling, and child processes."""
