"""After warm-up, pipeline steps whose episodes change length compile nothing new.

Compilations are counted with `jaxrl_agentic.runtime.compile_events.CompileEvents`, a
`jax.monitoring` listener on `/jax/core/compile/backend_compile_duration`. JAX records that
event around `compile_or_get_cached` for every program missing from the process' in-memory
executable cache, whether XLA then compiles it or the persistent compilation cache (enabled in
conftest.py) supplies it. So a cache hit on disk still counts as a new program here.

A randomly initialised model almost never writes a valid `<answer>…</answer>`, so on the
real frozen lake every episode would last exactly `max_turns` turns and every step would
have the same shapes. The test environment below is the real frozen lake (same jitted
dynamics and rendering) with one change: any reply counts as a move (crc32 of the text,
mod 4). The random policy then walks the lake, and episodes end in holes or at the goal
after different numbers of turns.

* `test_counter_*`: the counter sees a new program, and a persistent-cache hit.
* `test_no_compilation_after_warmup_*`: 3 warm-up pipeline steps, then 5 steps whose
  episode lengths differ compile nothing; a control step with longer rows does compile.
* `test_longer_episodes_*`: what the pipeline test cannot force at test size, on the
  learner and on the GAE critic directly: episodes longer than any warm-up step's compile
  no new `update_step` / per-token (`compute`) program (`fixed_rows`: the row count no
  longer follows the lengths); control: with `fixed_rows=False` the same steps do compile
  both.
* `test_episode_replays_*`: train.py's GIF replay of an episode (every logged step)
  compiles nothing after the first (its env reset is jitted once per runner).
"""

import dataclasses
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic import train
from jaxrl_agentic.envs import register, registered_envs
from jaxrl_agentic.envs.frozen_lake import FrozenLake
from jaxrl_agentic.runtime.compile_events import CompileEvents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "frozen_lake_any_reply"
WARMUP_STEPS = 3
MEASURED_STEPS = 5


class AnyReplyFrozenLake(FrozenLake):
    """Frozen lake whose parser reads any reply as a move (see the module docstring)."""

    def parse_action(self, reply: str) -> int:
        return zlib.crc32(reply.encode()) % self.num_actions


def _new_function():
    """A fresh function object each call, with the same name and code: jit caches per
    function object, so each one is a miss in memory but the same program on disk."""
    def fn(x):
        return jnp.sin(x) * 3.0 + 1.0

    return fn


def test_counter_sees_new_programs_and_persistent_cache_hits():
    # numpy inputs: building them compiles nothing, so only `fn` can show up.
    with CompileEvents() as counter:
        f = jax.jit(_new_function())
        f(np.ones(3, np.float32)).block_until_ready()
        first = list(counter.programs)
        f(np.zeros(3, np.float32)).block_until_ready()  # same shape: no new program
        same_shape = list(counter.programs)
        f(np.ones(5, np.float32)).block_until_ready()  # new shape: a new program
    assert first == same_shape == ["jit(fn)"], counter.programs
    assert counter.programs == ["jit(fn)", "jit(fn)"]

    # The same program from a second function object misses the in-memory cache; with the
    # persistent cache on (conftest.py) its executable comes from disk, and must still count.
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("no persistent compilation cache configured")
    previous = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        x = np.arange(7, dtype=np.float32)
        jax.jit(_new_function())(x).block_until_ready()  # now in the persistent cache
        with CompileEvents() as counter:
            jax.jit(_new_function())(x).block_until_ready()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)
    assert counter.cache_hits == 1 and counter.programs == ["jit(fn)"], counter.programs


def tiny_config(out: str):
    """The default recipe at test size: 8 episodes of up to 5 turns, one mini-batch of 8
    trajectory samples (290-510 tokens) in rows of 640 tokens: a step needs 5-8 rows
    depending on its episode lengths (the learner packs 8: `fixed_rows`)."""
    return train.parse_config([
        "train",
        f"--config={os.path.join(ROOT, 'configs', 'frozen_lake.py')}",
        f"--config.output_dir={out}",
        "--config.pretrain=tiny",
        "--config.format_warmup.steps=0",
        f"--config.max_steps={WARMUP_STEPS + MEASURED_STEPS + 1}",
        f"--config.custom_envs.frozen_lake.env_type={ENV}",
        "--config.custom_envs.frozen_lake.max_turns=5",
        "--config.custom_envs.frozen_lake.max_tokens_per_step=8",
        "--config.train_env_manager.num_env_groups=2",
        "--config.train_env_manager.group_size=4",
        # The standard maps this test's warm-up length was set on. The recipe's denser
        # training maps end more episodes early, and 3 warm-up steps then missed a
        # (rows, prefill) bucket: the sampler compiles buckets on first use.
        "--config.train_env_manager.env_config.p_frozen=0.8",
        "--config.mini_batch_size=8",
        "--config.max_input_length=512",
        "--config.sequence_length=640",
        "--config.micro_batch_max_tokens=640",
    ])


