"""Engines as Ray actors: placement (bundles, GPU fractions), the actor classes, and driver-side groups.

Both the ``ray`` transport and the service's Ray engine host build on these modules. Importing this
package imports Ray; nothing outside the Ray paths does.
"""

from icefloe.engines.ray.actors import SamplingActor, TrainingActor
from icefloe.engines.ray.groups import (
    ActorGroup,
    SamplerGroup,
    TrainerGroup,
    actor_failures,
    gather,
    link_weight_sync,
    sync_weights,
)
from icefloe.engines.ray.placement import (
    WorkerSpec,
    collective_backend,
    create_placement_group,
    plan_placement,
)

__all__ = [
    "ActorGroup",
    "SamplerGroup",
    "SamplingActor",
    "TrainerGroup",
    "TrainingActor",
    "WorkerSpec",
    "actor_failures",
    "collective_backend",
    "create_placement_group",
    "gather",
    "link_weight_sync",
    "plan_placement",
    "sync_weights",
]
