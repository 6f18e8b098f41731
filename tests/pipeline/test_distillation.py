"""On-policy distillation: the advantage formula, the teacher's logprobs against a plain
forward, the one-line errors, and a student that moves towards its teacher."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agentic import train
from jaxrl_agentic.config import ConfigError, default_config, validate
from jaxrl_agentic.data import Sample
from jaxrl_agentic.data.types import trained_loss_mask
from jaxrl_agentic.models.hf_io import load_pretrained, load_tokenizer, save_pretrained
from jaxrl_agentic.models.tiny import tiny_model_config
from jaxrl_agentic.models.transformer import Transformer
from jaxrl_agentic.pipeline.distillation import (
    check_same_tokenizer,
    distill,
    distillation_advantages,
    load_teacher,
)
from jaxrl_agentic.run_config import learner_config
from jaxrl_agentic.run_loading import run_policy
from jaxrl_agentic.runtime.parallel import make_mesh
from jaxrl_agentic.training.teacher import DistillationConfig

TEMPERATURE = 0.7
SEQUENCE_LENGTH = 72


def _trained(sample, sequence_length=SEQUENCE_LENGTH):
    """The tokens distillation reads: generated, within sequence_length."""
    return trained_loss_mask(sample, sequence_length) > 0


def test_the_advantage_is_minus_beta_times_the_logprob_gap_on_generated_tokens():
    """Hand-computed: prompt (2 tokens), three generated tokens, an observation token and a
    post-hoc EOS, both mask 0. β = 2: A = −2·(s − t) = −2·(−1 + 1.5), −2·(−2 + 1), 0."""
    mask = np.array([0, 0, 1, 1, 0, 1, 0], bool)
    task = np.array([0, 0, 0.5, 0.5, 0.3, 0.5, 0.5], np.float32)
    student = np.array([0, 0, -1.0, -2.0, 0, -0.5, 0], np.float32)
    teacher = np.array([-3, -3, -1.5, -1.0, -4, -0.5, -9], np.float32)
    added = distillation_advantages(task, student, teacher, mask, 2.0, "add")
    np.testing.assert_allclose(added, [0, 0, 0.5 - 1.0, 0.5 + 2.0, 0.3, 0.5, 0.5])
    alone = distillation_advantages(task, student, teacher, mask, 2.0, "only")
    np.testing.assert_allclose(alone, [0, 0, -1.0, 2.0, 0, 0, 0])
    # Centred on the batch's mean gap s − t, here (0.5 − 1 + 0) / 3 = −1/6: A = −2·(gap + 1/6).
    centred = distillation_advantages(task, student, teacher, mask, 2.0, "only", -1 / 6)
    np.testing.assert_allclose(centred, [0, 0, -4 / 3, 5 / 3, 0, -1 / 3, 0], rtol=1e-6)


# ---- the teacher against a plain forward --------------------------------------------------------
@pytest.fixture(scope="module")
def student_tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def narrow_teacher_dir(tiny_model_dir, student_tokenizer, tmp_path_factory):
    """A teacher of another architecture than the tiny student (2 layers of width 64, an
    untied head) with the student's tokenizer."""
    vocab = load_pretrained(tiny_model_dir)[0].cfg.vocab_size
    cfg = tiny_model_config(vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            tie_word_embeddings=False)
    out = str(tmp_path_factory.mktemp("narrow_teacher"))
    save_pretrained(Transformer(cfg, rngs=nnx.Rngs(3)), student_tokenizer, out)
    return out


def _learner_config():
    c = default_config()
    c.generation.temperature = TEMPERATURE
    c.max_input_length, c.sequence_length, c.micro_batch_max_tokens = 8, SEQUENCE_LENGTH, 256
    c.custom_envs.frozen_lake.max_tokens_per_step = 64
    return learner_config(c)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("center", [False, True])
