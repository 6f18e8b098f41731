"""Qwen2.5-0.5B-Instruct on `calculator` tool use (for an accelerator).

Word problems with one or two operations; the model calls `calculate` in Qwen's own
function-calling format (its chat template lists the tool; results come back as `tool`
messages in `<tool_response>` blocks) and answers `<answer>N</answer>`. No format warm-up:
the instruct model already writes tool calls. The model is read from a local directory:

    python -m jaxrl_agentic.train --config configs/qwen2_5_0_5b_tool_calculator.py \\
        --config.pretrain=/models/Qwen2.5-0.5B-Instruct

(`python -m jaxrl_agentic.models.qwen_fixture --out DIR --layers 2 --hidden 112` writes a
random-weight model of this shape with the real tokenizer, to try the plumbing.)
"""

from jaxrl_agentic.config import default_config, env_manager, env_spec


def get_config():
    c = default_config()
    c.exp_name = "qwen2_5_0_5b_tool_calculator"
    c.pretrain = "/models/Qwen2.5-0.5B-Instruct"
    c.dtype = "bfloat16"
    c.param_dtype = "float32"
    c.adv_estimator = "grpo"
    c.max_steps = 200
    c.save_steps = 20
    c.eval_steps = 10
    c.learning_rate = 1e-6
    c.mini_batch_size = 32
    c.init_kl_coef = 0.001
    c.max_input_length = 2048
    c.sequence_length = 3072
    c.micro_batch_max_tokens = 8192
    # Row lengths and remat as in configs/qwen2_5_0_5b_frozen_lake.py (why: see there).
    c.row_len_buckets = 18
    c.row_len_ratio = 2 ** 0.25
    c.remat = "layer"
    c.custom_envs = {"calculator": env_spec(
        "calculator", env_backend="python", max_turns=4, max_tokens_per_step=256,
        format_penalty=0.1, step_timeout_s=30.0, operations=0, tool_error_penalty=0.1,
        max_calls_per_turn=3, call_timeout_s=1.0, max_steps_in_episode=4)}
    c.train_env_manager = env_manager(num_env_groups=16, group_size=8, tags=("calculator",))
    c.val_env_manager = env_manager(num_env_groups=64, group_size=1, tags=("calculator",))
    return c
