"""algos package."""
