"""Framework integrations: verl's remote-backend plugin and SkyRL's entrypoint.

Each integration lowers its framework's batches through :mod:`icefloe.client.batch` and drives the
public client API; nothing here imports torch, Ray or vLLM at import time.
"""
