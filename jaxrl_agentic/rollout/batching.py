"""The rollout's schedules by name (`rollout_batching`) and the rule on their settings.

`"turn"`: turn lockstep (`loop.play_turns`); `"continuous"`: continuous batching over
sampler slots (`continuous.play_continuous`). This module imports nothing, so the config
can check these names before JAX starts: importing the rest of the rollout initialises
JAX's backend, and on a pod `jax.distributed.initialize` must come first.
"""

ROLLOUT_BATCHING = ("turn", "continuous")


def check_batching(batching: str, slots: int, decode_chunk: int) -> None:
    if batching not in ROLLOUT_BATCHING:
        raise ValueError(f"rollout_batching must be one of {ROLLOUT_BATCHING}, got "
                         f"{batching!r}")
    if int(slots) < 0 or int(decode_chunk) < 1:
        raise ValueError(f"rollout_slots must be ≥ 0 (0 = one per episode) and "
                         f"decode_chunk_tokens ≥ 1, got {slots} and {decode_chunk}")
