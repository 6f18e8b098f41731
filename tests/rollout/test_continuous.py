"""Continuous batching (`rollout_batching="continuous"`) against turn lockstep: the same
trajectories token for token, with JAX and Python environments, and environment steps that
overlap decoding."""

import collections
import threading

import numpy as np
import pytest

from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, make_python_env, text_state_hash
from jaxrl_agentic.rollout.loop import RolloutRunner
from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig
from tests.rollout.test_python_runner import (  # noqa: F401 (the fixture)
    ENV,
    MAX_NEW,
    RUN_SEED,
    assert_same_trajectory,
    episodes,
    python_runner,
    setup,
)


def runner(setup, backend, generation, **kwargs):  # noqa: F811
    env, params, sampler, formatter, max_input_length = setup
    common = dict(tag="lake", max_turns=6, max_input_length=max_input_length, run_seed=RUN_SEED,
                  generation=generation, **kwargs)
    if backend == "jax":
        return RolloutRunner(env, params, sampler, formatter, **common)
    return PythonRolloutRunner(make_python_env(ENV), sampler, formatter, **common)


@pytest.fixture(scope="module")
def generation(setup):  # noqa: F811
    """Replies of varied lengths: the tiny model's three most frequent reply tokens stop a
    reply (so rows end at different steps of a chunk and episodes after different turns)."""
    probe = runner(setup, "jax", GenerationConfig(max_tokens_per_step=MAX_NEW))
    counts = collections.Counter(tok for t in probe.run(episodes(2), sample_seed=99)
                                 for u in t.turns for tok in u.generated)
    stops = tuple(tok for tok, _ in counts.most_common(3))
    return GenerationConfig(max_tokens_per_step=MAX_NEW, stop_token_ids=stops)


def lazy_setup(setup, **sampler_kwargs):  # noqa: F811
    """`setup` with a sampler of the same weights that compiles only the slot programs a
    rollout runs (`precompile_slots=False`): the up-front grid of every row count × prompt
    length is compiled once, by the shared sampler, for the tests that need it."""
    from flax import nnx

    from jaxrl_agentic.sampling import Sampler

    env, params, sampler, formatter, max_input_length = setup
    lazy = Sampler(nnx.merge(sampler.graphdef, sampler.params), sampler.tokenizer,
                   max_total_len=sampler.max_total_len, precompile_slots=False,
                   **sampler_kwargs)
    return env, params, lazy, formatter, max_input_length


def with_row_blocks(setup, blocks: int):  # noqa: F811
    """`setup` with a sampler whose sessions split into `blocks` row blocks (each decodes on
    its own thread, `SlotDecoder.launch`) from 2 rows a block."""
    return lazy_setup(setup, decode_threads=blocks, min_rows_per_thread=2)


@pytest.mark.parametrize("backend,slots,chunk,blocks", [("jax", 3, 3, 1), ("python", 0, 2, 2)])
def test_continuous_equals_turn_lockstep_token_for_token(setup, generation, backend, slots,  # noqa: F811
                                                         chunk, blocks):
    """The strongest check of the slot bookkeeping: each episode's noise is keyed by its id
    and turn, so any schedule must give the lockstep's trajectories. With several row
    blocks, each block's chunks, hand-overs and prefills run apart from the others'."""
    if blocks > 1:
        setup = with_row_blocks(setup, blocks)
    plan, stats = episodes(5), setup[2].stats
    before = stats["prefill_tokens"]
    turn = runner(setup, backend, generation).run(plan, sample_seed=11, traj_id_start=40)
    between = stats["prefill_tokens"]
    continuous = runner(setup, backend, generation, batching="continuous", slots=slots,
                        decode_chunk=chunk).run(plan, sample_seed=11, traj_id_start=40)
    # Prefix reuse is intact: each turn prefills only what was appended since the last.
    assert stats["prefill_tokens"] - between == between - before
    for a, b in zip(turn, continuous, strict=True):
        assert_same_trajectory(a, b, exact=False)
    # Replies that end at different steps of a chunk, streams of different lengths, every
    # episode cut by the prompt limit after a few turns (3 slots for 10 episodes: slots are
    # reused; termination by the environment: test_environment_steps_overlap_decoding).
    assert {"stop", "length"} <= {u.stop_reason for t in turn for u in t.turns}
    assert len({len(t.tokens) for t in turn}) > 3
    assert all(t.truncated_by_length and len(t.turns) >= 2 for t in turn)