@pytest.fixture(scope="module")
def warm_pipeline(tmp_path_factory):
    """The pipeline after its warm-up steps, and the last warm-up step's trajectories."""
    from jaxrl_agentic.pipeline import Pipeline

    if ENV not in registered_envs():
        register(ENV, AnyReplyFrozenLake)
    pipeline = Pipeline(tiny_config(str(tmp_path_factory.mktemp("recompilation"))))
    for _ in range(WARMUP_STEPS):
        _, trajs, _ = pipeline.train_step()
    return pipeline, trajs


def test_no_compilation_after_warmup_while_episode_lengths_change(warm_pipeline):
    pipeline, _ = warm_pipeline
    episode_turns, tokens = [], []
    with CompileEvents() as counter:
        for _ in range(MEASURED_STEPS):
            metrics, trajs, _ = pipeline.train_step()
            episode_turns.append(sorted(len(t.turns) for t in trajs))
            tokens.append(metrics["tokens/real"])
    # The claim is only tested if the steps really differ: within a step, and between steps.
    assert any(turns[0] != turns[-1] for turns in episode_turns), episode_turns
    assert len({sum(turns) for turns in episode_turns}) > 1, episode_turns
    assert len(set(tokens)) > 1, tokens
    assert counter.programs == [], (
        f"{len(counter.programs)} programs compiled after {WARMUP_STEPS} warm-up steps "
        f"(episode turns per step {episode_turns}, tokens {tokens}): {counter.programs}")

    # Control: one more step whose batch rows are longer than any compiled so far does
    # show up, so an empty list above means nothing compiled, not that nothing was seen.
    learner = pipeline.learner
    longer = dataclasses.replace(learner.config.packing, micro_batch_max_tokens=(
        learner.config.packing.micro_batch_max_tokens + 64))
    learner.config = learner.engine.config = dataclasses.replace(learner.config, packing=longer)
    with CompileEvents() as counter:
        pipeline.train_step()
    assert any("update_step" in name for name in counter.programs), counter.programs


