"""Checks a developer runs on kvroute's own source (``python -m kvroute.devtools.layers``).

Nothing here is imported by the product; the tests use the same code.
"""
