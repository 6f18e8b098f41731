"""``python -m jaxrl_agentic.compile_tpu``: a run's programs compiled for a topology.

Without libtpu (the test extra does not install it) the command's whole path runs on
``--topology cpu:8`` in a subprocess, and its refusals are checked (no libtpu: exit 2; a
train state that cannot fit: exit 1, before any compile). With libtpu (an environment of
its own, docs/tpu.md), the tiny model's programs are compiled for the four chips of a
v5e:2x2 with ``mesh.fsdp=4`` and checked against the partition rules: each chip holds a
quarter of every matrix and all of the norms and biases the rules replicate, and the
update step all-gathers the sharded weights and reduce-scatters their gradients.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jaxrl_agentic.models.hf_io import read_model_config
from jaxrl_agentic.models.tiny import default_tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _tiny_recipe_model():
    """configs/frozen_lake.py's model: the tiny one, its head untied."""
    return read_model_config(default_tiny_model_dir(), untie_word_embeddings=True)


def _command(*args, env=None):
    env = {**os.environ, **(env or {})}
    env.pop("XLA_FLAGS", None)  # the command sets the host device count itself
    return subprocess.run([sys.executable, "-m", "jaxrl_agentic.compile_tpu", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _per_chip_param_bytes(cfg, fsdp: int) -> int:
    """By hand, from the rules in runtime/parallel.py: every matrix is split over fsdp on
    its hidden dimension (D = 128 divides by fsdp); norms and the q/k/v biases (which
    follow the tensor axis only) are whole on each chip. fp32; the recipe unties the head."""
    d, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, \
        cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    head = 0 if cfg.tie_word_embeddings else d * v
    matrices = v * d + head + layers * (d * q + 2 * d * kv + q * d + 3 * d * f)
    replicated = layers * (2 * d + q + 2 * kv) + d
    return 4 * (matrices // fsdp + replicated)


@pytest.mark.skipif(HAS_LIBTPU, reason="libtpu is installed here")
def test_without_libtpu_says_how_to_install_it():
    out = _command("--config", "configs/frozen_lake.py", "--topology", "v5e:2x2")
    assert out.returncode == 2
    errors = _errors(out.stderr)
    assert len(errors) == 1 and out.stdout == ""
    assert "libtpu" in errors[0] and "venv" in errors[0] and "--topology cpu:N" in errors[0]


def test_cpu_topology_prints_one_json_line_per_program():
    """Logprobs on 8 host devices, fsdp 2: one program line, then the total line."""
    out = _command("--config", "configs/frozen_lake.py", "--topology", "cpu:8",
                   "--programs", "logprobs", "--config.mesh.fsdp=2")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["program"] for line in lines] == ["logprobs", "total"]
    program, total = lines
    # Rows: one step's samples (one per episode) rounded up to a power of two.
    assert (program["rows"], program["row_len"]) == (64, 512)
    for key in ("argument_bytes", "output_bytes", "temp_bytes", "generated_code_bytes"):
        assert program[key] >= 0
    assert program["output_bytes"] == 64 * 512 * 4 // 8  # fp32 logprobs, rows over 8
    assert set(program["collectives"]) >= {"all-gather", "all-reduce", "reduce-scatter"}
    assert total["mesh"] == {"data": 4, "fsdp": 2, "tensor": 1, "context": 1}
    assert total["chips"] == 8 and total["fits"] is True
    cfg = _tiny_recipe_model()
    assert total["param_bytes"] == _per_chip_param_bytes(cfg, 2)
    assert total["param_global_bytes"] == 4 * cfg.num_params()
    assert sum(total["plan_bytes"].values()) == total["plan_total_bytes"]


def test_a_state_that_cannot_fit_fails_before_compiling():
    """Qwen2.5-7B (a known shape, not on disk) replicated over 8 host devices, each with an
    eighth of this machine's RAM: its fp32 state alone is ~100 GB a device."""
    out = _command("--config", "configs/qwen2_5_0_5b_frozen_lake.py", "--topology", "cpu:8",
                   "--config.pretrain=/models/Qwen2.5-7B-Instruct")
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stdout == ""
    errors = _errors(out.stderr)
    assert len(errors) == 1 and "mesh.fsdp" in errors[0] and "train state" in errors[0]


def test_an_unknown_program_is_one_line():
    out = _command("--config", "configs/frozen_lake.py", "--topology", "cpu:8",
                   "--programs", "update")
    assert out.returncode == 2
    assert _errors(out.stderr) == [
        "error: --programs: unknown program 'update'; choose from update_step, logprobs, "
        "ref_logprobs, teacher_logprobs, critic_update, critic_values, weight_handover, "
        "sampler_prefill, sampler_decode, sampler_decode_chunk"]


@pytest.mark.parametrize("loss", ["sampled", "forward_kl"])
def test_a_teacher_is_compiled_where_the_run_reads_it(loss):
    """The distillation recipe with the tiny model as its teacher: the teacher's logprob
    program is built from its config.json and its weights count as resident; with a dense
    loss the update step also takes them as a fourth argument and traces with its forward,
    with the sampled estimator it does not."""
    import jax

    from jaxrl_agentic.pipeline.aot_programs import run_programs
    from jaxrl_agentic.run_config import build_run_config
    from jaxrl_agentic.runtime.aot import shard_bytes
    from jaxrl_agentic.train import parse_config

    c = parse_config(["compile_tpu", "--config", "configs/tiny_distill_frozen_lake.py",
                      "--config.teacher.pretrain=tiny", f"--config.distill_loss={loss}"])
    run = run_programs(build_run_config(c), jax.devices()[:1], row_lens="longest",
                       sampler=False)
    by_name = {p.name: p for p in run.programs}
    assert set(by_name) == {"update_step", "logprobs", "teacher_logprobs"}
    update, teacher = by_name["update_step"], by_name["teacher_logprobs"]
    assert teacher.resident == shard_bytes(teacher.args[0]) > 0
    dense = loss != "sampled"
    assert len(update.args) == 3 + dense
    own = shard_bytes(update.args[0])  # the train state
    assert update.resident == run.state_bytes == own + teacher.resident
    if dense:
        update.fn.lower(*update.args)  # traces: the teacher's forward inside the update


def test_a_critic_and_continuous_batching_add_their_programs():
    """GAE's critic adds its update step and values program (its own train state resident
    beside the policy's); continuous batching adds the slot decoder's chunk program over
    the whole pool. The chunk program compiles and returns `decode_chunk_tokens` tokens for
    every slot; the critic's programs lower with the batches built for them."""
    import jax

    from jaxrl_agentic.pipeline.aot_programs import run_programs
    from jaxrl_agentic.run_config import build_run_config
    from jaxrl_agentic.runtime.aot import shard_bytes
    from jaxrl_agentic.train import parse_config

    c = parse_config(["compile_tpu", "--config", "configs/frozen_lake.py",
                      "--config.adv_estimator=gae", "--config.rollout_batching=continuous"])
    cfg = build_run_config(c)
    run = run_programs(cfg, jax.devices()[:1], row_lens="longest")
    by_name = {p.name: p for p in run.programs}
    assert list(by_name) == ["update_step", "logprobs", "ref_logprobs", "critic_update",
                             "critic_values", "sampler_prefill", "sampler_decode",
                             "sampler_decode_chunk"]
    critic = by_name["critic_update"]
    assert critic.resident == shard_bytes(critic.args[0]) > 0
    assert run.state_bytes == by_name["update_step"].resident + critic.resident
    for name in ("critic_update", "critic_values"):
        by_name[name].fn.lower(*by_name[name].args)
    chunk = by_name["sampler_decode_chunk"]
    slots = cfg.train.manager.num_episodes
    assert chunk.shape["rows"] == slots and chunk.shape["chunk"] == cfg.rollout.decode_chunk_tokens
    compiled = chunk.fn.trace(*chunk.args).lower().compile()
    tokens = compiled.out_info[1]
    assert tokens.shape == (slots, cfg.rollout.decode_chunk_tokens)


# ---- with libtpu ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tpu_runs():
    """The tiny recipe's update step compiled for a v5e:2x2, fsdp=4, data-only and with its
    rows split over a context axis of 4, and for the eight chips of a v5e:2x4 at fsdp=8;
    the distillation recipe's with a dense loss (the tiny model as its teacher), fsdp=4."""
    if not HAS_LIBTPU:
        pytest.skip("no TPU compiler here (libtpu is not installed)")
    import jax

    from jaxrl_agentic.pipeline.aot_programs import run_programs
    from jaxrl_agentic.run_config import build_run_config
    from jaxrl_agentic.runtime import aot
    from jaxrl_agentic.train import parse_config

    option = "jax_persistent_cache_min_compile_time_secs"  # TPU executables: not cached
    before = getattr(jax.config, option)
    jax.config.update(option, float("inf"))
    topologies = {"v5e:2x2": aot.topology("v5e:2x2"), "v5e:2x4": aot.topology("v5e:2x4")}
    runs = {}
    dense = ["--config.teacher.pretrain=tiny", "--config.distill_loss=forward_kl"]
    context = ["--config.mesh.context=4", "--config.mesh.data=1"]
    for name, recipe, fsdp, more in (("fsdp", "frozen_lake", 4, []), ("data", "frozen_lake", 1, []),
                                     ("context", "frozen_lake", 1, context),
                                     ("fsdp8", "frozen_lake", 8, []),
                                     ("teacher", "tiny_distill_frozen_lake", 4, dense)):
        topology = topologies["v5e:2x4" if fsdp == 8 else "v5e:2x2"]
        with aot.traced_for("tpu"):
            c = parse_config(["compile_tpu", "--config", f"configs/{recipe}.py",
                              f"--config.mesh.fsdp={fsdp}", *more])
            run = run_programs(build_run_config(c), topology.devices, row_lens="longest",
                               sampler=False)
        update = run.programs[0]
        compiled = aot.compile_abstract(update.fn, *update.args, platform="tpu")
        runs[name] = (run, compiled)
    yield runs
    jax.config.update(option, before)


def test_each_chip_holds_its_share_of_the_parameters(tpu_runs):
    """On four chips and on eight: nothing the rules shard is replicated; the compiled
    update step's arguments hold that share and the optimizer's moments beside it."""
    from jaxrl_agentic.runtime.aot import program_figures

    for name, fsdp in (("fsdp", 4), ("fsdp8", 8)):
        run, compiled = tpu_runs[name]
        assert dict(run.mesh.shape) == {"data": 1, "fsdp": fsdp, "tensor": 1, "context": 1}
        own = _per_chip_param_bytes(_tiny_recipe_model(), fsdp)
        assert run.param_bytes == own
        # parameters, reference and both moments, all fp32 and sharded alike, + the batch
        assert program_figures(compiled)["argument_bytes"] >= 4 * own
    data_run, _ = tpu_runs["data"]
    assert data_run.param_bytes == data_run.param_global_bytes  # replicated over data


def test_update_step_gathers_weights_and_scatters_gradients(tpu_runs):
    """fsdp: weights all-gathered for the matmuls, gradients reduce-scattered back to their
    shards; data-only: gradients all-reduced, nothing reduce-scattered; both hold the
    Mosaic (Pallas) kernels, not their interpreted form."""
    from jaxrl_agentic.runtime.aot import collective_counts

    _, fsdp = tpu_runs["fsdp"]
    _, data = tpu_runs["data"]
    sharded, replicated = (collective_counts(c.as_text()) for c in (fsdp, data))
    assert sharded["reduce-scatter"] > 0 and replicated["reduce-scatter"] == 0
    assert sharded["all-gather"] > replicated["all-gather"]
    assert replicated["all-reduce"] > 0
    for compiled in (fsdp, data):
        assert "tpu_custom_call" in compiled.as_text()


def test_a_dense_teacher_is_sharded_like_the_policy_inside_the_update(tpu_runs):
    """The teacher the update step reads (its fourth argument) holds a quarter of each matrix
    a chip, as the policy does; the compiled step gathers its weights too, with the kernels."""
    from jaxrl_agentic.runtime.aot import collective_counts, shard_bytes

    run, compiled = tpu_runs["teacher"]
    update = run.programs[0]
    teacher = read_model_config(default_tiny_model_dir())  # "tiny": the head tied
    assert shard_bytes(update.args[3]) == _per_chip_param_bytes(teacher, 4)
    _, plain = tpu_runs["fsdp"]
    counts, without = (collective_counts(c.as_text()) for c in (compiled, plain))
    assert counts["all-gather"] > without["all-gather"]
    assert "tpu_custom_call" in compiled.as_text()


def test_rows_split_over_a_context_axis_compile_for_tpu(tpu_runs):
    """Context parallelism on four v5e chips: the keys and values all-gathered per layer and
    their gradients reduce-scattered; a chip's temporaries are those of the data-parallel
    step, which gives each chip as many tokens (a quarter of the rows, not of each row)."""
    from jaxrl_agentic.runtime.aot import collective_counts, program_figures

    run, compiled = tpu_runs["context"]
    _, data = tpu_runs["data"]
    assert dict(run.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1, "context": 4}
    counts = collective_counts(compiled.as_text())
    assert counts["all-gather"] > 0 and counts["reduce-scatter"] > 0
    split, whole = (program_figures(c)["temp_bytes"] for c in (compiled, data))
    assert split < 1.1 * whole


def test_a_critic_and_the_decode_chunk_compile_for_tpu():
    """GAE with continuous batching on a v5e:2x2 at fsdp=4: the critic's update step holds a
    quarter of its backbone's matrices a chip (its train state: the fp32 params and two
    moments of the value model, whose head is whole on each chip) and reduce-scatters their
    gradients; the slot decoder's chunk program compiles over the whole pool."""
    if not HAS_LIBTPU:
        pytest.skip("no TPU compiler here (libtpu is not installed)")
    import jax

    from jaxrl_agentic.pipeline.aot_programs import run_programs
    from jaxrl_agentic.run_config import build_run_config
    from jaxrl_agentic.runtime import aot
    from jaxrl_agentic.train import parse_config

    topology = aot.topology("v5e:2x2")
    with aot.traced_for("tpu"):
        c = parse_config(["compile_tpu", "--config", "configs/frozen_lake.py",
                          "--config.mesh.fsdp=4", "--config.adv_estimator=gae",
                          "--config.rollout_batching=continuous"])
        run = run_programs(build_run_config(c), topology.devices, row_lens="longest")
    by_name = {p.name: p for p in run.programs}
    critic, chunk = by_name["critic_update"], by_name["sampler_decode_chunk"]
    head = _tiny_recipe_model().hidden_size + 1  # the value head's kernel and bias, fp32
    own = _per_chip_param_bytes(_tiny_recipe_model(), 4)
    assert aot.shard_bytes(critic.args[0].params) == own + 4 * head
    option = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, option)
    jax.config.update(option, float("inf"))  # TPU executables: not cached
    try:
        compiled = {p.name: aot.compile_abstract(p.fn, *p.args, platform="tpu")
                    for p in (critic, chunk)}
    finally:
        jax.config.update(option, before)
    counts = aot.collective_counts(compiled["critic_update"].as_text())
    assert counts["reduce-scatter"] > 0 and counts["all-gather"] > 0
    tokens = compiled["sampler_decode_chunk"].out_info[1]
    assert tokens.shape == (chunk.shape["rows"], chunk.shape["chunk"])


def test_over_several_hosts_each_samples_from_a_replica_the_handover_gathers():
    """The tiny recipe at fsdp=8 on a v5p:2x2x2 (two hosts of four chips): the weight
    hand-over all-gathers the policy, every chip's output the whole of it; the sampler's
    prefill runs on one host's four chips from that replica at half the episodes; the
    replica is resident beside the train state, and the memory plan counts it."""
    if not HAS_LIBTPU:
        pytest.skip("no TPU compiler here (libtpu is not installed)")
    import jax

    from jaxrl_agentic.pipeline.aot_programs import run_programs
    from jaxrl_agentic.pipeline.run_plan import run_memory_plan
    from jaxrl_agentic.run_config import build_run_config
    from jaxrl_agentic.runtime import aot
    from jaxrl_agentic.train import parse_config

    topology = aot.topology("v5p:2x2x2")
    with aot.traced_for("tpu"):
        c = parse_config(["compile_tpu", "--config", "configs/frozen_lake.py",
                          "--config.mesh.fsdp=8", "--config.mesh.data=1"])
        cfg = build_run_config(c)
        run = run_programs(cfg, topology.devices, row_lens="longest")
        alone = run_programs(cfg, topology.devices, row_lens="longest", sampler=False)
    by_name = {p.name: p for p in run.programs}
    handover, prefill = by_name["weight_handover"], by_name["sampler_prefill"]
    whole = run.param_global_bytes
    assert handover.shape["hosts"] == 2 and handover.shape["params_bytes"] == whole
    assert run.param_bytes == _per_chip_param_bytes(_tiny_recipe_model(), 8)
    assert run.state_bytes == alone.state_bytes  # the sampler's programs add no state
    assert aot.shard_bytes(prefill.args[0]) == whole  # the replica: whole on each chip
    assert len(prefill.args[0]["embed"]["embedding"].sharding.device_set) == 4
    assert prefill.shape["rows"] == cfg.train.manager.num_episodes // 2
    plan = dict(run_memory_plan(cfg, run.model, run.mesh, topology.hbm_bytes,
                                platform="tpu").items)
    assert plan["sampler params"] == whole
    option = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, option)
    jax.config.update(option, float("inf"))  # TPU executables: not cached
    try:
        compiled = aot.compile_abstract(handover.fn, *handover.args, platform="tpu")
    finally:
        jax.config.update(option, before)
    figures = aot.program_figures(compiled)
    # the whole policy on each chip (+ XLA:TPU's tile padding of the small vectors: 0.06%)
    assert whole <= figures["output_bytes"] <= 1.01 * whole
    assert aot.collective_counts(compiled.as_text())["all-gather"] > 0
