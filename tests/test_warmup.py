"""Format warm-up: scripted random-action replies in real rollout streams, NLL falls, cached."""

import os

import pytest

from jaxrl_agentic import warmup
from jaxrl_agentic.config import default_config, env_spec
from jaxrl_agentic.envs import make
from jaxrl_agentic.models import load_pretrained
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.loop import RolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig


def small_config(steps: int):
    c = default_config()
    c.custom_envs = {"frozen_lake": env_spec("frozen_lake", max_turns=2, max_tokens_per_step=8)}
    c.train_env_manager.tags = ("frozen_lake",)
    c.val_env_manager.tags = ("frozen_lake",)
    c.max_input_length = 512
    c.sequence_length = 640
    c.micro_batch_max_tokens = 1280
    c.format_warmup.steps = steps
    c.format_warmup.episodes_per_step = 4
    c.format_warmup.max_turns = 1
    c.format_warmup.learning_rate = 5e-3
    return c


def scripted_rollout(tiny_model_dir, max_new_tokens: int, **formatter_kwargs):
    """(tokenizer, formatter, env, trajectories) of 4 FrozenLake episodes played by the
    warm-up's scripted random-action replies through the real rollout loop."""
    _, tok = load_pretrained(tiny_model_dir)
    formatter = ChatFormatter(tok, **formatter_kwargs)
    env, params = make("frozen_lake")
    sampler = warmup.ScriptedSampler(
        warmup.random_action_replies(formatter, env.action_names, seed=0), max_total_len=600)
    runner = RolloutRunner(env, params, sampler, formatter, tag="fl", max_turns=3,
                           max_input_length=512, generation=GenerationConfig(max_new_tokens))
    trajs = runner.run([EpisodeSpec(seed=s, group_id=s, member=0) for s in range(4)],
                       sample_seed=0)
    return tok, formatter, env, trajs


def test_scripted_replies_are_valid_actions_in_real_streams(tiny_model_dir):
    _, formatter, env, trajs = scripted_rollout(tiny_model_dir, 8)
    names = set()
    for t in trajs:
        for u in t.turns:
            assert u.action_is_valid and not u.eos_appended
            assert u.generated[-1] == formatter.eos_token_id  # the model learns to stop
            names.add(env.action_names[u.action])
        assert t.loss_mask().sum() == sum(len(u.generated) for u in t.turns)
    assert len(names) > 1  # random actions, not one fixed reply


def test_scripted_replies_with_prefix_suffix_and_one_new_token(tiny_model_dir):
    """With reply_prefix/suffix and max_tokens_per_step=1 the scripted reply is the action
    token alone, closed by the rollout's own EOS (loss mask 0), exactly as RL replies are."""
    tok, _, env, trajs = scripted_rollout(tiny_model_dir, 1, reply_prefix="<answer>",
                                          reply_suffix="</answer>")
    for t in trajs:
        for u in t.turns:
            assert u.action_is_valid and u.eos_appended and len(u.generated) == 1
            assert tok.decode(u.generated) == env.action_names[u.action]
        assert t.loss_mask().sum() == len(t.turns)


def test_warmup_lowers_reply_nll(tiny_model_dir, tmp_path):
    # Tree-packed: every warm-up episode starts with the same instructions, written once
    # per row (the layout's equality with the flat one: tests/data/test_tree_packing.py).
    c = small_config(steps=6)
    c.share_group_prefix = True
    metrics = warmup.format_warmup(tiny_model_dir, c, str(tmp_path / "m"))
    assert metrics["tokens/shared_saved"] > 0
    assert metrics["warmup/nll"] < 0.8 * metrics["warmup/nll_first"]
    model, _ = load_pretrained(str(tmp_path / "m"))  # a loadable HF directory
    assert model.cfg.vocab_size > 0


