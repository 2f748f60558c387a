"""One APIRouter per resource; :data:`API_PREFIX` is the training API's path prefix."""

from icefloe.service.routes.common import API_PREFIX

__all__ = ["API_PREFIX"]
