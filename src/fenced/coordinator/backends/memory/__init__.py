"""``memory://NAME``: the in-process backend, the executable model of the lease rules."""
