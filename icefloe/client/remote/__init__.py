"""Pieces of the remote transport: HTTP on the client's I/O loop, error bodies, polling, jobs, admin."""
