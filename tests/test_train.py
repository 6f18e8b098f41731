"""The training program end to end at tiny sizes: every recipe runs, and resume is exact."""

import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxrl_agentic import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs/*.py")))


def recipe_env_tag(recipe: str) -> str:
    """The first env tag of `configs/<recipe>.py`."""
    path = os.path.join(ROOT, "configs", recipe + ".py")
    return next(iter(train.parse_config(["train", f"--config={path}"]).custom_envs))


def tiny_overrides(recipe: str, out: str, steps: int = 2) -> list[str]:
    env_tag = recipe_env_tag(recipe)
    path = os.path.join(ROOT, "configs", recipe + ".py")
    # The tool recipes run on the tool recipes' own model (tiny-tools), which writes their
    # prompts compactly (the tiny model's tokenizer spells a tool env's first prompt in ~510
    # tokens, the tools block: twice the compute, for the same code path); others run on the
    # tiny model. TextArena's FrozenLake draws a boxed board (~600, then ~330 a turn), and
    # its TicTacToe's board and rules put the second seat's first prompt past 512.
    pretrain = "tiny-tools" if "tool" in recipe else "tiny"
    long_prompts = recipe in ("textarena", "textarena_selfplay")
    input_length, sequence_length = (1024, 1280) if long_prompts else (512, 640)
    return [
        f"--config={path}",
        f"--config.output_dir={out}",
        f"--config.pretrain={pretrain}",
        "--config.format_warmup.steps=0",
        f"--config.max_steps={steps}",
        "--config.save_steps=1",
        f"--config.eval_steps={steps}",
        "--config.train_env_manager.num_env_groups=2",
        "--config.train_env_manager.group_size=2",
        "--config.val_env_manager.num_env_groups=2",
        "--config.mini_batch_size=4",
        f"--config.custom_envs.{env_tag}.max_turns=2",
        f"--config.custom_envs.{env_tag}.max_tokens_per_step=8",
        f"--config.max_input_length={input_length}",
        f"--config.sequence_length={sequence_length}",
        "--config.micro_batch_max_tokens=1280",
        # One CPU device whether the run is in this process (whose backend already runs on
        # one) or a subprocess (where the recipe's one-per-core would apply): a resumed run
        # must replay the killed one's rounding (test_sigkill_and_resume...).
        "--config.mesh.cpu_devices=1",
    ]


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_outputs(out: str, steps: int, gifs: bool = True) -> list[dict]:
    records = read_metrics(out)
    # Recipes with eval_before_training log the warmed model's eval as step 0 first.
    first = records[0]["step"]
    assert first in (0, 1) and [r["step"] for r in records] == list(range(first, steps + 1))
    for r in records:
        for key, value in r.items():
            assert isinstance(value, int | float) and math.isfinite(value), (key, value)
    for key in ("env/success", "actor/pg_loss", "actor/grad_norm", "optim/lr", "tokens/real",
                "rollout/logprob_mismatch", "optim/estimated_chunks_per_traj"):
        assert key in records[-1], key
    assert "eval/success" in records[-1]
    # Wall time since the run (or its resumption) started: the seed sweep reads it.
    assert all(r["time/elapsed"] > 0 for r in records)
    assert glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
    # Tool envs have no picture: no GIFs, counted in render/skipped.
    assert bool(glob.glob(os.path.join(out, "renders", "*.gif"))) == gifs
    # The final eval's held-out episodes as transcripts (2 val groups of 1).
    with open(os.path.join(out, "transcripts", f"eval_step_{steps}.txt")) as f:
        transcript = f.read()
    assert transcript.count("=== episode ") == 2 and "[reply 1]" in transcript
    return records


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "perf/"))}


STEPS = 3


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 3-step run of the default recipe at tiny size."""
    out = str(tmp_path_factory.mktemp("reference"))
    assert train.main(["train", *tiny_overrides("frozen_lake", out, STEPS)]) == 0
    return out


def test_sigkill_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    """A run killed after its first checkpoint and resumed logs the uninterrupted run's
    metrics exactly. All three runs are processes of their own, compiled alike: this
    process's programs may come from the suite's compilation cache, and those read back
    from it were seen to round differently from a fresh compile (the pg loss at ~1e-8, the
    logprob mismatch at ~1e-7), which would say nothing about resuming."""
    steps = STEPS

    def start(out: str, *extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "jaxrl_agentic.train",
               *tiny_overrides("frozen_lake", out, steps), *extra]
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    uninterrupted, killed = str(tmp_path / "uninterrupted"), str(tmp_path / "killed")
    reference, proc = start(uninterrupted), start(killed)
    marker = os.path.join(killed, "checkpoints", "1", "commit_success.txt")
    deadline = time.monotonic() + 600
    while not os.path.exists(marker) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a file written by another process, not a timing assertion
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.exists(marker), "the run never finished its first checkpoint"
    # The kill must have interrupted the run, or the comparison below would prove nothing.
    assert len(read_metrics(killed)) < steps

    assert start(killed, "--config.resume_from_checkpoint=latest").wait() == 0
    assert reference.wait() == 0
    expected, got = check_outputs(uninterrupted, steps), check_outputs(killed, steps)
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(got, expected, strict=True):
        differ = {k: (v, b.get(k)) for k, v in comparable(a).items() if v != b.get(k)}
        assert not differ and comparable(a).keys() == comparable(b).keys(), (a["step"], differ)


def test_tree_packing_learns_as_the_flat_layout_does(reference_run, tmp_path):
    """Three steps with each group's first prompt computed once per row: every learning
    metric is the flat run's to rounding (one mini-batch a step here, so both layouts
    update on the same samples), and fewer tokens are computed."""
    out = str(tmp_path / "tree")
    args = [*tiny_overrides("frozen_lake", out, STEPS), "--config.share_group_prefix=True"]
    assert train.main(["train", *args]) == 0
    flat, tree = read_metrics(reference_run), check_outputs(out, STEPS)
    for a, b in zip(flat, tree, strict=True):
        assert b["tokens/shared_saved"] > 0 and a["tokens/shared_saved"] == 0
        assert b["tokens/computed"] <= a["tokens/computed"]
        assert b["tokens/real"] == a["tokens/real"]
        for key, value in comparable(a).items():
            if not key.startswith(("tokens/", "perf/", "batch/")):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_evaluate_reproduces_the_runs_final_eval(reference_run, capsys):
    from jaxrl_agentic import evaluate

    args = [a for a in tiny_overrides("frozen_lake", reference_run, STEPS)]
    assert evaluate.main(["evaluate", *args,
                          f"--checkpoint={os.path.join(reference_run, 'checkpoints')}"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    got = json.loads(line)
    last = read_metrics(reference_run)[-1]
    assert got["step"] == STEPS
    for key in ("eval/success", "eval/return", "eval/num_turns", "eval/action_is_valid"):
        assert got[key] == last[key], key


def test_export_writes_a_model_transformers_loads(reference_run, tmp_path):
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from jaxrl_agentic import export
    from jaxrl_agentic.run_loading import load_run_config, restore_pipeline

    out = str(tmp_path / "hf")
    ckpt = os.path.join(reference_run, "checkpoints", str(STEPS))
    assert export.main(["--checkpoint", ckpt, "--out", out]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.arange(3, 40)[None]
    with torch.no_grad():
        hf_logits = hf(torch.tensor(tokens)).logits.numpy()
    ours = restore_pipeline(load_run_config(ckpt), ckpt).export_model()
    our_logits = np.asarray(ours(jnp.asarray(tokens), jnp.arange(tokens.shape[1])[None]))
    assert np.abs(hf_logits - our_logits).max() <= 1e-4
    assert export.main(["--checkpoint", str(tmp_path / "nope"), "--out", out]) == 2


def test_play_replays_a_runs_policy(reference_run, tmp_path):
    """`play --model RUN` plays with the run's latest checkpoint, as a model directory
    would: greedy replies are the exported policy's."""
    import io

    from jaxrl_agentic import export, play

    recipe = os.path.join(ROOT, "configs", "frozen_lake.py")
    argv = ["--config", recipe, "--greedy", "--max-turns", "2", "--seed", "5"]
    from_run = io.StringIO()
    assert play.main([*argv, "--model", reference_run], stdout=from_run) == 0
    hf = str(tmp_path / "hf")
    assert export.main(["--checkpoint", os.path.join(reference_run, "checkpoints"),
                        "--out", hf]) == 0
    from_hf = io.StringIO()
    assert play.main([*argv, "--model", hf], stdout=from_hf) == 0
    replies = [line for line in from_run.getvalue().splitlines() if line.startswith("model:")]
    assert replies and replies == [line for line in from_hf.getvalue().splitlines()
                                   if line.startswith("model:")]


def test_gae_trains_a_critic_and_resumes_it(tmp_path):
    out = str(tmp_path / "gae")
    args = [*tiny_overrides("frozen_lake", out, 2), "--config.adv_estimator=gae",
            "--config.critic_learning_rate=1e-3"]
    assert train.main(["train", *args]) == 0
    records = check_outputs(out, 2)
    for key in ("critic/value_loss", "critic/explained_variance", "critic/gae_advantages_mean"):
        assert key in records[-1], key
    args = [a if not a.startswith("--config.max_steps") else "--config.max_steps=3"
            for a in args] + ["--config.resume_from_checkpoint=latest"]
    assert train.main(["train", *args]) == 0  # restores policy *and* critic state
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_kl_in_reward_penalises_rewards_once_the_policy_moves(tmp_path):
    """Regression: kl_in_reward used to drop the KL loss term without penalising rewards."""
    out = str(tmp_path / "klr")
    args = [*tiny_overrides("frozen_lake", out, 2), "--config.kl_in_reward=True",
            "--config.init_kl_coef=0.5", "--config.learning_rate=1e-3",
            "--config.kl_estimator=k1", "--config.warmup_steps=0"]
    assert train.main(["train", *args]) == 0
    first, second = read_metrics(out)
    assert abs(first["actor/reward_kl"]) < 1e-5  # policy == reference before any update
    # After a real update (no LR warm-up: step 1's LR is not 0) the penalty is applied, and
    # it is well above the ~1e-7 sampler/learner rounding noise.
    assert second["actor/reward_kl"] > 1e-4
    # and the loss carries no KL term (KL is still measured and reported)
    assert abs(second["actor/loss"] - second["actor/pg_loss"]) < 1e-7


def test_debug_dump_writes_packed_arrays_with_segment_metadata(tmp_path):
    import numpy as np

    out, dump = str(tmp_path / "run"), str(tmp_path / "dump")
    args = [*tiny_overrides("frozen_lake_stepwise", out, 1), f"--config.debug.dump_dir={dump}"]
    assert train.main(["train", *args]) == 0
    data = np.load(os.path.join(dump, "batch_1.npz"))
    tokens = data["tokens"]
    for key in ("positions", "segment_ids", "loss_mask", "advantages", "old_logprobs"):
        assert data[key].shape == tokens.shape, key
    seg = data["segment_ids"]
    for key in ("seg_traj_id", "seg_turn", "seg_prompt_len", "seg_response_len"):
        assert data[key].shape[0] == tokens.shape[0], key
    # every used segment id indexes metadata; unused slots hold -1
    for row in range(tokens.shape[0]):
        used = set(np.unique(seg[row])) - {0}
        for s in used:
            length = int((seg[row] == s).sum())
            assert data["seg_prompt_len"][row, s - 1] + data["seg_response_len"][row, s - 1] \
                == length
            assert data["seg_turn"][row, s - 1] >= 0
        assert (data["seg_traj_id"][row, len(used):] == -1).all()
    # loss tokens lie in each segment's response (merged samples' responses also hold the
    # masked observation deltas, so there can be fewer loss tokens than response tokens)
    for row in range(tokens.shape[0]):
        for s in set(np.unique(seg[row])) - {0}:
            where = np.flatnonzero(seg[row] == s)
            prompt = int(data["seg_prompt_len"][row, s - 1])
            mask = data["loss_mask"][row, where]
            assert mask[:prompt].sum() == 0 and 0 < mask[prompt:].sum()
            assert (data["positions"][row, where] == np.arange(len(where))).all()


def test_three_nonfinite_steps_stop_the_run(tmp_path, capsys):
    # An absurd learning rate blows the parameters up after the first update; every later
    # loss is non-finite, its update is skipped, and the third one in a row stops the run.
    out = str(tmp_path / "nan")
    # (The entropy bonus guarantees a gradient even when every episode scores the same.)
    args = [*tiny_overrides("frozen_lake", out, 6), "--config.learning_rate=1e30",
            "--config.warmup_steps=0", "--config.entropy_loss_coef=0.1",
            "--config.save_steps=100", "--config.eval_steps=100"]
    assert train.main(["train", *args]) == train.EXIT_NONFINITE
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: non-finite loss or gradient in 3 consecutive steps")
    records = read_metrics(out)
    assert records[-1]["optim/nonfinite_streak"] == 3
    assert len(records) < 6


def test_checkpointer_refuses_nonfinite_params(tmp_path):
    import jax.numpy as jnp

    from jaxrl_agentic.runtime.checkpoint import Checkpointer, CheckpointError
    from jaxrl_agentic.training.learner import init_train_state
    from jaxrl_agentic.training.learner_config import LearnerConfig

    state = init_train_state({"w": jnp.array([1.0, jnp.nan])}, LearnerConfig())
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="not finite"):
        ckpt.save(1, {"learner": state}, {"step": 1})
    assert ckpt.latest_step() is None



def test_a_checkpoint_of_per_layer_parameters_gets_a_one_line_error(tmp_path):
    """Checkpoints written before the blocks were stored stacked hold layers as a list of
    per-layer dicts; restoring one into a stacked run names the mismatch in one line."""
    import jax.numpy as jnp

    from jaxrl_agentic.runtime.checkpoint import Checkpointer, CheckpointError
    from jaxrl_agentic.training.learner import init_train_state
    from jaxrl_agentic.training.learner_config import LearnerConfig

    old = init_train_state({"layers": [{"w": jnp.ones(3)}, {"w": jnp.ones(3)}]},
                           LearnerConfig())
    new = init_train_state({"layers": {"w": jnp.ones((2, 3))}}, LearnerConfig())
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, {"learner": old}, {"step": 1})
    with pytest.raises(CheckpointError, match="stored stacked") as info:
        ckpt.restore(None, {"learner": new})
    assert "\n" not in str(info.value) and ".layers" in str(info.value)

# ---- episode renders: Python backend, eval episodes ---------------------------------------


def gif_frames(path: str) -> list:
    import numpy as np
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        return [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(image)]


def first_map_frame(seed: int, episode_seed: int, manager: str):
    """The reset state of map `episode_seed` as the rollout keys it, drawn by the env with
    the parameters of `manager`'s episodes (the recipe trains on denser maps)."""
    import jax

    from jaxrl_agentic.envs import make
    from jaxrl_agentic.run_config import build_run_config

    recipe = os.path.join(ROOT, "configs", "frozen_lake.py")
    cfg = build_run_config(train.parse_config(["train", f"--config={recipe}"]))
    split = manager.removesuffix("_env_manager")
    env, params = make(cfg.envs["frozen_lake"].env_type,
                       **cfg.split_env_config(split, "frozen_lake"))
    _, state = env.reset_env(jax.random.fold_in(jax.random.PRNGKey(seed), episode_seed), params)
    return env.render_rgb(state, params)


@pytest.mark.parametrize("backend", ["jax", "python"])
def test_train_cli_renders_the_train_and_an_eval_episode(backend, tmp_path):
    import numpy as np

    out = str(tmp_path / backend)
    args = [*tiny_overrides("frozen_lake", out, steps=1),
            f"--config.custom_envs.frozen_lake.env_backend={backend}"]
    assert train.main(["train", *args]) == 0
    assert "render/skipped" not in read_metrics(out)[-1]
    renders = os.path.join(out, "renders")
    # Step 1 trains on even seeds from cursor 0 (map 0) and evaluates on odd ones (map 1);
    # each GIF starts on its own episode's map (groups.plan_episodes).
    train_frames = gif_frames(os.path.join(renders, "step_1.gif"))
    eval_frames = gif_frames(os.path.join(renders, "eval_step_1.gif"))
    want_train = first_map_frame(0, 0, "train_env_manager")
    want_eval = first_map_frame(0, 1, "val_env_manager")
    assert not np.array_equal(want_train, want_eval)  # the maps tell the episodes apart
    np.testing.assert_array_equal(train_frames[0], want_train)
    np.testing.assert_array_equal(eval_frames[0], want_eval)


def _blind_factory(**config):
    from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash

    class Blind(PythonTextEnv):
        """Rewards any reply; has no picture (PythonTextEnv.render_rgb's None)."""

        max_steps_in_episode = 2

        def reset(self, seed):
            self.turns = 0
            return "say anything"

        def step(self, reply):
            self.turns += 1
            return PyStep(observation="again", reward=1.0, terminated=False,
                          action_is_valid=True, action_is_effective=True, success=False)

        def state_hash(self):
            return text_state_hash(str(self.turns))

    return lambda spec, run_seed: Blind()


def test_python_env_without_a_picture_skips_gifs_with_one_logged_reason(tmp_path):
    from jaxrl_agentic.envs.python_env import register_python_env, registered_python_envs

    if "blind_for_test" not in registered_python_envs():
        register_python_env("blind_for_test", _blind_factory)
    out = str(tmp_path / "blind")
    c = train.parse_config(["train", *tiny_overrides("frozen_lake", out, steps=2),
                            "--config.custom_envs.frozen_lake.env_backend=python",
                            "--config.custom_envs.frozen_lake.env_type=blind_for_test",
                            "--config.eval_steps=1", "--config.eval_before_training=True"])
    lines = []
    train.run(c, log=lines.append)
    records = read_metrics(out)
    # eval_before_training: step 0 is the untrained policy's eval, before any update.
    assert records[0]["step"] == 0 and "eval/success" in records[0]
    assert not any(k.startswith(("actor/", "env/")) for k in records[0])
    assert os.path.exists(os.path.join(out, "transcripts", "eval_step_0.txt"))
    # Per step a train and an eval episode were not drawn: 2, then 4 in all.
    assert [r["render/skipped"] for r in records[1:]] == [2.0, 4.0]
    assert sum("no episode GIFs" in line for line in lines) == 1
    assert not glob.glob(os.path.join(out, "renders", "*.gif"))
