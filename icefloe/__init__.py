"""icefloe: a training-and-sampling backend for LLM reinforcement learning.

Import what you use from its layer (``icefloe.client``, ``icefloe.config``, ``icefloe.protocol``);
this package module stays import-light so a remote-only driver never loads torch.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
