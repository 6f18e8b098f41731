"""Format warm-up: teach only the reply format, so that RL is what teaches the policy.

A randomly initialised model never writes `<answer>Left</answer>`, so every reply would be
invalid and RL would have no signal. The warm-up plays episodes where a scripted policy
replies with a *uniformly random valid action* in the exact token streams the rollout builds
(the real `RolloutRunner`, driven by `ScriptedSampler`), and maximises the likelihood of
those replies. Random actions teach the format and nothing about which move is good.

Maximum likelihood through the PPO learner: with advantages 1 and old logprobs recomputed
from the current parameters, the ratio is exactly 1 at the single update of each step, so

    ∇ −Σ A·ratio = −Σ ∇ log π(token)

which is the negative log-likelihood gradient (token-mean reduction).

The warmed model is cached (HF format) under the user cache dir, keyed by everything that
affects it, and reused by later runs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import sys

import numpy as np

from jaxrl_agentic.run_config import RunConfig, as_run_config
from jaxrl_agentic.sampling import GenerationResult


class ScriptedSampler:
    """Stands in for `Sampler` in the rollout loop: replies come from
    `reply_ids(row, new_ids)`, where `new_ids` are the ids appended to that row since its
    last reply (the new messages: a policy that must read them, such as a tool result it
    copies, decodes them)."""

    def __init__(self, reply_ids, max_total_len: int):
        self.reply_ids = reply_ids
        self.max_total_len = max_total_len

    def new_session(self, num_rows: int):
        return _ScriptedSession(self)


class _ScriptedSession:
    def __init__(self, sampler: ScriptedSampler):
        self.sampler = sampler
        self.new_ids: dict[int, list[int]] = {}

    def extend(self, rows, new_ids) -> None:
        for row, ids in zip(rows, new_ids, strict=True):
            self.new_ids.setdefault(row, []).extend(ids)

    def generate(self, rows, *, max_new_tokens: int, **kwargs) -> GenerationResult:
        del kwargs
        # Cut to the generation limit as the sampler would: the rollout then closes the
        # reply with an EOS of its own (loss mask 0), exactly as in RL.
        full = [self.sampler.reply_ids(row, self.new_ids.pop(row, [])) for row in rows]
        tokens = [ids[:max_new_tokens] for ids in full]
        return GenerationResult(
            tokens=tokens,
            logprobs=[np.zeros(len(t), np.float32) for t in tokens],
            stop_reasons=["eos" if len(t) == len(f) else "length"
                          for t, f in zip(tokens, full, strict=True)],
        )


def random_action_replies(formatter, action_names, seed: int):
    """reply_ids(row, new_ids) → ids of `<answer>NAME</answer>` + EOS for a random action."""
    rng = random.Random(seed)
    encoded = [formatter.reply_ids(f"<answer>{name}</answer>") for name in action_names]
    return lambda row, new_ids=(): list(rng.choice(encoded))


def text_policy(env_type: str, env_config: dict):
    """The format-only text policy of a Python environment, `make(rng)` →
    `reply(new_text) -> reply_text`, or None when it has none: the calculator's random
    well-formed calls then an answer, the shop's lookup then a random calculation, a
    TextArena game's example actions (`textarena_env.random_example_policy`; a two-player
    game's listed legal moves, `textarena_games.random_listed_move_policy`), a reasoning-gym
    dataset's answers to other items (`reasoning_gym_env.another_items_answer_policy`), with
    the calculator as its one tool sometimes a call instead
    (`reasoning_gym_env.call_or_guess_policy`)."""
    if env_type in ("calculator", "shop"):  # tool envs: calls written in the env's style
        from jaxrl_agentic.envs.calculator import random_calculator_policy
        from jaxrl_agentic.envs.shop import random_shop_policy

        policy = {"calculator": random_calculator_policy, "shop": random_shop_policy}
        return functools.partial(policy[env_type],
                                 call_style=env_config.get("call_style", "qwen"))
    if env_type.startswith("textarena:"):
        from jaxrl_agentic.envs.textarena_env import random_example_policy
        from jaxrl_agentic.envs.textarena_games import random_listed_move_policy

        return random_listed_move_policy if _two_player(env_type) else random_example_policy
    tools = env_config.get("tools") or ()
    tools = (tools,) if isinstance(tools, str) else tuple(tools)
    if env_type.startswith("reasoning_gym:") and tools in ((), ("calculate",)):
        from jaxrl_agentic.envs import reasoning_gym_env

        dataset, dataset_config = env_type.split(":", 1)[1], env_config.get("dataset_config")
        if tools:
            return reasoning_gym_env.call_or_guess_policy(
                dataset, dataset_config, call_style=env_config.get("call_style", "qwen"))
        return reasoning_gym_env.another_items_answer_policy(dataset, dataset_config)
    return None


def given_replies_policy(replies):
    """The text policy of `format_warmup.replies`: `make(rng)` → a reply that is one of
    `replies` at random, whatever the messages (a game whose first message shows a single
    example action would otherwise teach that one action: `configs/textarena.py`)."""
    replies = tuple(replies)

    def make(rng, **_unused):
        return lambda text: rng.choice(replies)

    return make


def check_warmup_replies(cfg) -> None:
    """`format_warmup.replies` are whole replies, as a policy writes them and the
    environment parses them: ``reply_prefix + generated + reply_suffix``; the warm-up trains
    the part between (``ChatFormatter.reply_ids``), as it does with the environments' own
    policies. A reply without them is a one-line config error, before anything is loaded.

    Not wrapped in them instead: a reply that happened to start with the prefix would then
    mean something else than one that did not, and an override of ``reply_prefix`` would
    silently change what the warm-up teaches."""
    from jaxrl_agentic.config import ConfigError

    cfg = as_run_config(cfg)
    prefix, suffix = cfg.rollout.reply_prefix, cfg.rollout.reply_suffix
    if cfg.format_warmup.steps <= 0:
        return
    for reply in cfg.format_warmup.replies:
        if not (reply.startswith(prefix) and reply.endswith(suffix)
                and len(reply) >= len(prefix) + len(suffix)):
            raise ConfigError(
                f"config.format_warmup.replies: {reply!r} is not a whole reply: each starts "
                f"with reply_prefix {prefix!r} and ends with reply_suffix {suffix!r}, as the "
                f"environment reads it (e.g. {prefix + reply + suffix!r})")


def text_policy_replies(formatter, make_policy, seed: int):
    """reply_ids(row, new_ids) for a text policy that reads the new messages of its row.

    Tool results reach the policy as `<tool_response>` blocks (`envs.tools.tool_responses`
    reads them back) whatever the template makes of the `tool` role: SmolLM2's renders bare
    `tool` turns, and a policy that found no result there would call again instead of
    answering, teaching the warmed model to do the same."""
    from jaxrl_agentic.envs.tools import tool_response_text

    rng = random.Random(seed)
    policies: dict[int, object] = {}

    def reply_ids(row, new_ids):
        policy = policies.setdefault(row, make_policy(rng))
        text = formatter.tokenizer.decode(list(new_ids), skip_special_tokens=False)
        results = formatter.tool_results(text)
        return formatter.reply_ids(policy(tool_response_text(results) if results else text))

    return reply_ids


def env_warmup_replies(factory, formatter, seed: int):
    """(factory, reply_ids) for a Python environment with a `warmup_reply(rng)` method
    (`envs/python_env.py`): each reply is the method's answer on the episode's own
    environment, in the state the episode is in; (factory, None) for one without (one
    environment is built to see).

    The returned factory records each environment it builds under its episode's group:
    the warm-up's episode k is group k and row k of the scripted session
    (`format_warmup`), so row k's reply comes from the environment of group k."""
    from jaxrl_agentic.rollout.groups import EpisodeSpec

    if getattr(factory(EpisodeSpec(seed=0, group_id=0, member=0), 0), "warmup_reply",
               None) is None:
        return factory, None
    rng, envs = random.Random(seed), {}

    def recording(spec, run_seed):
        envs[spec.group_id] = env = factory(spec, run_seed)
        return env

    def reply_ids(row, new_ids):
        del new_ids  # the environment knows its state
        reply = envs[row].warmup_reply(rng)
        if not isinstance(reply, str):
            raise TypeError(f"{type(envs[row]).__name__}.warmup_reply() must return the "
                            f"reply text (str), got {type(reply).__name__}")
        return formatter.reply_ids(reply)

    return recording, reply_ids