class _Rendezvous(PythonTextEnv):
    """Episode 0's first step waits until episode 1 has stepped twice: in lockstep that
    never happens while it waits (the next turn waits for it), so only a schedule in which
    episode 1 decodes and steps while episode 0's environment is busy finishes in time."""

    max_steps_in_episode = 3

    def __init__(self, spec, seeds, event):
        self.member, self.event, self.steps = spec.member, event, 0

    def reset(self, seed):
        return f"episode {self.member}: say anything"

    def step(self, reply):
        self.steps += 1
        if self.member == 0 and self.steps == 1:
            if not self.event.wait(timeout=30):
                raise TimeoutError("episode 1 never stepped while episode 0 waited")
        if self.member == 1 and self.steps == 2:
            self.event.set()
        return PyStep(observation=f"step {self.steps}", reward=0.0,
                      terminated=self.steps == self.max_steps_in_episode, action_is_valid=True,
                      action_is_effective=True, success=False, action=0)

    def state_hash(self):
        return text_state_hash(f"{self.member}/{self.steps}")


def test_environment_steps_overlap_decoding(setup):  # noqa: F811
    event = threading.Event()
    runner = python_runner(lazy_setup(setup), lambda spec, seed: _Rendezvous(spec, seed, event),
                           batching="continuous", decode_chunk=2)
    trajs = runner.run(episodes(1, group_size=2), sample_seed=0)
    assert event.is_set()
    assert [len(t.turns) for t in trajs] == [3, 3] and all(t.terminated for t in trajs)
    assert runner.stats["timeouts"] == 0 and runner.stats["env_steps"] == 6


def test_without_precompile_the_same_trajectories_compile_on_first_use(setup, generation):  # noqa: F811
    """`rollout_precompile=False` (`Sampler(precompile_slots=False)`): nothing is compiled
    up front, only what the rollout reaches, and the trajectories are those of the
    precompiled sampler."""
    env, params, sampler, formatter, max_input_length = setup
    lazy = lazy_setup(setup)[2]
    plan = episodes(2)
    eager = runner(setup, "jax", generation, batching="continuous", slots=3,
                   decode_chunk=3).run(plan, sample_seed=5)
    common = dict(tag="lake", max_turns=6, max_input_length=max_input_length,
                  run_seed=RUN_SEED, generation=generation, batching="continuous", slots=3,
                  decode_chunk=3)
    got = RolloutRunner(env, params, lazy, formatter, **common).run(plan, sample_seed=5)
    for a, b in zip(eager, got, strict=True):
        assert_same_trajectory(a, b, exact=True)
    assert not lazy.warmed and sampler.warmed
    # The precompiled sampler holds every chunk width and prefill shape of 3 slots; the lazy
    # one only those this rollout used.
    grid = {key for key in sampler.warmed if key[1] == 4}  # capacity of 3 slots
    assert 0 < lazy.compilation_count() < len(grid)


class _Switching:
    """A live policy (`continuous.LivePolicy`): version 0 = `first` for `reads` reads of
    `current()`, then version 1 = `then` (a learner update landing mid-rollout)."""

    def __init__(self, first, then, reads):
        self.first, self.then, self.reads, self.count = first, then, reads, 0

    def current(self):
        self.count += 1
        return (0, self.first) if self.count <= self.reads else (1, self.then)


def test_in_flight_updates_reach_live_replies_at_chunk_boundaries(setup, generation):  # noqa: F811
    """A version change between chunks: (1) with the same params under both versions the
    trajectories are the lockstep run's token for token, and every token records the version
    of the chunk that drew it, some replies spanning both; (2) when the update is there
    before the first chunk, the whole rollout, prefills included, is the lockstep run of
    the new params: the chunks decode with the live policy, not the one the rollout began
    with."""
    import jax

    sampler = setup[2]
    plan = episodes(2)
    live = runner(setup, "jax", generation, batching="continuous", slots=3, decode_chunk=2)
    lockstep = runner(setup, "jax", generation)
    same = _Switching(sampler.params, sampler.params, reads=4)
    got = live.run(plan, sample_seed=7, params=same)
    for a, b in zip(lockstep.run(plan, sample_seed=7), got, strict=True):
        assert_same_trajectory(a, b, exact=False)
    versions = [np.asarray(u.versions) for t in got for u in t.turns]
    assert all(len(v) == len(u.generated) for v, u in
               zip(versions, [u for t in got for u in t.turns], strict=True))
    for t in got:
        per_token = t.token_versions()
        assert np.all(np.diff(per_token) >= 0) and set(per_token) <= {0, 1}
    assert any(set(v) == {0, 1} for v in versions)  # a reply that spans the update
    assert same.count > 5

    flipped = jax.tree.map(lambda x: -x if x.ndim >= 2 else x, sampler.params)
    new = live.run(plan, sample_seed=7, params=_Switching(sampler.params, flipped, reads=0))
    for a, b in zip(lockstep.run(plan, sample_seed=7, params=flipped), new, strict=True):
        assert_same_trajectory(a, b, exact=False)
    assert all(set(t.token_versions()) == {1} for t in new)
    assert [t.tokens for t in got] != [t.tokens for t in new]  # the update mattered