def test_the_policy_gradient_of_the_advantage_is_beta_times_the_reverse_kl_gradient(impl,
                                                                                   center):
    """Brute force over every token of a 7-token softmax policy π_s = softmax(θ): each token
    a is one sample, weighted by π_s(a) (the exact expectation a sampler estimates), its
    advantage from `distillation_advantages`, its loss the trainer's PPO loss at ratio 1.
    Then  ∇_θ Σ_a π_s(a)·pg(a) = −Σ_a π_s(a)·A_a·∇log π_s(a) = β·∇_θ KL(π_s ‖ π_T), the
    exact gradient of the reverse KL, with or without the baseline (Σ_a π_s ∇log π_s = 0).
    A sign slip, the forward KL, or a bootstrapped sum would each miss it."""
    from pallas_kernels.ppo_loss import masked_ppo_loss

    rng = np.random.default_rng(3)
    theta = jnp.asarray(rng.normal(size=7), jnp.float32)
    teacher_lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=7) * 2, jnp.float32))
    beta = 0.7
    student_lp = np.asarray(jax.nn.log_softmax(theta))
    baseline = float(np.exp(student_lp) @ (student_lp - teacher_lp)) if center else 0.0
    adv = distillation_advantages(np.zeros(7), student_lp, np.asarray(teacher_lp),
                                  np.ones(7, bool), beta, "only", baseline)

    def expected_pg(t):
        lp = jax.nn.log_softmax(t)
        weights = jax.lax.stop_gradient(jnp.exp(lp))  # π_s(a): the sampling distribution
        return masked_ppo_loss(lp, jax.lax.stop_gradient(lp), jnp.asarray(adv), weights,
                               impl=impl, interpret=True).pg_loss

    def reverse_kl(t):
        lp = jax.nn.log_softmax(t)
        return jnp.sum(jnp.exp(lp) * (lp - teacher_lp))

    np.testing.assert_allclose(jax.grad(expected_pg)(theta), beta * jax.grad(reverse_kl)(theta),
                               rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def teacher(narrow_teacher_dir, student_tokenizer):
    return load_teacher(DistillationConfig(teacher=narrow_teacher_dir), _learner_config(),
                        make_mesh(), student_tokenizer, log=lambda _: None)


def _samples(seed=0):
    """Five samples: prompts, generated tokens, an observation gap and a post-hoc EOS with
    mask 0, one sample longer than SEQUENCE_LENGTH (its tail is not trained)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, length in enumerate((30, 41, 17, 80, 25)):
        mask = np.zeros(length, np.float32)
        prompt = 6 + i
        mask[prompt:length - 1] = 1
        mask[prompt + 3:prompt + 5] = 0  # an observation between two replies
        out.append(Sample(tokens=rng.integers(0, 500, length), loss_mask=mask,
                          old_logprobs=np.where(mask > 0, rng.uniform(-8, -0.1, length), 0),
                          advantages=np.where(mask > 0, rng.normal(size=length), 0),
                          prompt_len=prompt, traj_id=i))
    return out


def _plain_forward(model_dir, sample):
    """(log π_T(token_t | tokens < t) at TEMPERATURE, argmax at t − 1 ≠ token_t) from the
    model's full logits of the sample alone (no packing, no kernel)."""
    model = load_pretrained(model_dir)[0]
    tokens = sample.tokens[None]
    logits = model(tokens, np.arange(len(sample))[None], np.ones_like(tokens))[0]
    logp = np.asarray(jax.nn.log_softmax(logits / TEMPERATURE, axis=-1), np.float64)
    lp = np.zeros(len(sample))
    lp[1:] = logp[np.arange(len(sample) - 1), sample.tokens[1:]]
    other = np.zeros(len(sample), bool)
    other[1:] = np.argmax(np.asarray(logits), axis=-1)[:-1] != sample.tokens[1:]
    return lp, other


def test_teacher_logprobs_equal_a_plain_forward_in_packed_rows(teacher, narrow_teacher_dir):
    samples = _samples()
    packed = _learner_config().packing.pack(samples)
    assert ((packed.sample_index >= 0).sum(axis=1) > 1).any()  # rows hold several samples
    assert teacher.model_config.num_hidden_layers == 2  # not the student's architecture
    judged = teacher.judge(samples)
    for s, (lp, other) in zip(samples, judged, strict=True):
        trained = _trained(s)
        ref_lp, ref_other = _plain_forward(narrow_teacher_dir, s)
        np.testing.assert_allclose(lp[trained], ref_lp[trained], atol=2e-5)
        assert (other[trained] == ref_other[trained]).all()
        assert not lp[SEQUENCE_LENGTH:].any()  # beyond sequence_length: not computed
    assert sum(o[s.loss_mask > 0].sum() for s, (_, o) in zip(samples, judged, strict=True))


def test_distill_applies_the_formula_and_reports_its_metrics(teacher, narrow_teacher_dir):
    samples = _samples(seed=1)
    refs = [_plain_forward(narrow_teacher_dir, s) for s in samples]
    config = DistillationConfig(teacher="narrow", coef=0.5, mode="add")
    out, metrics = distill(samples, teacher, config, SEQUENCE_LENGTH)
    gaps, teacher_lps, others = [], [], []
    for s, d, (ref_lp, ref_other) in zip(samples, out, refs, strict=True):
        trained = _trained(s)
        expected = np.where(trained, s.advantages - 0.5 * (s.old_logprobs - ref_lp),
                            s.advantages)
        np.testing.assert_allclose(d.advantages, expected, atol=2e-5)
        gaps.append(s.old_logprobs[trained] - ref_lp[trained])
        teacher_lps.append(ref_lp[trained])
        others.append(ref_other[trained])
    assert metrics["distill/tokens"] == sum(len(g) for g in gaps)
    assert metrics["distill/reverse_kl"] == pytest.approx(np.concatenate(gaps).mean(), abs=1e-5)
    assert metrics["distill/teacher_logprob"] == pytest.approx(
        np.concatenate(teacher_lps).mean(), abs=1e-5)
    assert metrics["distill/teacher_prefers_other"] == pytest.approx(
        np.concatenate(others).mean())
    mean_gap = np.concatenate(gaps).mean()
    only, _ = distill(samples, teacher, dataclasses.replace(config, mode="only", center=True),
                      SEQUENCE_LENGTH)
    for s, d, (ref_lp, _) in zip(samples, only, refs, strict=True):
        trained = _trained(s)
        np.testing.assert_allclose(d.advantages[trained], -0.5 * (
            s.old_logprobs - ref_lp - mean_gap)[trained], atol=2e-5)
        assert not d.advantages[~trained].any()


# ---- the teacher's whole distribution in the learner's loss ---------------------------------
def _dense_learner(tiny_model_dir, teacher, kind="forward_kl", **fields):
    from jaxrl_agentic.training.learner import Learner

    graphdef, params = nnx.split(load_pretrained(tiny_model_dir)[0])
    config = dataclasses.replace(_learner_config(), distill_loss=kind, **fields)
    return Learner(graphdef, params, config, make_mesh(), teacher=teacher)


def _still(samples):
    """The samples with no task advantage: the update's only signal is the teacher's."""
    return [dataclasses.replace(s, advantages=np.zeros_like(s.advantages)) for s in samples]


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
def test_the_dense_loss_is_the_mean_full_vocabulary_kl_of_two_plain_forwards(
        kind, tiny_model_dir, teacher, narrow_teacher_dir):
    """`actor/teacher` of one update (the loss before it moves the student) against the mean
    over trained tokens of Σ_v p(v)·log(p(v)/q(v)) from each model's full logits of each
    sample alone: packing, loss slots, the shift and truncation at sequence_length must all
    line up for the two to agree. Then the same samples again: the divergence falls."""
    samples = _still(_samples(seed=2))
    learner = _dense_learner(tiny_model_dir, teacher, kind, learning_rate=1e-3)
    student, narrow = load_pretrained(tiny_model_dir)[0], load_pretrained(narrow_teacher_dir)[0]
    def logp(model, s):
        tokens = s.tokens[None]
        logits = model(tokens, np.arange(len(s))[None], np.ones_like(tokens))[0] / TEMPERATURE
        return np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)[:-1]

    per_token = []
    for s in samples:
        lq, lt = logp(student, s), logp(narrow, s)
        p, a, b = (lt, lt, lq) if kind == "forward_kl" else (lq, lq, lt)
        per_token.append((np.exp(p) * (a - b)).sum(-1)[_trained(s)[1:]])
    first = learner.step(samples, [1e-3])
    assert first["actor/teacher"] == pytest.approx(np.concatenate(per_token).mean(), rel=1e-4)
    later = [learner.step(samples, [1e-3])["actor/teacher"] for _ in range(3)]
    assert later[-1] < 0.7 * first["actor/teacher"], (first["actor/teacher"], later)


