"""The run's infrastructure: device mesh and sharding (``parallel``), timers (``timing``),
checkpoints, metrics files, the memory plan and compile-event counting. None of it imports
the pipeline: rebuilding a run from its output directory (``jaxrl_agentic.run_loading``)
builds a ``Pipeline``, so it stands beside the CLIs that use it."""
