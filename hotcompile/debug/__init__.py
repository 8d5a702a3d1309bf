"""Debugging aids: reports, graph dumps."""
