"""The pure-ASGI layers in front of each API the service mounts, stacked by one function in one order.

Each API is an app of its own with its own auth adapter (:class:`~icefloe.service.middleware.Access`)
and error rules: the training API with the dashboard, and the Tinker API mounted under its own path.
:func:`api_layers` lists one API's stack, :func:`install_edge` puts a stack on its app after checking
it against :data:`RULES`, the orderings that keep a promise (a swap that breaks one raises at
``create_app``, naming the promise). The service's own outermost layers (the refusal log, the
local-only guard) come before :class:`Mounts`, which hands a mounted API's requests to its stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from icefloe.service.batches import Batches
from icefloe.service.logins import Logins
from icefloe.service.middleware import Access, BodyLimit, IdempotencyKeys, JsonBodies, RequireToken
from icefloe.service.origins import LocalOnly
from icefloe.service.refusals import LogRefusals
from icefloe.service.sequencing import Sequencing
from icefloe.service.settings import ServeSettings
from icefloe.service.store import Database

__all__ = ["RULES", "Layer", "Mounts", "api_layers", "check_order", "install_edge", "service_layers"]

Layer = tuple[type, dict[str, Any]]  # a layer's class and the keyword arguments it is built with


class Mounts:
    """Hands a request under a mounted API's path to that API's own stack; the rest goes on."""

    def __init__(self, app: ASGIApp, *, mounts: Sequence[Mount]) -> None:
        self.app = app
        self.mounts = mounts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for mount in self.mounts:
                match, child = mount.matches(scope)
                if match is Match.FULL:
                    scope.update(child)
                    await mount.app(scope, receive, send)
                    return
        await self.app(scope, receive, send)


_READERS = (BodyLimit, Batches, IdempotencyKeys, JsonBodies)  # each may read a body
# (before, after, the promise): where both are in a stack, the first ``before`` comes before the first ``after``.
RULES: tuple[tuple[type, type, str], ...] = (
    *((LogRefusals, layer, "every refusal is logged, those of the layers in front of the routes too")
      for layer in (LocalOnly, Mounts, RequireToken, *_READERS)),
    (LocalOnly, Mounts, "with auth off, a page of another site is refused before any API sees it"),
    (Mounts, RequireToken, "a mounted API checks its callers' token its own way"),
    *((RequireToken, layer, "nothing of a body is read before the token passes") for layer in _READERS),
    *((BodyLimit, layer, "a body is capped before it is kept") for layer in _READERS[1:]),
    *((Batches, layer, "each part of a batch is keyed, checked and routed as if it came alone")
      for layer in (IdempotencyKeys, JsonBodies)),
)  # fmt: skip


def api_layers(
    settings: ServeSettings,
    *,
    db: Database,
    logins: Logins,
    access: Access,
    batches: bool,
    routes_parse_json: bool,
    sequencing: Sequencing | None,
    waited_answers: bool,
    json_too_large: str,
) -> list[Layer]:
    """One API's stack, outermost first: its token, the body cap, ``requests:batch`` (``batches``), the
    refusal log of each part, ``Idempotency-Key``, the JSON bounds (the size only when
    ``routes_parse_json``: the routes check their bodies themselves). With ``sequencing`` (the API's
    routes take ``Icefloe-Sequence`` turns), a numbered POST these layers refuse uses its number at once;
    ``waited_answers``: its POSTs may answer with their request's poll (``?wait=``), naming what they
    accepted in a header the idempotency layer reads and takes off. ``json_too_large``: what a caller whose
    JSON body is over the cap can send instead, in that API's terms."""
    layers: list[Layer] = [
        (RequireToken, {"settings": settings, "logins": logins, "access": access}),
        (BodyLimit, {"max_bytes": settings.max_post_bytes, "sequencing": sequencing}),
    ]
    if batches:  # each part then runs through the layers below, and is logged, as if it came alone
        layers += [(Batches, {}), (LogRefusals, {"auth_enabled": settings.auth_enabled})]
    return [
        *layers,
        (IdempotencyKeys, {"db": db, "settings": settings, "sequencing": sequencing, "waited_answers": waited_answers}),
        (JsonBodies, {"parse": not routes_parse_json, "sequencing": sequencing, "too_large": json_too_large}),
    ]


def service_layers(settings: ServeSettings, mounts: Sequence[Mount]) -> list[Layer]:
    """The service's outermost layers, in front of every API: the refusal log, the local-only guard
    when there are no tokens, and the hand-off to the mounted APIs."""
    layers: list[Layer] = [(LogRefusals, {"auth_enabled": settings.auth_enabled})]
    if not settings.auth_enabled:  # with no token to stop them, no page of another site gets in
        layers.append((LocalOnly, {"public_url": settings.public_url}))
    return [*layers, (Mounts, {"mounts": mounts})]


def check_order(layers: Sequence[Layer]) -> None:
    """Raise ValueError naming the promise a stack (outermost first) breaks, if any."""
    first: dict[type, int] = {}
    for index, (kind, _) in enumerate(layers):
        first.setdefault(kind, index)
    for before, after, promise in RULES:
        if before in first and after in first and first[before] > first[after]:
            raise ValueError(f"{before.__name__} must come before {after.__name__}: {promise}")


def install_edge(app: FastAPI, layers: Sequence[Layer]) -> None:
    """Put ``layers`` (outermost first) in front of ``app``'s routes, once their order is checked."""
    check_order(layers)
    for kind, options in reversed(layers):  # add_middleware puts each in front of those added before it
        app.add_middleware(kind, **options)
