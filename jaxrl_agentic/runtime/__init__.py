"""The run's infrastructure: device mesh and sharding (``parallel``), timers
(``timing``), checkpoints, metrics files, the memory plan, compile-event counting and
rebuilding a run from its output directory (``run_loading``)."""
