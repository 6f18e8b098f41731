"""Learning-rate schedules that end on time when the number of updates is not known.

The problem. An optax schedule is a function of the update count ``u`` and must be told
the total ``N`` up front. In step-wise training each trajectory yields one sample per turn
(a "chunk"), so a pipeline step makes

    U_s = ppo_epochs · ceil(trajectories_per_step · c_s / mini_batch_size)

updates, where ``c_s`` (chunks per trajectory in step ``s``) depends on how long the
episodes were — known only after the rollout. Sizing ``N`` from trajectories alone (``c =
1``) made the LR reach zero at pipeline step 123 of 200 in a peer's run; a fixed guess
``c = max_turns // 2`` can be off 2× either way (ending early, or never decaying).

The design. The LR is driven by *progress through the pipeline steps*, which is known
exactly. For update ``i`` (0-based) of the ``U_s`` updates of step ``s`` (0-based) out of
``S = max_steps``:

    p = (s + i / U_s) / S                                         ∈ [0, 1)

The decay is a function of ``p``; the warmup is a function of the true update count ``u``
(warmup exists to let Adam's moments settle, which is counted in updates):

    lr(u, p) = min( warmup(u), decay(max(p · N̂, W)) )

with ``warmup(u) = η · min(u / W, 1)`` and ``decay`` the optax warmup+decay schedule of
:func:`make_lr_schedule` (``η`` → ``η · min_lr_ratio``) sized for ``N̂`` planned updates,
evaluated past its warmup. Properties:

* The end value is reached only at ``p = 1``: never before the last step, and at the start
  of the last step the LR is within ``N̂/(S·(N̂−W))`` ≈ ``1/S`` of the decay range from its
  end (cosine: far closer), whatever ``c_s`` turns out to be.
* If the plan is exact (``U_s = N̂ / S`` every step) then ``p · N̂ = u`` and ``lr`` equals the
  optax schedule ``make_lr_schedule(...)(u)`` exactly.
* ``N̂`` only decides where in ``p`` the decay starts (``W / N̂``); a wrong chunk estimate
  moves that point, it cannot make the LR end early or late.

``N̂`` comes from :func:`planned_total_updates` with the chunk estimate of
:class:`ChunkEstimator` at the start of the run (explicit, or guessed from the environment
limits). The estimator is then corrected from the observed chunk counts and gives the
projected total for logging; ``optim/num_updates`` is the true count ``Σ_s U_s``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import optax

from jaxrl_agentic.data.samples import SAMPLE_MODES

LR_SCHEDULER_TYPES = ("constant", "linear", "cosine")


def _check_schedule_args(
    learning_rate: float, lr_scheduler_type: str, warmup_steps: int, min_lr_ratio: float
) -> None:
    if lr_scheduler_type not in LR_SCHEDULER_TYPES:
        raise ValueError(
            f"lr_scheduler_type={lr_scheduler_type!r} must be one of {LR_SCHEDULER_TYPES}"
        )
    if learning_rate < 0 or warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(
            f"need learning_rate >= 0, warmup_steps >= 0, 0 <= min_lr_ratio <= 1; got "
            f"{learning_rate}, {warmup_steps}, {min_lr_ratio}"
        )


def make_lr_schedule(
    learning_rate: float,
    lr_scheduler_type: str,
    warmup_steps: int,
    total_updates: int,
    min_lr_ratio: float = 0.0,
) -> optax.Schedule:
    """Count-based schedule: linear warmup ``0 → η`` over ``W`` updates, then decay.

    With ``E = η · min_lr_ratio`` and ``t = (u − W) / (N − W)`` clipped to ``[0, 1]``:

    * ``constant``: ``η``
    * ``linear``:   ``η − (η − E) · t``
    * ``cosine``:   ``E + (η − E) · ½(1 + cos(π t))``

    and ``η · u / W`` for ``u < W``. The end value ``E`` is reached at ``u = N``.
    """
    _check_schedule_args(learning_rate, lr_scheduler_type, warmup_steps, min_lr_ratio)
    decay_steps = total_updates - warmup_steps
    if lr_scheduler_type != "constant" and decay_steps <= 0:
        raise ValueError(
            f"total_updates={total_updates} must exceed warmup_steps={warmup_steps} "
            f"for lr_scheduler_type={lr_scheduler_type!r}"
        )
    end_value = learning_rate * min_lr_ratio
    if lr_scheduler_type == "constant":
        decay = optax.constant_schedule(learning_rate)
    elif lr_scheduler_type == "linear":
        decay = optax.linear_schedule(learning_rate, end_value, decay_steps)
    else:
        decay = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=min_lr_ratio)
    if warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])


ProgressSchedule = Callable[[np.ndarray, np.ndarray], np.ndarray]


def make_progress_lr_schedule(
    learning_rate: float,
    lr_scheduler_type: str,
    warmup_steps: int,
    planned_total_updates: int,
    min_lr_ratio: float = 0.0,
) -> ProgressSchedule:
    """``lr(updates_done, progress) = min(warmup(u), decay(max(p · N̂, W)))``; see module doc.

    ``updates_done`` (``u``) counts updates before the current one; ``progress`` (``p``)
    comes from :func:`update_progress`. Both may be arrays (evaluated elementwise).
    """
    planned = max(planned_total_updates, warmup_steps + 1)  # keep the decay well defined
    decay = make_lr_schedule(learning_rate, lr_scheduler_type, warmup_steps, planned, min_lr_ratio)
    warmup = (
        optax.linear_schedule(0.0, learning_rate, warmup_steps)
        if warmup_steps > 0
        else optax.constant_schedule(learning_rate)
    )

    def schedule(updates_done, progress):
        virtual_count = np.maximum(np.asarray(progress, np.float64) * planned, warmup_steps)
        lr = np.minimum(np.asarray(warmup(updates_done)), np.asarray(decay(virtual_count)))
        # optax's constant schedule ignores its count's shape: one LR per update regardless.
        return np.broadcast_to(lr, np.broadcast_shapes(np.shape(updates_done),
                                                       np.shape(progress))).astype(np.float32)

    return schedule


def update_progress(
    steps_done: int, update_in_step: np.ndarray, updates_this_step: int, max_steps: int
) -> np.ndarray:
    """``p = (steps_done + i / U_s) / max_steps`` for update ``i`` of the ``U_s`` in a step."""
    if not 0 <= steps_done < max_steps or updates_this_step < 1:
        raise ValueError(
            f"need 0 <= steps_done < max_steps and updates_this_step >= 1; got "
            f"steps_done={steps_done}, max_steps={max_steps}, updates_this_step={updates_this_step}"
        )
    i = np.asarray(update_in_step, np.float64)
    return (steps_done + i / updates_this_step) / max_steps


def step_learning_rates(
    schedule: ProgressSchedule,
    *,
    steps_done: int,
    updates_done: int,
    updates_this_step: int,
    max_steps: int,
) -> np.ndarray:
    """``[U_s] float32`` LR of each update of one pipeline step.

    Feed them to the learner (e.g. ``optax.inject_hyperparams`` and one LR per mini-batch of
    its scan); afterwards ``updates_done += updates_this_step``.
    """
    i = np.arange(updates_this_step)
    progress = update_progress(steps_done, i, updates_this_step, max_steps)
    return schedule(updates_done + i, progress)


def planned_total_updates(
    max_steps: int,
    ppo_epochs: int,
    trajectories_per_step: int,
    chunks_per_traj: float,
    mini_batch_size: int,
) -> int:
    """``max_steps · ppo_epochs · ceil(trajectories_per_step · chunks_per_traj / mini_batch_size)``.

    ``trajectories_per_step · chunks_per_traj`` is rounded to 6 decimals first, so that a
    fractional estimate like ``10/3`` with 3 trajectories gives 10 samples, not 10.000…02.
    """
    samples = round(trajectories_per_step * chunks_per_traj, 6)
    return max_steps * ppo_epochs * math.ceil(samples / mini_batch_size)


@dataclasses.dataclass(frozen=True)
class ChunkEstimator:
    """Running estimate of samples ("chunks") per trajectory; immutable, checkpointable.

    ``initial`` is the explicit ``estimated_chunks_per_traj`` (> 0) or, when that is 0, a
    guess from the environment limits: 1 in trajectory mode, ``max(max_turns // 2, 1)`` in
    step mode. Once steps have been observed the estimate is their running mean
    ``observed_samples / observed_trajectories`` (prefix merge, early termination and
    truncation all show up there and nowhere in the config).
    """

    initial: float
    observed_samples: int = 0
    observed_trajectories: int = 0

    @classmethod
    def from_config(
        cls, estimated_chunks_per_traj: float, sample_mode: str, max_turns: int
    ) -> ChunkEstimator:
        if sample_mode not in SAMPLE_MODES:
            raise ValueError(f"sample_mode={sample_mode!r} must be one of {SAMPLE_MODES}")
        if estimated_chunks_per_traj < 0:
            raise ValueError(
                f"estimated_chunks_per_traj={estimated_chunks_per_traj} must be >= 0 (0 = auto)"
            )
        if estimated_chunks_per_traj > 0:
            return cls(initial=float(estimated_chunks_per_traj))
        guess = 1 if sample_mode == "trajectory" else max(max_turns // 2, 1)
        return cls(initial=float(guess))

    @property
    def chunks_per_traj(self) -> float:
        if self.observed_trajectories == 0:
            return self.initial
        return self.observed_samples / self.observed_trajectories

    def observe(self, num_samples: int, num_trajectories: int) -> ChunkEstimator:
        """Adds one pipeline step's counts; returns the updated estimator."""
        if num_samples < 0 or num_trajectories < 1:
            raise ValueError(
                f"observe needs num_samples >= 0 and num_trajectories >= 1; got "
                f"{num_samples}, {num_trajectories}"
            )
        return dataclasses.replace(
            self,
            observed_samples=self.observed_samples + int(num_samples),
            observed_trajectories=self.observed_trajectories + int(num_trajectories),
        )

    def projected_total_updates(
        self,
        *,
        updates_done: int,
        steps_done: int,
        max_steps: int,
        ppo_epochs: int,
        trajectories_per_step: int,
        mini_batch_size: int,
    ) -> int:
        """Updates done so far plus the remaining steps sized with the current estimate."""
        remaining = planned_total_updates(
            max_steps - steps_done,
            ppo_epochs,
            trajectories_per_step,
            self.chunks_per_traj,
            mini_batch_size,
        )
        return updates_done + remaining

    def to_dict(self) -> dict[str, float]:
        return {
            "initial": float(self.initial),
            "observed_samples": float(self.observed_samples),
            "observed_trajectories": float(self.observed_trajectories),
        }

    @classmethod
    def from_dict(cls, state: dict[str, float]) -> ChunkEstimator:
        return cls(
            initial=float(state["initial"]),
            observed_samples=int(state["observed_samples"]),
            observed_trajectories=int(state["observed_trajectories"]),
        )


class LearningRatePlan:
    """The run's learning rates: the progress schedule, sized once by the chunk estimate at
    the start, next to the estimator that is corrected as samples are observed.

    ``learning_rates(steps_done, num_updates)`` gives one LR per update of a step;
    ``record(num_updates, num_samples, num_trajectories)`` counts the step afterwards
    (``num_trajectories = 0``: a skipped batch, which says nothing about chunks).
    ``to_dict()`` / ``load_dict()`` checkpoint the counts and the estimator.
    """

    def __init__(self, *, learning_rate: float, lr_scheduler_type: str, warmup_steps: int,
                 min_lr_ratio: float, max_steps: int, ppo_epochs: int,
                 trajectories_per_step: int, mini_batch_size: int, chunks: ChunkEstimator):
        self.max_steps = max_steps
        self.ppo_epochs = ppo_epochs
        self.trajectories_per_step = trajectories_per_step
        self.mini_batch_size = mini_batch_size
        self.chunks = chunks
        self.updates_done = 0
        self.planned_updates = planned_total_updates(
            max_steps, ppo_epochs, trajectories_per_step, chunks.initial, mini_batch_size)
        self.schedule = make_progress_lr_schedule(
            learning_rate, lr_scheduler_type, warmup_steps, self.planned_updates, min_lr_ratio)

    def learning_rates(self, steps_done: int, num_updates: int) -> np.ndarray:
        return step_learning_rates(self.schedule, steps_done=steps_done,
                                   updates_done=self.updates_done,
                                   updates_this_step=num_updates, max_steps=self.max_steps)

    def record(self, num_updates: int, num_samples: int, num_trajectories: int) -> None:
        self.updates_done += num_updates
        if num_trajectories > 0:
            self.chunks = self.chunks.observe(num_samples, num_trajectories)

    def projected_total_updates(self, steps_done: int) -> int:
        return self.chunks.projected_total_updates(
            updates_done=self.updates_done, steps_done=steps_done, max_steps=self.max_steps,
            ppo_epochs=self.ppo_epochs, trajectories_per_step=self.trajectories_per_step,
            mini_batch_size=self.mini_batch_size)

    def to_dict(self) -> dict:
        return {"updates_done": self.updates_done, "chunks": self.chunks.to_dict()}

    def load_dict(self, state: dict) -> None:
        self.updates_done = int(state["updates_done"])
        self.chunks = ChunkEstimator.from_dict(state["chunks"])
