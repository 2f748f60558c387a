"""``icefloe serve``: the service side of the training API (FastAPI on uvicorn).

Build the app with :func:`create_app`, run it with :func:`serve` (foreground) or
:class:`ServerThread` (in-process, on a loopback port).
"""

from icefloe.service.app import ServerThread, create_app, serve
from icefloe.service.settings import ServeSettings

__all__ = ["ServeSettings", "ServerThread", "create_app", "serve"]
