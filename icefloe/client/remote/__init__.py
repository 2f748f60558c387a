"""Pieces of the remote transport: HTTP sessions, error bodies, polling, jobs, the exchange drivers."""
