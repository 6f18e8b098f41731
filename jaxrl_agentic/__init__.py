"""jaxrl_agentic: RL for language-model agents in multi-turn environments, in JAX."""

__version__ = "0.1.0"
