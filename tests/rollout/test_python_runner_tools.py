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