def test_a_student_that_is_its_own_teacher_has_no_dense_loss_and_no_gradient(tiny_model_dir):
    """Teacher = the student's own weights (another copy, its own program): D_t = 0 on every
    token, so with no task advantage and no KL the update's gradient is 0."""
    from jaxrl_agentic.training.teacher import Teacher

    graphdef, params = nnx.split(load_pretrained(tiny_model_dir)[0])
    itself = Teacher(graphdef, params, "float32", _learner_config(), make_mesh())
    metrics = _dense_learner(tiny_model_dir, itself).step(_still(_samples()), [1e-2])
    assert metrics["actor/teacher"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["actor/grad_norm"] < 1e-5


def test_a_divergence_without_a_teacher_is_an_error_naming_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match="distill_loss: a divergence needs a teacher"):
        _dense_learner(tiny_model_dir, None)


# ---- one-line errors --------------------------------------------------------------------------
def test_a_teacher_with_another_tokenizer_is_one_config_error(tiny_tools_dir, student_tokenizer):
    with pytest.raises(ConfigError) as e:
        check_same_tokenizer(load_tokenizer(tiny_tools_dir), student_tokenizer, "tiny-tools")
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("config.teacher.pretrain: 'tiny-tools' has another "
                                   "tokenizer than the student (")
    check_same_tokenizer(student_tokenizer, student_tokenizer, "tiny")  # the same: no error


