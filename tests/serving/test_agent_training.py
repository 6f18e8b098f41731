"""An outside agent trained end to end: recipe fields name its function (`openai_agent`),
the pipeline's rollout runs it against the endpoint, and two training steps learn from
trajectories whose tokens and logprobs are the ones the sampler drew."""

import json
import urllib.request

import jax
import numpy as np
import pytest

from jaxrl_agentic.config import default_config, env_manager, env_spec, validate
from jaxrl_agentic.pipeline import Pipeline
from jaxrl_agentic.rollout.turns import turn_seed
from jaxrl_agentic.serving import AgentRolloutRunner

pytest.importorskip("aiohttp")
TASKS = ["a", "e"]


def toy_agent(base_url, api_key, task):
    """Asks the model twice (the second request extends the first); reward 1 if a reply
    holds the task's letter. Plain urllib: any HTTP client is an OpenAI client here."""
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": f"Say the letter {task}."}]
    found = False
    for _ in range(2):
        request = urllib.request.Request(
            base_url + "/chat/completions", method="POST",
            data=json.dumps({"model": "policy", "messages": messages}).encode(),
            headers={"Content-Type": "application/json",
                     "Authorization": f"Bearer {api_key}"})
        with urllib.request.urlopen(request, timeout=120) as r:
            message = json.loads(r.read())["choices"][0]["message"]
        found = found or task in (message["content"] or "")
        messages += [message, {"role": "user", "content": "Again."}]
    return float(found)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    c = default_config()
    c.exp_name, c.output_dir = "outside_agent", str(tmp_path_factory.mktemp("agent"))
    c.adv_estimator, c.sample_mode = "grpo", "trajectory"
    c.format_warmup.steps, c.max_steps, c.mini_batch_size = 0, 2, 4
    c.max_input_length, c.sequence_length, c.micro_batch_max_tokens = 192, 256, 512
    c.custom_envs = {"agent": env_spec(
        "openai_agent", max_turns=4, max_tokens_per_step=6,
        agent_fn="tests.serving.test_agent_training:toy_agent", tasks=TASKS)}
    c.train_env_manager = env_manager(num_env_groups=2, group_size=2, tags=("agent",))
    c.val_env_manager = env_manager(num_env_groups=2, group_size=1, tags=("agent",))
    validate(c)
    p = Pipeline(c)
    yield p
    p.close()


def test_two_training_steps_on_the_agents_trajectories(pipe):
    runner = pipe.runners["agent"]
    assert isinstance(runner, AgentRolloutRunner)
    for step in range(2):
        # What this step's rollout samples with (a copy: the update donates its buffers).
        params = jax.device_get(pipe.sampler_params())
        metrics, trajs, samples = pipe.train_step()
        assert len(trajs) == 4 and len(samples) == 4
        assert all(len(t.turns) == 2 and t.terminated for t in trajs)
        # Group members share their task: the same first prompt.
        firsts = [t.tokens[:t.turns[0].context_len] for t in trajs]
        assert firsts[0] == firsts[1] != firsts[2] == firsts[3]
        assert [t.score for t in trajs] == [float(t.metrics["success"]) for t in trajs]
        assert abs(metrics["rollout/logprob_mismatch"]) < 1e-4
        assert (metrics["env/agent/requests"], metrics["env/agent/failures"],
                metrics["env/agent/rewritten_histories"]) == (8.0, 0.0, 0.0)
        seed = pipe.config.run.seed * 1_000_003 + step * 2
        for t in trajs:
            for k, turn in enumerate(t.turns):
                session = pipe.sampler.new_session(1)
                session.extend([0], [t.tokens[:turn.context_len]])
                ref = session.generate([0], max_new_tokens=6, seed=turn_seed(seed, k),
                                       row_seeds=[t.traj_id], params=params)
                assert ref.tokens[0] == turn.generated
                np.testing.assert_allclose(ref.logprobs[0], turn.logprobs, atol=1e-5)
    assert runner.stats["requests"] == 16 and runner.stats["failures"] == 0
    assert runner.stats["rewritten_histories"] == 0
