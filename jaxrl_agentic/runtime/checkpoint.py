"""Orbax checkpoints of the whole run: learner state (params, optimizer, KL controller, RNG)
plus the host state (step, env-group seed cursor, chunk estimate, shuffling RNG).

Orbax writes each checkpoint into a temporary directory and renames it into place when it
is complete, and `latest_step()` only lists finished ones: a run killed mid-save (SIGKILL)
never resumes from a half-written checkpoint. Non-finite parameters are refused before
anything is written.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    pass


def _saveable(states: dict) -> dict:
    # Typed PRNG keys are stored as their raw uint32 data.
    return {name: s.replace(rng=jax.random.key_data(s.rng)) if hasattr(s, "rng") else s
            for name, s in states.items()}


def _restored(states: dict) -> dict:
    return {name: s.replace(rng=jax.random.wrap_key_data(s.rng)) if hasattr(s, "rng") else s
            for name, s in states.items()}


def all_finite(tree) -> bool:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int | None = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, train_states: dict, host_state: dict) -> None:
        """`train_states`: name → device state pytree (the learner's, the critic's, …)."""
        if not all(all_finite(s.params) for s in train_states.values()):
            raise CheckpointError(f"refusing to save step {step}: parameters are not finite")
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_saveable(train_states)),
                meta=ocp.args.JsonSave(host_state),
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, step: int | None, train_states_like: dict):
        """(train_states, host_state) of `step` (None = latest), placed like the templates."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no finished checkpoint in {self.directory}")
        if step not in self.manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _saveable(train_states_like))
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
        except ValueError as e:
            # Orbax names the first differing path over several lines: keep them on one.
            where = " ".join(" ".join(str(e).split("\n")[1:3]).split())
            raise CheckpointError(
                f"{self.directory} step {step}: the saved state does not fit this run's "
                f"model and optimizer ({where or str(e).splitlines()[0]}); a checkpoint "
                "written before the decoder blocks were stored stacked (parameters "
                "layers.<i>.*) cannot be resumed: export it with the version that wrote it "
                "(python -m jaxrl_agentic.export) and start from that model with "
                "pretrain=<dir>") from None
        return _restored(restored["state"]), restored["meta"]


def resolve_checkpoint(path: str, output_dir: str) -> tuple[str, int | None]:
    """`resume_from_checkpoint` → (checkpoint directory, step or None for the latest).

    Accepts "latest" (this run's checkpoints), a checkpoints directory, or one step's
    directory inside it (…/checkpoints/<step>).
    """
    if path == "latest":
        return os.path.join(output_dir, "checkpoints"), None
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    base = os.path.basename(path.rstrip("/"))
    if base.isdigit() and os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")):
        return os.path.dirname(path), int(base)
    return path, None
