"""Hosting: where jobs' engines live, and which jobs share them.

- The sharing rules and the host pool (:mod:`.pool`): a LoRA job joins a
  running host of its base model; any other job gets a host of its own; a host takes its slots
  (:mod:`.slots`) when its first job needs it and frees them when its last leaves.
- The engines seam (:mod:`.seam`): a :class:`~.seam.JobEngines` runs a host's ops by sub-job id;
  :class:`~.seam.LocalEngineHost` holds them in this process, :mod:`.process` in a child process,
  :mod:`.ray_hosts` in Ray actors.

Imports go one way: ``pool`` -> ``seam`` / ``slots``; ``process`` and ``ray_hosts`` -> ``seam``; only
``pool.make_engine_host`` names the kinds. Nothing here imports the job manager.
"""