def warmup_cache_key(base_model_dir: str, cfg: RunConfig) -> str:
    """What the warmed model depends on, hashed: a change to any of it builds another."""
    envs = {tag: env.record() for tag, env in cfg.envs.items() if warmed(env)}
    if cfg.train.env_config:  # warm-up plays those maps too (warmup_envs)
        envs["train_env_manager"] = dict(cfg.train.env_config)
    w, rollout = cfg.format_warmup, cfg.rollout
    payload = json.dumps({
        "model": os.path.abspath(base_model_dir),
        "envs": envs,
        "steps": w.steps,
        "lr": w.learning_rate,
        "episodes": w.episodes_per_step,
        "max_turns": w.max_turns,
        "max_input_length": rollout.max_input_length,
        "seed": cfg.run.seed,
        "reply_prefix": rollout.reply_prefix,
        "reply_suffix": rollout.reply_suffix,
        "untie_word_embeddings": cfg.model.untie_word_embeddings,
        # 2: the calculator's warm-up keeps the problem's order of numbers; 3: its
        # "two_digit" products have a one-digit last factor; 4: text policies read tool
        # results in any template's rendering.
        "version": 4,
        # Only non-default settings enter the key: earlier warm-ups keep theirs.
        **({"lr_schedule": w.lr_schedule} if w.lr_schedule != "constant" else {}),
        **({"replies": list(w.replies)} if w.replies else {}),
        # Two-player games' warm-up plays listed (legal) moves since this key entry.
        **({"listed_moves": 1} if any(_two_player(e.env_type) for e in cfg.envs.values())
           else {}),
        **({"system_prompt": rollout.system_prompt} if rollout.system_prompt else {}),
        **({"dtype": cfg.model.dtype} if cfg.model.dtype != "float32" else {}),
    }, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _two_player(env_type: str) -> bool:
    if not env_type.startswith("textarena:"):
        return False
    from jaxrl_agentic.envs.textarena_games import is_two_player

    return is_two_player(env_type.split(":", 1)[1])


def warmup_learning_rate(w, step: int) -> float:
    """The warm-up's LR at `step` (0-based) of `w.steps`: `w.learning_rate` throughout
    ("constant"), or ("cosine", the run schedules' own `make_lr_schedule` with no warmup)
    η_t = η·(0.1 + 0.9·½(1 + cos(π·t/(T − 1)))), from η at the first step to η/10 at the
    last: a high rate to learn the format, a low one to settle it."""
    if w.lr_schedule == "constant" or w.steps <= 1:
        return w.learning_rate
    from jaxrl_agentic.algos.schedules import make_lr_schedule

    schedule = make_lr_schedule(w.learning_rate, "cosine", 0, w.steps - 1, min_lr_ratio=0.1)
    return float(schedule(step))


def format_warmup(base_model_dir: str, cfg: RunConfig, out_dir: str, *,
                  log=print) -> dict[str, float]:
    """Trains the reply format on random valid actions and saves the model to `out_dir`
    (`cfg`: a :class:`RunConfig` or a flat config)."""
    import jax
    from flax import nnx

    from jaxrl_agentic.data import PackingConfig
    from jaxrl_agentic.data.samples import trajectory_sample
    from jaxrl_agentic.models import load_pretrained, save_pretrained
    from jaxrl_agentic.rollout.conversation import ChatFormatter
    from jaxrl_agentic.rollout.groups import EpisodeSpec
    from jaxrl_agentic.runtime.parallel import make_mesh
    from jaxrl_agentic.training.learner import Learner
    from jaxrl_agentic.training.learner_config import LearnerConfig

    cfg = as_run_config(cfg)
    check_warmup_replies(cfg)
    rollout, seed = cfg.rollout, cfg.run.seed
    packing = cfg.learner.packing
    # In the run's compute dtype (bf16 matmuls are several times faster on CPUs with
    # AVX-512 BF16 / AMX), over fp32 parameters and moments as the run's default keeps them.
    model, tokenizer = load_pretrained(base_model_dir, dtype=cfg.model.dtype,
                                       param_dtype="float32",
                                       untie_word_embeddings=cfg.model.untie_word_embeddings)
    # The prompts RL will see: the run's system prompt too (else the template's default).
    formatter = ChatFormatter(tokenizer, system_prompt=rollout.system_prompt or None,
                              reply_prefix=rollout.reply_prefix,
                              reply_suffix=rollout.reply_suffix)
    w = cfg.format_warmup
    graphdef, params = nnx.split(model)
    learner = Learner(graphdef, params, LearnerConfig(
        learning_rate=w.learning_rate,
        mini_batch_size=10**9,  # one update per step: ratio stays exactly 1 (see module doc)
        recompute_old_logprobs=True,
        # Exact row counts: one step's batch varies, and fixed rows would mean 10**9 rows.
        packing=PackingConfig(micro_batch_max_tokens=packing.micro_batch_max_tokens,
                              sequence_length=packing.sequence_length, rows_bucket=0,
                              fixed_rows=False, pad_token_id=tokenizer.pad_token_id or 0,
                              # The episodes share the instructions (with tools, ~230
                              # tokens): tree packing computes them once per row.
                              share_group_prefix=packing.share_group_prefix),
        max_grad_norm=1.0,
        seed=seed,
    ), make_mesh(devices=jax.local_devices()))  # per process: others wait on the cache lock
    runners = warmup_runners(cfg, formatter)
    metrics, first_nll = {}, None
    for step in range(w.steps):
        samples = []
        for runner in runners:
            # Seeds far from the RL training (even) and validation (odd, small) seeds.
            episodes = [EpisodeSpec(seed=10**7 + step * w.episodes_per_step + k, group_id=k,
                                    member=0) for k in range(w.episodes_per_step)]
            trajs = runner.run(episodes, sample_seed=step)
            samples += [trajectory_sample(t, 1.0) for t in trajs if t.turns]
        metrics = learner.step(samples, [warmup_learning_rate(w, step)])
        # The scripted replies carry logprob 0, so the recomputation gap is exactly the mean
        # negative log-likelihood of the reply tokens under the current parameters.
        metrics["warmup/nll"] = metrics["rollout/logprob_mismatch"]
        first_nll = metrics["warmup/nll"] if first_nll is None else first_nll
        metrics["warmup/nll_first"] = first_nll
        if (step + 1) % 10 == 0 or step == 0:
            log(f"format warm-up {step + 1}/{w.steps}: nll={metrics['warmup/nll']:.4f}")
    save_pretrained(nnx.merge(graphdef, learner.params), tokenizer, out_dir)
    return metrics


def warmed(env) -> bool:
    """Whether the warm-up plays environment spec `env`: not an outside agent's
    (`openai_agent`, `agent:…`: the agent writes the chat, no scripted policy can). A
    recipe that trains an agent on the tiny model lists a built-in environment of the same
    format beside it, for the warm-up alone (configs/agent_calculator.py)."""
    from jaxrl_agentic.envs.outside_agent import is_outside_agent

    return not is_outside_agent(env.env_type)


def warmup_envs(cfg: RunConfig) -> list[tuple[str, dict]]:
    """(tag, env_config) of every environment the warm-up plays (`warmed`): each tag of
    `custom_envs` with its own parameters, then each training tag with the train manager's
    `env_config` overrides when it has any (the format is then seen on the maps RL trains
    on too). An error line when that leaves none."""
    from jaxrl_agentic.config import ConfigError

    envs = [(tag, dict(env.env_config)) for tag, env in cfg.envs.items() if warmed(env)]
    if cfg.train.env_config:
        envs += [(tag, cfg.split_env_config("train", tag)) for tag in cfg.train.manager.tags
                 if warmed(cfg.envs[tag])]
    if not envs:
        raise ConfigError("config.format_warmup.steps: the run plays only outside agents "
                          "(openai_agent), which the warm-up cannot script; set "
                          "format_warmup.steps=0, or list a built-in environment of the same "
                          "format in custom_envs for the warm-up (configs/agent_calculator.py)")
    return envs


def warmup_runners(cfg: RunConfig, formatter) -> list:
    """One rollout runner per warm-up environment (`warmup_envs`), each played by its
    scripted policy: `format_warmup.replies` when given, else a JAX environment's random
    valid actions or a Python environment's own text policy (`text_policy`, else its
    `warmup_reply` method: `env_warmup_replies`)."""
    from jaxrl_agentic.config import ConfigError
    from jaxrl_agentic.envs import make
    from jaxrl_agentic.envs.registry import resolve_backend
    from jaxrl_agentic.rollout.loop import RolloutRunner
    from jaxrl_agentic.rollout.turns import GenerationConfig

    rollout, seed, w = cfg.rollout, cfg.run.seed, cfg.format_warmup
    runners = []
    own = sum(warmed(env) for env in cfg.envs.values())  # then the train manager's maps
    for i, (tag, env_config) in enumerate(warmup_envs(cfg)):
        spec = cfg.envs[tag]
        try:
            if resolve_backend(spec.env_type, spec.backend) == "python":
                runners.append(_python_warmup_runner(cfg, i, spec, env_config, formatter))
                continue
            env, env_params = make(spec.env_type, format_penalty=spec.format_penalty,
                                   **env_config)
        except ValueError as e:  # past the tags: the train manager's overrides (warmup_envs)
            if i < own:
                raise
            raise ConfigError(f"config.train_env_manager.env_config: {e}") from None
        replies = (text_policy_replies(formatter, given_replies_policy(w.replies),
                                       seed + 7919 * i) if w.replies else
                   random_action_replies(formatter, env.action_names, seed + 7919 * i))
        scripted = ScriptedSampler(replies,
                                   max_total_len=rollout.max_input_length
                                   + spec.max_tokens_per_step + 1)
        # Short episodes: the format is the same on every turn, and long contexts would
        # spend most of the compute on prompt tokens that carry no loss.
        runners.append(RolloutRunner(env, env_params, scripted, formatter, tag=tag,
                                     max_turns=min(spec.max_turns, w.max_turns),
                                     max_input_length=rollout.max_input_length,
                                     generation=GenerationConfig(spec.max_tokens_per_step),
                                     run_seed=seed + 1))
    return runners


def _python_warmup_runner(cfg: RunConfig, i: int, spec, env_config: dict, formatter):
    """The warm-up runner of a Python environment: its format-only text policy, played
    through the real `PythonRolloutRunner` (same token streams as in RL)."""
    from jaxrl_agentic.config import ConfigError
    from jaxrl_agentic.envs.python_env import make_python_env
    from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner
    from jaxrl_agentic.rollout.turns import GenerationConfig

    policy = (given_replies_policy(cfg.format_warmup.replies) if cfg.format_warmup.replies
              else text_policy(spec.env_type, env_config))
    factory = make_python_env(spec.env_type, format_penalty=spec.format_penalty, **env_config)
    seed = cfg.run.seed + 7919 * i
    if policy is not None:
        replies = text_policy_replies(formatter, policy, seed)
    else:
        factory, replies = env_warmup_replies(factory, formatter, seed)
    if replies is None:
        raise ConfigError(f"config.format_warmup.steps: no format warm-up policy for the python "
                          f"environment {spec.env_type!r} (have: calculator, shop, textarena:<id>, "
                          "reasoning_gym:<dataset> without tools or with the calculator "
                          "alone, an environment with a warmup_reply(rng) method); give it "
                          "one (docs/extending.md), set format_warmup.replies, or set "
                          "format_warmup.steps=0")
    scripted = ScriptedSampler(
        replies, max_total_len=cfg.rollout.max_input_length + spec.max_tokens_per_step + 1)
    return PythonRolloutRunner(factory, scripted, formatter, tag=spec.tag,
                               max_turns=min(spec.max_turns, cfg.format_warmup.max_turns),
                               max_input_length=cfg.rollout.max_input_length,
                               generation=GenerationConfig(spec.max_tokens_per_step),
                               run_seed=cfg.run.seed + 1, step_timeout_s=spec.step_timeout_s)


def warmed_model_dir(base_model_dir: str, cfg, *, log=None) -> str:
    """The cached format-warmed model for run config `cfg` (a :class:`RunConfig` or a flat
    config; built on first use)."""
    cfg = as_run_config(cfg)
    from jaxrl_agentic.models.files import cache_dir, file_lock

    log = log or (lambda msg: print(msg, file=sys.stderr))
    out = os.path.join(cache_dir(), "warmup", warmup_cache_key(base_model_dir, cfg))
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    with file_lock(out + ".lock"):
        if not os.path.exists(os.path.join(out, "model.safetensors")):
            replies = cfg.format_warmup.replies  # the recipe's, shown: another env needs its own
            given = f", replies {' '.join(replies)} (format_warmup.replies)" if replies else ""
            log(f"[jaxrl_agentic] format warm-up ({cfg.format_warmup.steps} steps{given}) → {out}")
            format_warmup(base_model_dir, cfg, out, log=log)
    return out