@pytest.mark.parametrize("field, value, fragment", [
    ("distill_mode", "kl", "config.distill_mode: 'kl' is not allowed; choose one of add, only"),
    ("distill_coef", -1.0, "config.distill_coef: must be a number >= 0"),
    ("distill_loss", "jsd", "config.distill_loss: 'jsd' is not allowed; choose one of sampled, "
     "forward_kl, reverse_kl"),
    ("teacher.dtype", "fp8", "config.teacher.dtype: 'fp8' is not allowed"),
    ("teacher.temperature", 1.0, "config.teacher.temperature: unknown field"),
    ("teacher.pretrain", "/nonexistent/teacher",
     "config.teacher.pretrain: model directory not found: /nonexistent/teacher (a Hugging "
     "Face directory"),
])
def test_bad_distillation_fields_are_config_errors_naming_the_field(field, value, fragment):
    c = default_config()
    parent, _, name = field.rpartition(".")
    (c[parent] if parent else c)[name] = value
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert str(e.value).startswith(fragment) and "\n" not in str(e.value)


def test_a_baseline_switch_that_is_not_a_bool_names_its_field():
    with pytest.raises(ValueError, match="^distill_center: must be True or False, got 'yes'$"):
        DistillationConfig(center="yes")


def test_a_missing_teacher_stops_the_run_with_one_error_line(tmp_path, capsys):
    code = train.main(["train", "--config=configs/frozen_lake.py",
                       f"--config.output_dir={tmp_path}",
                       f"--config.teacher.pretrain={tmp_path}/no_teacher"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: config.teacher.pretrain: model directory not found: "
                   f"{tmp_path}/no_teacher (a Hugging Face directory, a .gguf file, a "
                   "packaged model's name, 'tiny', 'tiny-tools', or a training run's output "
                   "directory)"]


# ---- end to end ---------------------------------------------------------------------------------
def _tiny_run(**fields):
    """FrozenLake, one turn of up to 4 generated tokens (the action, then the end of the
    reply), 16 episodes a step, the tags as context (`configs/frozen_lake.py`'s layout)."""
    c = default_config()
    c.reply_prefix, c.reply_suffix = "<answer>", "</answer>"
    c.train_env_manager.num_env_groups, c.train_env_manager.group_size = 8, 2
    c.val_env_manager.num_env_groups = 2
    c.mini_batch_size = 16
    c.custom_envs.frozen_lake.max_turns = 1
    c.custom_envs.frozen_lake.max_tokens_per_step = 1
    c.max_input_length, c.sequence_length, c.micro_batch_max_tokens = 448, 512, 1024
    c.learning_rate = 1e-3
    c.format_warmup.steps, c.format_warmup.episodes_per_step = 20, 8
    c.format_warmup.max_turns = 1
    for key, value in fields.items():
        c[key] = value
    return c


def test_a_student_distilled_alone_moves_towards_a_teacher_that_always_says_right():
    """Student: the tiny model after the format warm-up (random valid actions: it replies
    each of the four about equally). Teacher: the same warm-up on the one reply
    `<answer>Right</answer>`. Distillation alone (rewards played and logged, not trained
    on) for 6 steps: the reverse KL on the student's own tokens falls (seed 0: 6.6, 5.0,
    3.8, 2.7, 0.7, 1.1; seeds 1 and 2 fall as far within 8 steps), and the teacher's argmax
    agrees with more of them (0.81 → 0.38 of the tokens it would not have chosen). Tree
    packing computes each row's shared instructions once (exact: the same figures), which
    makes a step of these 1-token replies ~5× fewer tokens."""
    from jaxrl_agentic.pipeline import Pipeline
    from jaxrl_agentic.run_config import ModelSettings
    from jaxrl_agentic.warmup import warmed_model_dir

    right = _tiny_run(share_group_prefix=True)
    right.format_warmup.replies = ("<answer>Right</answer>",)
    teacher_dir = warmed_model_dir(ModelSettings().directory(), right, log=lambda _: None)
    c = _tiny_run(distill_mode="only", learning_rate=2e-3, share_group_prefix=True)
    c.teacher.pretrain = teacher_dir
    validate(c)
    pipeline = Pipeline(c, log=lambda _: None)
    history = [pipeline.train_step()[0] for _ in range(6)]
    kl = [m["distill/reverse_kl"] for m in history]
    other = [m["distill/teacher_prefers_other"] for m in history]
    assert all("env/success" in m and m["distill/tokens"] == 16 for m in history)
    assert np.mean(kl[-2:]) < np.mean(kl[:2]) / 3, kl
    assert np.mean(other[-2:]) < np.mean(other[:2]) - 0.2, other


@pytest.fixture(scope="module")
def lora_step_run():
    """Two steps of a LoRA student on step-wise samples, "add", its teacher the model its
    adapters start on: (pipeline, first step's metrics and samples, second's)."""
    from jaxrl_agentic.pipeline import Pipeline

    c = _tiny_run(sample_mode="step", lora_rank=4, learning_rate=1e-2)
    c.format_warmup.steps = 0
    c.train_env_manager.num_env_groups = 2
    c.mini_batch_size = 8
    c.custom_envs.frozen_lake.max_turns = 2
    c.custom_envs.frozen_lake.max_tokens_per_step = 3
    c.teacher.pretrain = "tiny"
    validate(c)
    pipeline = Pipeline(c, log=lambda _: None)
    first, trajs, samples = pipeline.train_step()
    assert len(samples) > len(trajs)  # one sample per turn
    second, _, second_samples = pipeline.train_step()
    return pipeline, (first, samples), (second, second_samples)


def test_step_samples_of_a_lora_student_are_judged_by_its_own_base(lora_step_run):
    """Before the first update the student is its base, the teacher: the reverse KL is 0
    on every generated token (the sampler's logprobs against the teacher's program);
    after it, the adapters have moved the student away."""
    pipeline, (first, samples), (second, _) = lora_step_run
    assert first["distill/tokens"] == sum(_trained(s, pipeline.sequence_length)
                                          .sum() for s in samples) > 0
    assert abs(first["distill/reverse_kl"]) < 1e-5
    assert abs(second["distill/reverse_kl"]) > 1e-3


def test_a_training_run_is_a_teacher_with_its_latest_policy(lora_step_run, tmp_path,
                                                            student_tokenizer):
    """The run's output directory (config.json, checkpoints/) as `teacher.pretrain`: the
    teacher is the policy of its latest checkpoint, LoRA adapters merged, so its logprobs
    are the run's learner's own. The run's config.json is one written before distillation
    existed (no `teacher`, `distill_*` fields): those take their defaults."""
    import json

    from jaxrl_agentic.runtime.checkpoint import Checkpointer

    pipeline, _, (_, samples) = lora_step_run
    older = {k: v for k, v in json.loads(pipeline.config.source_json).items()
             if k != "teacher" and not k.startswith("distill_")}
    (tmp_path / "config.json").write_text(json.dumps(older))
    Checkpointer(str(tmp_path / "checkpoints")).save(2, pipeline.train_states(),
                                                      pipeline.host_state())
    config = DistillationConfig(teacher=str(tmp_path))
    with pytest.raises(ConfigError, match="is a training run; a Pipeline built in code"):
        load_teacher(config, pipeline.learner_cfg, pipeline.mesh, student_tokenizer)
    teacher = load_teacher(config, pipeline.learner_cfg, pipeline.mesh, student_tokenizer,
                           run_policy=run_policy, log=lambda _: None)
    learner = pipeline.learner.sample_logprobs(samples)
    for s, (lp, _), own in zip(samples, teacher.judge(samples), learner, strict=True):
        trained = _trained(s, pipeline.sequence_length)
        np.testing.assert_allclose(lp[trained], own[trained], atol=1e-4)
    base = [lp for lp, _ in pipeline.teacher.judge(samples)]  # the run's own teacher, "tiny"
    assert max(np.abs(b - o).max() for b, o in zip(base, learner, strict=True)) > 1e-3

