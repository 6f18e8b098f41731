"""Tool environments through `PythonRolloutRunner`: the token stream is append-only and
equals the whole chat rendered at once (tiny and real Qwen2.5 tokenizers), and the
episode's tool metrics count what happened."""

import pytest
import transformers

from jaxrl_agentic.envs.calculator import CalculatorOracle
from jaxrl_agentic.envs.lookup import LookupOracle
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.envs.tools import CALL_CLOSE, CALL_OPEN
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig
from jaxrl_agentic.warmup import ScriptedSampler, text_policy_replies

GARBLED = f"{CALL_OPEN}{{not json}}{CALL_CLOSE}"


def _run(tokenizer, env_name, make_policy, seeds, max_turns=6):
    formatter = ChatFormatter(tokenizer)
    sampler = ScriptedSampler(text_policy_replies(formatter, make_policy, seed=0),
                              max_total_len=4096)
    runner = PythonRolloutRunner(make_python_env(env_name), sampler, formatter, tag=env_name,
                                 max_turns=max_turns, max_input_length=3000,
                                 generation=GenerationConfig(max_tokens_per_step=512))
    episodes = [EpisodeSpec(seed=s, group_id=i, member=0) for i, s in enumerate(seeds)]
    return runner.run(episodes, sample_seed=0), runner


def _whole_chat(tokenizer, env, traj):
    """The conversation as messages, rendered by the template in one go, less the newline
    the template puts after the final EOS (the stream ends at that EOS)."""
    messages = [{"role": "user", "content": env.reset(traj.seed)}]
    for turn in traj.turns:
        messages.append({"role": "assistant", "content": turn.reply})
        step = env.step(turn.reply)
        if step.terminated:
            break
        messages += ([{"role": "tool", "content": m} for m in step.tool_messages]
                     or [{"role": "user", "content": step.observation}])
    text = tokenizer.apply_chat_template(messages, tools=env.tool_schemas, tokenize=False)
    assert text.endswith(tokenizer.eos_token + "\n")
    return tokenizer.encode(text[:-1], add_special_tokens=False)


@pytest.fixture(scope="module", params=["tiny", "qwen"])
def tokenizer(request):
    name = "tiny_model_dir" if request.param == "tiny" else "qwen_fixture_dir"
    return transformers.AutoTokenizer.from_pretrained(request.getfixturevalue(name))


@pytest.mark.parametrize("env_name, oracle", [("calculator", CalculatorOracle),
                                              ("lookup", LookupOracle)])
def test_oracle_episodes_equal_the_chat_rendered_at_once(tokenizer, env_name, oracle):
    trajs, _ = _run(tokenizer, env_name, lambda rng: oracle().reply, seeds=[0, 1, 2])
    env_factory = make_python_env(env_name)
    for t in trajs:
        assert t.terminated and t.metrics["success"] == 1.0
        env = env_factory(EpisodeSpec(t.seed, t.group_id, 0), 0)
        assert t.tokens == _whole_chat(tokenizer, env, t)  # append-only, exact
        for turn in t.turns:  # each turn's context is a prefix; generated tokens follow it
            assert t.tokens[turn.context_len:turn.context_len + len(turn.generated)] == \
                turn.generated
        assert t.metrics["tool/calls"] == len(t.turns) - 1
        assert t.metrics["tool/errors"] == 0.0 == t.metrics["tool/timeouts"]


def test_garbled_calls_are_answered_counted_and_penalised(tokenizer):
    def make_policy(rng):  # two garbled calls, then the oracle (from the problem again)
        oracle, seen = CalculatorOracle(), []

        def reply(text):
            seen.append(text)
            return GARBLED + GARBLED if len(seen) == 1 else oracle.reply(
                seen[0] if len(seen) == 2 else text)

        return reply

    trajs, _ = _run(tokenizer, "calculator", make_policy, seeds=[3])
    (t,) = trajs
    assert [u.reward for u in t.turns] == [pytest.approx(-0.2), 0.0, 1.0]
    assert t.metrics["tool/calls"] == 3.0 and t.metrics["tool/errors"] == 2.0
    env = make_python_env("calculator")(EpisodeSpec(3, 0, 0), 0)
    assert t.tokens == _whole_chat(tokenizer, env, t)


def test_a_three_turn_tool_episode_is_qwen25s_own_format(qwen_fixture_dir):
    """A three-turn episode (two calls, then the answer) written as the structured messages
    a Qwen2.5 user would send: the tools' schemas go to the template, each call is the
    assistant message's `tool_calls` (not its text), each result a `tool` message. Qwen2.5's
    own chat template renders them token for token as the stream the rollout appended, and
    the row the learner trains on holds that stream with loss exactly on the replies."""
    import json

    import numpy as np

    from jaxrl_agentic.data.packing import PackingConfig
    from jaxrl_agentic.data.samples import build_samples
    from jaxrl_agentic.envs.tools import format_tool_call, parse_tool_calls

    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen_fixture_dir)

    def make_policy(rng):  # a warm-up sum first, then the oracle's call and answer
        del rng
        oracle, seen = CalculatorOracle(), []

        def reply(text):
            seen.append(text)
            if len(seen) == 1:
                return format_tool_call("calculate", {"expression": "1 + 1"})
            return oracle.reply(seen[0] if len(seen) == 2 else text)

        return reply

    (t,), _ = _run(tokenizer, "calculator", make_policy, seeds=[5])
    assert len(t.turns) == 3 and t.metrics["success"] == 1.0 and t.metrics["tool/errors"] == 0
    env = make_python_env("calculator")(EpisodeSpec(5, 0, 0), 0)
    messages = [{"role": "user", "content": env.reset(5)}]
    for turn in t.turns:
        calls = parse_tool_calls(turn.reply)
        if not calls:
            messages.append({"role": "assistant", "content": turn.reply})
            break
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]})
        messages += [{"role": "tool", "content": m} for m in env.step(turn.reply).tool_messages]
    text = tokenizer.apply_chat_template(messages, tools=env.tool_schemas, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "<tools>\n" + json.dumps(
        env.tool_schemas[0]) in text  # the tools block of the system turn
    assert text.count("<tool_call>\n{\"name\": \"calculate\"") == 2
    assert text.count("<|im_start|>user\n<tool_response>\n") == 2
    qwen_ids = tokenizer.encode(text[:-1], add_special_tokens=False)  # less the final "\n"
    assert t.tokens == qwen_ids

    (sample,), _ = build_samples([t], [np.ones(3, np.float32)], sample_mode="trajectory")
    batch = PackingConfig(micro_batch_max_tokens=2048, sequence_length=2048,
                          rows_bucket=1).pack([sample])
    n = len(qwen_ids)
    assert np.asarray(batch.tokens)[0, :n].tolist() == qwen_ids
    generated = np.zeros(n, bool)
    for turn in t.turns:
        generated[turn.context_len:turn.context_len + len(turn.generated)] = True
    assert np.array_equal(np.asarray(batch.loss_mask)[0, :n] > 0, generated)
    replies = [tokenizer.decode(np.asarray(qwen_ids)[generated[:n]][a:b])
               for a, b in _spans([len(turn.generated) for turn in t.turns])]
    assert replies == [turn.reply + "<|im_end|>" for turn in t.turns]


def _spans(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n
