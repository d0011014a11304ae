"""The user-facing Coordinator and its backends."""
