"""A loss that fails a call part-way, for the tests of what a failed forward-backward leaves behind."""

from __future__ import annotations

REFUSING_LOSS = "grpo_refusing_a_pass"


def register_refusing_loss(monkeypatch) -> list[tuple[str | None, bool]]:
    """Registers :data:`REFUSING_LOSS` for engines in this process: GRPO that refuses a call's pass number
    ``refuse_at_pass`` of its loss config, so the call fails after its earlier passes added to the gradients.
    Returns each time it ran: the call's ``tag`` (of its loss config), whether it refused."""
    from icefloe.engines import losses
    from icefloe.protocol import InvalidRequestError

    seen: list[tuple[str | None, bool]] = []
    grpo = losses.get_loss("grpo")

    def refusing(logprobs_BS, *, context, config, entropy_BS):
        config["passes_seen"] = config.get("passes_seen", 0) + 1  # the call's own copy of its loss config
        refused = config["passes_seen"] == config.get("refuse_at_pass")
        seen.append((config.get("tag"), refused))
        if refused:
            raise InvalidRequestError(f"{REFUSING_LOSS} refuses pass {config['passes_seen']}")
        return grpo(logprobs_BS, context=context, config=config, entropy_BS=entropy_BS)

    monkeypatch.setitem(losses._LOSSES, REFUSING_LOSS, refusing)
    monkeypatch.setitem(losses._REQUIRES, REFUSING_LOSS, ("advantages",))
    return seen
