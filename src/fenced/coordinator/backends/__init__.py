"""Coordinator backends: one per URL scheme, each implementing :mod:`..backend`'s contract."""
