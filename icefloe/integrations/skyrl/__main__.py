"""``python -m icefloe.integrations.skyrl <SkyRL overrides>``: see :mod:`icefloe.integrations.skyrl.launch`."""

from icefloe.integrations.skyrl.launch import main

if __name__ == "__main__":
    main()
