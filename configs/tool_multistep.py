"""Tool use over several turns with two different tools: the shop's questions.

    python -m jaxrl_agentic.train --config configs/tool_multistep.py

Each episode is one question about one item of a shop whose price list is not in the prompt
(`shop`, a Python environment, docs/environments.md): the model calls `lookup` for the
item's price, reads it in a `tool` message, calls `calculate` with the price and the
question's number, reads the result, and answers `<answer>N</answer>` (three turns):

    How much do 6 lamps cost?                                        6 × price
    You have 90 coins and buy one lamp. How many coins are left?     90 − price
    You buy one lamp and pay 7 coins for delivery. How much is that in all?   price + 7

Reward 1 for the right number; −0.1 per garbled call and per reply with neither a call nor
an answer (at most 0.5 an episode). Metrics: `env/tool/calls_per_episode`, tool errors by
kind (`env/tool/errors_*`), `env/tool/turns_to_answer`.

The format warm-up (`random_shop_policy`) looks the named item up, then calculates the price
and the question's number in a random order with a random operator, and answers the result:
it teaches both calls, their order and the copying, not which operation a question needs.
RL must learn that from the words (lamps cost → ×, coins left → −, delivery → +).
"""

from jaxrl_agentic.config import default_config, env_manager, env_spec


def get_config():
    c = default_config()
    c.exp_name = "tool_multistep"
    c.pretrain = "tiny-tools"  # one token per digit; the call JSON as five added tokens
    c.adv_estimator = "grpo"
    c.sample_mode = "trajectory"
    c.max_steps = 600
    c.save_steps = 100
    c.eval_steps = 10
    c.eval_before_training = True  # step 0: what the format warm-up alone reaches
    c.learning_rate = 5e-4
    c.lr_scheduler_type = "cosine"
    c.warmup_steps = 3
    c.min_lr_ratio = 0.1
    c.mini_batch_size = 16
    c.init_kl_coef = 0.05
    # The first prompt (two tools' schemas + question) is ~300 tokens; three replies and two
    # tool results follow it.
    c.max_input_length = 640
    c.sequence_length = 768
    c.share_group_prefix = True  # the instructions and a group's question computed once
    c.micro_batch_max_tokens = 2048
    c.generation.temperature = 1.0
    c.format_warmup.steps = 600
    c.format_warmup.learning_rate = 2e-3
    c.format_warmup.episodes_per_step = 16
    c.format_warmup.max_turns = 3  # lookup, calculate, answer: every turn's format
    c.custom_envs = {"shop": env_spec(
        "shop", env_backend="python", max_turns=4, max_tokens_per_step=32,
        format_penalty=0.1, step_timeout_s=30.0, tool_error_penalty=0.1,
        max_calls_per_turn=2, call_timeout_s=1.0, max_steps_in_episode=4,
        call_style="compact")}
    c.train_env_manager = env_manager(num_env_groups=4, group_size=8, tags=("shop",))
    c.val_env_manager = env_manager(num_env_groups=32, group_size=1, tags=("shop",))
    return c
