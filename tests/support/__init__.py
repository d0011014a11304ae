"""Shared test support: fixtures that start real servers, fault helpers, worker programs."""