def test_warmed_model_is_built_once_and_cached(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRL_AGENTIC_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_warmup(base, c, out, log=print):
        calls.append(out)
        os.makedirs(out)
        open(os.path.join(out, "model.safetensors"), "w").close()

    monkeypatch.setattr(warmup, "format_warmup", fake_warmup)
    c = small_config(steps=3)
    first = warmup.warmed_model_dir(tiny_model_dir, c)
    assert warmup.warmed_model_dir(tiny_model_dir, c) == first and len(calls) == 1
    c.format_warmup.steps = 4  # anything that changes the result changes the key
    assert warmup.warmed_model_dir(tiny_model_dir, c) != first and len(calls) == 2
    c.untie_word_embeddings = True
    assert warmup.warmed_model_dir(tiny_model_dir, c) not in calls[:2] and len(calls) == 3
    c.format_warmup.replies = ("<answer>Up</answer>",)
    assert warmup.warmed_model_dir(tiny_model_dir, c) not in calls[:3] and len(calls) == 4


@pytest.mark.parametrize("env_type", ["frozen_lake", "calculator"])
def test_given_warmup_replies_replace_the_environments_own(env_type, tiny_model_dir):
    # format_warmup.replies: the warm-up plays exactly those replies, at random, on a JAX
    # environment (instead of random valid actions) and on a Python one (instead of its own
    # text policy), through the runners format_warmup builds.
    from jaxrl_agentic.run_config import build_run_config

    replies = ("<answer>Up</answer>", "<answer>Left</answer>", "<answer>7</answer>")
    c = small_config(steps=1)
    c.custom_envs = {"frozen_lake": env_spec(env_type, max_turns=2, max_tokens_per_step=8)}
    c.format_warmup.replies = replies
    _, tok = load_pretrained(tiny_model_dir)
    [runner] = warmup.warmup_runners(build_run_config(c), ChatFormatter(tok))
    trajs = runner.run([EpisodeSpec(seed=s, group_id=s, member=0) for s in range(6)],
                       sample_seed=0)
    written = [tok.decode(u.generated, skip_special_tokens=True) for t in trajs for u in t.turns]
    assert set(written) <= set(replies) and len(set(written)) > 1, written


def test_warmup_of_an_untied_model_trains_its_own_head(tiny_model_dir, tmp_path):
    import numpy as np

    c = small_config(steps=2)
    c.untie_word_embeddings = True
    warmup.format_warmup(tiny_model_dir, c, str(tmp_path / "m"))
    model, _ = load_pretrained(str(tmp_path / "m"))
    base, _ = load_pretrained(tiny_model_dir)
    assert base.cfg.tie_word_embeddings and not model.cfg.tie_word_embeddings
    head, embedding = np.asarray(model.lm_head.kernel[...]), np.asarray(model.embed.embedding[...])
    assert np.abs(head - embedding.T).max() > 1e-4  # both moved, each its own way
    assert np.abs(embedding - np.asarray(base.embed.embedding[...])).max() > 1e-4


def test_warmup_learning_rate_schedules_by_hand():
    from jaxrl_agentic.run_config import FormatWarmupConfig

    cosine = FormatWarmupConfig(steps=5, learning_rate=2e-3, lr_schedule="cosine")
    # η·(0.1 + 0.45·(1 + cos(π·t/4))): t = 0, 2, 4 → η, 0.55·η, 0.1·η
    assert warmup.warmup_learning_rate(cosine, 0) == pytest.approx(2e-3)
    assert warmup.warmup_learning_rate(cosine, 2) == pytest.approx(1.1e-3)
    assert warmup.warmup_learning_rate(cosine, 4) == pytest.approx(2e-4)
    constant = FormatWarmupConfig(steps=5, learning_rate=2e-3)
    assert {warmup.warmup_learning_rate(constant, t) for t in range(5)} == {2e-3}


def test_the_warmup_renders_the_runs_system_prompt(tiny_model_dir, tmp_path, monkeypatch):
    """The warm-up's episodes start as RL's will: with the run's system prompt (before, the
    warm-up rendered none and trained on prompts RL never shows), and its cache key holds it."""
    from jaxrl_agentic.run_config import build_run_config

    c = small_config(steps=1)
    c.system_prompt = "You walk on ice."
    seen = {}

    class Stop(Exception):
        pass

    def capture(cfg, formatter):
        seen["formatter"] = formatter
        raise Stop

    monkeypatch.setattr(warmup, "warmup_runners", capture)
    with pytest.raises(Stop):
        warmup.format_warmup(tiny_model_dir, c, str(tmp_path / "warm"))
    ids = seen["formatter"].first_prompt("Move.")
    assert seen["formatter"].tokenizer.decode(ids).startswith(
        "<|im_start|>system\nYou walk on ice.<|im_end|>")
    plain = small_config(steps=1)
    assert (warmup.warmup_cache_key(tiny_model_dir, build_run_config(c))
            != warmup.warmup_cache_key(tiny_model_dir, build_run_config(plain)))


def test_the_warmup_computes_in_the_runs_dtype_and_keys_its_cache_by_it(
        tiny_model_dir, tmp_path, monkeypatch):
    """A bf16 run warms up in bf16 (over fp32 parameters), and a warm-up built in one
    compute dtype is never reused by a run in another."""
    import jaxrl_agentic.models as models
    from jaxrl_agentic.run_config import build_run_config

    class Stop(Exception):
        pass

    seen = {}

    def capture(path, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(models, "load_pretrained", capture)
    c = small_config(steps=1)
    c.dtype = "bfloat16"
    with pytest.raises(Stop):
        warmup.format_warmup(tiny_model_dir, c, str(tmp_path / "warm"))
    assert seen["dtype"] == "bfloat16" and seen["param_dtype"] == "float32"
    plain = small_config(steps=1)
    assert (warmup.warmup_cache_key(tiny_model_dir, build_run_config(c))
            != warmup.warmup_cache_key(tiny_model_dir, build_run_config(plain)))


@pytest.mark.parametrize("template", ["smollm2", "qwen2.5"])
def test_the_calculator_warmup_answers_a_tool_result_in_any_templates_rendering(
        template, request):
    """SmolLM2's template renders tool results as bare `tool` turns, not `<tool_response>`
    blocks: a policy that found no result there called again instead of answering, and the
    warmed model learned to call forever."""
    from jaxrl_agentic.envs.calculator import random_calculator_policy
    from jaxrl_agentic.models.hf_io import load_tokenizer

    fixture = {"smollm2": "smollm2_dir", "qwen2.5": "qwen_fixture_dir"}[template]
    tok = load_tokenizer(request.getfixturevalue(fixture))
    formatter = ChatFormatter(tok)
    replies = warmup.text_policy_replies(formatter, random_calculator_policy, seed=0)
    first = formatter.first_prompt("Problem: Ann has 17 apples and buys 25 more. How many?")
    call = tok.decode(replies(0, first), skip_special_tokens=True)
    assert '"name": "calculate"' in call and "17" in call and "25" in call
    for results in (["42"], ["42", "error: division by zero"]):
        assert formatter.tool_results(tok.decode(formatter.tool_prompt(results))) == results
    answer = replies(0, formatter.tool_prompt(["42"]))
    assert answer == formatter.reply_ids("<answer>42</answer>")
    assert formatter.tool_results(tok.decode(formatter.next_prompt("no tools here"))) == []


def test_outside_agents_are_not_warmed_up_and_do_not_change_the_cache_key():
    """An agent writes its own chat: the warm-up plays the run's built-in environments only
    (the agent recipe's warmed model is the built-in recipe's, one cache entry), and a run of
    agents alone with warm-up steps is a one-line error."""
    from jaxrl_agentic.config import ConfigError
    from jaxrl_agentic.run_config import as_run_config
    from jaxrl_agentic.warmup import warmup_cache_key, warmup_envs

    c = default_config()
    c.format_warmup.steps = 10
    c.custom_envs = {"frozen_lake": env_spec("frozen_lake")}
    key = warmup_cache_key("/m", as_run_config(c))
    c.custom_envs["agent"] = env_spec("agent:math:hypot", tasks=[1])
    assert [tag for tag, _ in warmup_envs(as_run_config(c))] == ["frozen_lake"]
    assert warmup_cache_key("/m", as_run_config(c)) == key
    c.custom_envs = {"agent": env_spec("openai_agent", agent_fn="math:hypot")}
    c.train_env_manager.tags = c.val_env_manager.tags = ("agent",)
    with pytest.raises(ConfigError, match="format_warmup.steps: the run plays only outside"):
        warmup_envs(as_run_config(c))
