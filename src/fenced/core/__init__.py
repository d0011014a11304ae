"""The pure core of fenced: names, tokens, lease values and states, policy, errors, clocks.

Nothing here does I/O, so the same logic serves the sync API, a future async API and the tests.
"""
