"""The rollout loop with the real sampler and the tiny model: the contracts it guarantees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.data import pack_samples
from jaxrl_agentic.data.samples import step_samples, trajectory_sample
from jaxrl_agentic.envs import make
from jaxrl_agentic.envs.messages import first_message
from jaxrl_agentic.models import load_pretrained
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EnvManagerConfig, plan_episodes
from jaxrl_agentic.rollout.loop import RolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig
from jaxrl_agentic.sampling import Sampler

MAX_NEW = 8


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model, tok = load_pretrained(tiny_model_dir)
    formatter = ChatFormatter(tok)
    env, params = make("frozen_lake")
    return model, tok, formatter, env, params


@pytest.fixture(scope="module")
def rollout(setup):
    model, tok, formatter, env, params = setup
    _, state = env.reset(jax.random.PRNGKey(0), params)
    first_len = len(formatter.first_prompt(first_message(env, state, params)))
    # Room for about three turns: the history grows past the limit mid-episode.
    max_input_length = first_len + 3 * 32
    sampler = Sampler(model, tok, max_total_len=max_input_length + MAX_NEW + 1)
    runner = RolloutRunner(env, params, sampler, formatter, tag="lake", max_turns=8,
                           max_input_length=max_input_length,
                           generation=GenerationConfig(max_tokens_per_step=MAX_NEW))
    manager = EnvManagerConfig(num_env_groups=3, group_size=2, tags=("lake",))
    episodes = plan_episodes(manager, split="train", cursor=5)["lake"]
    trajs = runner.run(episodes, sample_seed=0)
    return trajs, max_input_length, sampler


def test_prompt_never_exceeds_max_input_length(rollout):
    trajs, max_input_length, _ = rollout
    for t in trajs:
        for turn in t.turns:
            assert turn.context_len <= max_input_length
    cut = [t for t in trajs if t.truncated_by_length]
    assert cut and all(len(t.turns) >= 1 for t in cut)  # the limit was hit mid-episode


def test_generated_tokens_are_the_only_loss_tokens(rollout, setup):
    trajs, _, _ = rollout
    eos = setup[2].eos_token_id
    appended = 0
    for t in trajs:
        mask = t.loss_mask()
        assert mask.sum() == sum(len(u.generated) for u in t.turns)
        for u in t.turns:
            end = u.context_len + len(u.generated)
            assert t.tokens[u.context_len:end] == u.generated
            if u.eos_appended:
                appended += 1
                assert u.stop_reason != "eos" and t.tokens[end] == eos and mask[end] == 0
        sample = trajectory_sample(t, 1.0)
        np.testing.assert_array_equal(sample.loss_mask, mask[: len(sample.tokens)])
    assert appended > 0  # an untrained model runs out of tokens: the case is exercised


def test_step_samples_bounded_and_gen_only(rollout):
    trajs, max_input_length, _ = rollout
    samples = [s for t in trajs for s in step_samples(t, 1.0)]
    for s in samples:
        assert len(s.tokens) <= max_input_length + MAX_NEW
    batch = pack_samples(samples, micro_batch_max_tokens=max_input_length + MAX_NEW,
                         sequence_length=max_input_length + MAX_NEW)
    assert (batch.seg_prompt_len + batch.seg_response_len).max() <= max_input_length + MAX_NEW
    assert int(batch.loss_mask.sum()) == sum(len(u.generated) for t in trajs for u in t.turns)


def test_groups_share_maps_and_logprobs_match_learner(rollout, setup):
    trajs, _, _ = rollout
    model = setup[0]
    first_hash = {}
    for t in trajs:
        first_hash.setdefault(t.group_id, set()).add(t.turns[0].state_hash)
    assert all(len(h) == 1 for h in first_hash.values())  # same map within a group
    assert len(set().union(*first_hash.values())) > 1  # different maps across groups
    # sampler logprobs == full-forward recomputation on the final stream (fp32)
    worst = 0.0
    for t in trajs[:3]:
        tokens = jnp.asarray(t.tokens)[None]
        logp = jax.nn.log_softmax(model(tokens, jnp.arange(len(t.tokens))[None])[0], -1)
        for u in t.turns:
            pos = np.arange(u.context_len, u.context_len + len(u.generated))
            ref = np.asarray(logp[pos - 1, np.asarray(u.generated)])
            worst = max(worst, float(np.abs(ref - u.logprobs).max()))
    assert worst <= 1e-4


def test_validation_seeds_are_held_out():
    manager = EnvManagerConfig(num_env_groups=4, group_size=3, tags=("a", "b"))
    train = {e.seed for step in range(50)
             for eps in plan_episodes(manager, split="train", cursor=4 * step).values()
             for e in eps}
    val = {e.seed for eps in plan_episodes(manager, split="val").values() for e in eps}
    assert train and val and not train & val
    plan = plan_episodes(manager, split="train")
    assert [len(v) for v in plan.values()] == [6, 6]
    with pytest.raises(ValueError, match="num_groups_partition: needs one entry per tag summing"):
        EnvManagerConfig(num_env_groups=4, group_size=2, tags=("a", "b"),
                         num_groups_partition=(1, 2))


def test_reply_prefix_is_context_and_parsed_with_the_reply(setup):
    """`reply_prefix` ends every generation prompt (so it is context, never a loss token)
    and is put back in front of the generated text for the environment's parser;
    `reply_suffix` is appended for the parser only."""
    model, tok, formatter, env, params = setup
    prefixed = ChatFormatter(tok, reply_prefix="<answer>")
    answer = tok.convert_tokens_to_ids("<answer>")
    first, nxt = prefixed.first_prompt("hello"), prefixed.next_prompt("again")
    assert first == formatter.first_prompt("hello") + [answer]
    assert nxt == formatter.next_prompt("again") + [answer]
    reply = prefixed.reply_ids("<answer>Left</answer>")
    assert reply == tok.encode("Left</answer>", add_special_tokens=False) + [tok.eos_token_id]
    assert env.parse_action(prefixed.decode_reply(reply[:-1])) == env.action_names.index("Left")
    with pytest.raises(ValueError, match="does not start with reply_prefix"):
        prefixed.reply_ids("Left")
    # reply_suffix: for the parser only, never in the stream.
    both = ChatFormatter(tok, reply_prefix="<answer>", reply_suffix="</answer>")
    left = both.reply_ids("<answer>Left</answer>")
    assert left == tok.encode("Left", add_special_tokens=False) + [tok.eos_token_id]
    assert both.decode_reply(left[:-1]) == "<answer>Left</answer>"
    assert env.parse_action(both.decode_reply(left[:-1])) == env.action_names.index("Left")
    # In a rollout, every turn's context ends with the prefix and the reply parses.
    state = env.reset(jax.random.PRNGKey(0), params)[1]
    first_len = len(prefixed.first_prompt(first_message(env, state, params)))
    sampler = Sampler(model, tok, max_total_len=first_len + 3 * 32 + MAX_NEW + 1)
    runner = RolloutRunner(env, params, sampler, prefixed, tag="lake", max_turns=3,
                           max_input_length=first_len + 3 * 32,
                           generation=GenerationConfig(max_tokens_per_step=MAX_NEW))
    manager = EnvManagerConfig(num_env_groups=2, group_size=1, tags=("lake",))
    trajs = runner.run(plan_episodes(manager, split="train", cursor=0)["lake"], sample_seed=0)
    assert any(traj.turns for traj in trajs)
    for traj in trajs:
        for turn in traj.turns:
            assert traj.tokens[turn.context_len - 1] == answer
            assert traj.loss_mask()[turn.context_len - 1] == 0
            assert turn.reply.startswith("<answer>")
