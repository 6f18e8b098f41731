"""The user messages of a text environment's conversation, shared by every rollout path
(JAX and Python environments) and by `play`, so a trained model always sees one format."""

from __future__ import annotations

from jaxrl_agentic.envs.base import INVALID_ACTION


def first_message(env, state, params) -> str:
    """The first user message: the instructions, then the initial state."""
    return f"{env.instructions(params)}\n{env.render_text(state, params)}"


def feedback_message(env, state, params, reward: float, action: int) -> str:
    """The user message after a turn: what the last reply did, then the new state."""
    if action == INVALID_ACTION:
        head = f"Your reply had no valid action; the state did not change. Reward: {reward:g}."
    else:
        head = f"You chose {env.action_names[action]}. Reward: {reward:g}."
    return f"{head}\n{env.render_text(state, params)}"