def growing_episodes(rng, count: int, max_len: int):
    """`count` trajectory samples of 8..max_len tokens; the reply is each one's second half."""
    from jaxrl_agentic.data import Sample

    out = []
    for i, n in enumerate(rng.integers(8, max_len + 1, size=count)):
        mask = (np.arange(n) >= n // 2).astype(np.float32)
        out.append(Sample(tokens=rng.integers(1, 64, n), loss_mask=mask,
                          old_logprobs=-4.0 * mask, advantages=mask * rng.normal(),
                          returns=mask * rng.normal(), values=mask * rng.normal(),
                          traj_id=i, prompt_len=int(n // 2)))
    return out


def programs_after_warmup(model_step, mini_batch_size: int):
    """Three warm-up steps of short episodes, then steps whose episodes grow, each through
    `model_step(samples)`. Returns (rows needed per warm-up step, per measured step,
    programs compiled after the warm-up)."""
    from jaxrl_agentic.data import pack_samples

    rng = np.random.default_rng(0)

    def step(samples):
        model_step(samples)
        return pack_samples(samples, micro_batch_max_tokens=64, sequence_length=64,
                            rows_bucket=1).num_micro_batches

    warm_rows = [step(growing_episodes(rng, mini_batch_size, 16)) for _ in range(WARMUP_STEPS)]
    with CompileEvents() as counter:
        rows = [step(growing_episodes(rng, mini_batch_size, 16 + 10 * k))
                for k in range(1, MEASURED_STEPS + 1)]
    # Meaningful only if the measured steps need a row bucket the warm-up never did.
    assert max(warm_rows) <= 4 < max(rows), (warm_rows, rows)
    return warm_rows, rows, counter.programs


def small_rows(fixed_rows: bool):
    """The default recipe's packing rules (rows_bucket 4) at a small row length."""
    from jaxrl_agentic.data import PackingConfig

    return PackingConfig(micro_batch_max_tokens=64, sequence_length=64, rows_bucket=4,
                         fixed_rows=fixed_rows)


def learner_programs_after_warmup(small_policy, fixed_rows: bool):
    """What the pipeline test cannot force at test size, on the learner directly, through
    the two calls a pipeline step makes (the mismatch check's `sample_logprobs`, then the
    updates)."""
    from jaxrl_agentic.training.learner import Learner
    from jaxrl_agentic.training.learner_config import LearnerConfig

    config = LearnerConfig(mini_batch_size=8, learning_rate=1e-3, packing=small_rows(fixed_rows))
    learner = Learner(*small_policy, config)

    def pipeline_step(samples):
        learner.sample_logprobs(samples)
        learner.step([dataclasses.replace(s, returns=None, values=None) for s in samples],
                     np.full(1, 1e-3))

    return programs_after_warmup(pipeline_step, config.mini_batch_size)


def test_longer_episodes_after_warmup_compile_no_new_learner_program(small_policy):
    warm_rows, rows, programs = learner_programs_after_warmup(small_policy, fixed_rows=True)
    assert programs == [], f"rows needed {warm_rows} during warm-up, then {rows}: {programs}"
    # Control: with row counts that follow the lengths, the same steps do compile.
    _, _, programs = learner_programs_after_warmup(small_policy, fixed_rows=False)
    assert {"jit(update_step)", "jit(compute)"} <= set(programs), programs


def critic_programs_after_warmup(small_policy, fixed_rows: bool):
    """The GAE critic through what a pipeline step makes it do: values of the trajectory
    samples, then its value-loss updates. Before the shared update engine the critic had
    no `fixed_rows` and compiled a new train step whenever episodes grew."""
    from jaxrl_agentic.training.critic import Critic, CriticConfig

    config = CriticConfig(mini_batch_size=8, learning_rate=1e-3, packing=small_rows(fixed_rows))
    critic = Critic(*small_policy, config)

    def pipeline_step(samples):
        critic.sample_values(samples)
        critic.step(samples)

    return programs_after_warmup(pipeline_step, config.mini_batch_size)


def test_longer_episodes_after_warmup_compile_no_new_critic_program(small_policy):
    warm_rows, rows, programs = critic_programs_after_warmup(small_policy, fixed_rows=True)
    assert programs == [], f"rows needed {warm_rows} during warm-up, then {rows}: {programs}"
    _, _, programs = critic_programs_after_warmup(small_policy, fixed_rows=False)
    assert {"jit(update_step)", "jit(compute)"} <= set(programs), programs


def test_episode_replays_compile_nothing_after_the_first(warm_pipeline):
    """train.py's per-step extra work: replaying an episode for its GIF."""
    from jaxrl_agentic.rollout.loop import replay_frames

    pipeline, trajs = warm_pipeline
    runner = pipeline.split_runners["train"][trajs[0].tag]
    replay_frames(runner, trajs[0])
    with CompileEvents() as counter:
        for traj in trajs[:3]:
            frames = replay_frames(runner, traj)
            assert len(frames) == len(traj.turns) + 1
    assert counter.programs == [], counter.programs


def test_row_length_buckets_compile_at_most_one_program_each(small_policy):
    """`row_len_buckets=3`: rows of 64, 32 or 16 tokens, whichever computes the fewest slots
    for the mini-batch. Short and growing episodes visit several row lengths; each is
    compiled once, and no more programs than buckets are ever made."""
    from jaxrl_agentic.data import PackingConfig
    from jaxrl_agentic.training.learner import Learner
    from jaxrl_agentic.training.learner_config import LearnerConfig
    from jaxrl_agentic.training.per_token import computed_slots

    packing = PackingConfig(micro_batch_max_tokens=64, sequence_length=64, rows_bucket=4,
                            fixed_rows=True, row_len_buckets=3)
    learner = Learner(*small_policy, LearnerConfig(mini_batch_size=8, learning_rate=1e-3,
                                                   packing=packing))
    rng = np.random.default_rng(0)
    row_lens, slots, fixed_slots = [], 0, 0
    with CompileEvents() as counter:
        for max_len in (12, 12, 16, 30, 40, 50, 60, 64, 14):
            samples = [dataclasses.replace(s, returns=None, values=None)
                       for s in growing_episodes(rng, 8, max_len)]
            learner.sample_logprobs(samples)
            metrics = learner.step(samples, np.full(1, 1e-3))
            batch = packing.pack(samples, num_rows=8)
            row_lens.append(batch.row_len)
            slots += metrics["tokens/computed"]
            fixed_slots += computed_slots(dataclasses.replace(packing, row_len_buckets=1).pack(
                samples, num_rows=8), learner.mesh)
    assert {32, 64} <= set(row_lens) <= {16, 32, 64}, row_lens
    assert counter.programs.count("jit(update_step)") == len(set(row_lens)), counter.programs
    assert counter.programs.count("jit(compute)") <= 3, counter.programs
    assert slots < fixed_slots, (slots, fixed_slots)  # never more: the full row is a candidate
