"""Weights exported by ``save_weights_external``: each file encrypted to the caller's age recipients.

age (https://age-encryption.org) through the ``pyrage`` package, which the ``tinker`` extra brings:
``x25519`` recipients (``age1...``) and SSH public keys, as the SDK documents. The tinker-cookbook's
``weights.download`` sends a key it made for one download and decrypts the files it fetches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from icefloe.protocol import InvalidRequestError

__all__ = ["encrypt_folder", "recipients_of"]

_MAX_RECIPIENTS = 10  # as the SDK documents
_SUFFIX = ".age"


def recipients_of(raw: Any, where: str) -> list[Any] | None:
    """The age recipients ``raw`` names (None or empty: no encryption); a bad one is a 400 naming it."""
    if not raw:
        return None
    if not isinstance(raw, list) or len(raw) > _MAX_RECIPIENTS or not all(isinstance(r, str) for r in raw):
        raise InvalidRequestError(f"{where} must be a list of at most {_MAX_RECIPIENTS} age or SSH public keys")
    try:
        import pyrage
    except ImportError:
        raise InvalidRequestError(
            f"{where} needs the pyrage package on the service: pip install 'icefloe[tinker]'"
        ) from None
    parsed = []
    for index, text in enumerate(raw):
        kind = pyrage.x25519.Recipient if text.startswith("age1") else pyrage.ssh.Recipient
        try:
            parsed.append(kind.from_str(text.strip()))
        except Exception:  # pyrage.RecipientError, or a ValueError for an SSH key it cannot read
            raise InvalidRequestError(
                f"{where}.{index} is not an age recipient (age1...) or an SSH public key (ssh-ed25519 / ssh-rsa ...)"
            ) from None
    return parsed


def encrypt_folder(folder: Path, recipients: list[Any] | None) -> int:
    """Encrypt every file under ``folder`` to ``recipients`` as ``<file>.age``, removing the plain file
    (None: leave them as they are); the folder's size in bytes afterwards."""
    if recipients:
        import pyrage

        for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != _SUFFIX):
            pyrage.encrypt_file(str(path), str(path.with_name(path.name + _SUFFIX)), recipients)
            path.unlink()
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
