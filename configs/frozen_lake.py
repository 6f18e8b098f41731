"""FrozenLake 4×4 with the tiny default model: turn-level GRPO on shaped rewards,
trajectory-wise samples; the model generates only the action token.

    python -m jaxrl_agentic.train --config configs/frozen_lake.py

Measured result: docs/benchmarks.md, "Learning across seeds". How each setting was found:
docs/notes/frozen_lake_recipe.md.
"""

from jaxrl_agentic.config import default_config, env_manager, env_spec


def get_config():
    c = default_config()
    c.exp_name = "frozen_lake"
    c.pretrain = "tiny"
    # A move is judged by the shaped rewards of the next turn or two against the other moves
    # on the same map: a sharper per-move signal than one episode-level advantage.
    c.adv_estimator = "turn_grpo"
    c.step_reward_gamma = 0.5
    # The model generates only ACTION; the tags are context and parser text, because
    # generated format tokens around the decision stall learning (docs/notes/reply_format.md).
    c.reply_prefix = "<answer>"
    c.reply_suffix = "</answer>"
    c.sample_mode = "trajectory"
    c.max_steps = 200
    c.save_steps = 25
    c.eval_steps = 10
    c.learning_rate = 1e-3
    c.lr_scheduler_type = "cosine"
    c.warmup_steps = 5
    c.min_lr_ratio = 0.1
    c.mini_batch_size = 16
    # One JAX device per core: the tiny model's programs keep about one core busy each.
    c.mesh.cpu_devices = 0
    # A KL towards the warmed model keeps the policy from saturating on "head for the goal"
    # before it has learned to read the holes in the hint.
    c.init_kl_coef = 0.15
    # A 6-turn episode is under 400 tokens: one episode fits a 512-token row.
    c.max_input_length = 480
    c.sequence_length = 512
    c.micro_batch_max_tokens = 512
    c.generation.temperature = 1.0
    # The tiny model's tied head stalls learning; untied, the head starts as a copy.
    c.untie_word_embeddings = True
    # Teach the reply format first (random valid actions), so RL teaches the policy.
    c.format_warmup.steps = 40
    c.format_warmup.learning_rate = 2e-3
    # Shaped rewards (±0.5 per step towards/away from the goal, −2 for a hole, −1 for an
    # invalid reply, −0.5 for walking into the edge) so that every move carries a signal; a
    # hole must cost more than a step away from the goal, and a bump more than waiting.
    # Success is still only reaching the goal. Short hints: docs/environments.md.
    c.custom_envs = {"frozen_lake": env_spec("frozen_lake", max_turns=6, max_tokens_per_step=1,
                                             format_penalty=1.0, cell_separator=" ", hints=True,
                                             hint_style="short", progress_reward=0.5,
                                             hole_penalty=2.0, bump_penalty=0.5,
                                             brief_instructions=True)}
    # Training maps have more holes than the held-out ones (p_frozen 0.7, eval on the
    # standard 0.8), so more of a batch's moves are the ones that decide success; 16 maps of
    # 4 episodes (the same 64 episodes as 8 × 8) see twice as many distinct boards.
    c.train_env_manager = env_manager(num_env_groups=16, group_size=4, tags=("frozen_lake",),
                                      env_config={"p_frozen": 0.7})
    # 64 held-out maps: the standard error of eval/success near 0.75 is 0.054 (0.077 at 32).
    c.val_env_manager = env_manager(num_env_groups=64, group_size=1, tags=("frozen_lake",))
    return c
