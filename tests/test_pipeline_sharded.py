"""Whole pipeline steps (rollout + train) on a device mesh and across real processes give
the single-device run's metrics and parameters.

Both need a fresh JAX process (8 fake CPU devices, or `jax.distributed`), so they run in
subprocesses; the comparisons are made here. Layout metrics that depend on how many ways
the batch is split (padding rows added so every shard gets the same number) are the only
ones allowed to differ.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.conftest import LAYOUT_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Padding rows for the shards change these by design; nothing else may differ.
LAYOUT_KEYS = {"tokens/computed", "batch/num_micro_batches", "tokens/efficiency"}
# Metrics and parameters a layout computes in another summation order. float32 rounds at
# u = 2^-24 ≈ 6e-8 per operation; a sum's error grows with the depth of its reduction
# tree, ~10 levels over the ≤ 1024 tokens of a micro-batch plus the ~7 of a 128-wide dot,
# so ~20 u ≈ 1.2e-6 relative is what reordering moves a loss, a norm or a well-determined
# update. The bound is 8× that: 1e-5 (the observed spread over the four layouts, on Intel
# and AMD CPUs, is ≤ 5e-7 for metrics and ≤ 3e-7 for parameters outside the set below).
ATOL = 1e-5
# Adam divides each gradient by its own magnitude: an element whose gradient is ~0 moves by
# ±lr whatever its sign, and rounding picks the sign. Such an element is rounding-decided
# when its |g| at a step is below ROUNDING_DECIDED × the largest |g| of its tensor: rounding
# errs by up to ~20 u ≈ 1.2e-6 of the tensor's gradient scale, which changes Adam's step
# lr·g/|g| by lr·1.2e-6·max|g|/|g|, and that stays ≤ ATOL / STEPS over 2 steps only for
# |g| ≥ 2.4e-4·max|g|: 1e-3 leaves a factor 4. (With ATOL for every element, the test
# failed on some CPUs: a different vector width sums in another order.)
ROUNDING_DECIDED = 1e-3
STEPS, LR = 2, 1e-3  # as in small_overrides
# Adam's step is at most ~lr per element (|m̂|/√v̂ ≤ 1 in the first steps), so two layouts
# can differ by at most 2·lr per step in any element; more is a bug, not rounding.
ADAM_MAX_DIFF = 2 * LR * STEPS


def small_overrides(out: str) -> list[str]:
    """2 pipeline steps of the default recipe at tiny sizes. The tiny model without its
    warm-up never writes a valid `<answer>…</answer>` reply (the recipe's reply prefix is
    switched off here), so all returns (and, with episode-level GRPO instead of the
    recipe's turn_grpo, all advantages) are equal: the entropy bonus gives the updates a
    small non-zero gradient to compare. With large advantages, Adam's normalised steps turn
    the shards' different summation order into parameter differences above 1e-5."""
    return [
        f"--config={os.path.join(ROOT, 'configs', 'frozen_lake.py')}",
        f"--config.output_dir={out}",
        "--config.pretrain=tiny",
        "--config.format_warmup.steps=0",
        f"--config.max_steps={STEPS}",
        "--config.save_steps=2",
        "--config.eval_steps=2",
        "--config.train_env_manager.num_env_groups=2",
        "--config.train_env_manager.group_size=2",
        "--config.val_env_manager.num_env_groups=2",
        "--config.mini_batch_size=4",
        "--config.custom_envs.frozen_lake.max_turns=2",
        "--config.custom_envs.frozen_lake.max_tokens_per_step=6",
        "--config.max_input_length=506",  # + 6 reply tokens = sequence_length
        "--config.sequence_length=512",
        "--config.micro_batch_max_tokens=512",
        "--config.entropy_loss_coef=0.01",
        "--config.warmup_steps=0",
        f"--config.learning_rate={LR}",
        "--config.reply_prefix=",
        "--config.reply_suffix=",
        "--config.adv_estimator=grpo",
        # One CPU device per process, in this process and in the subprocesses alike (the
        # recipe's one-per-core would apply only in a fresh process).
        "--config.mesh.cpu_devices=1",
        # Continuous rollouts (here and in test_async / test_in_flight, which share these
        # settings) compile only the slot programs they run: the up-front grid of every
        # row count × prompt length (tests/sampling/test_slot_decoder.py,
        # tests/rollout/test_continuous.py) cost most of their cold time, once per pipeline.
        "--config.rollout_precompile=False",
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or "",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2")
    # The compile flags of layout comparisons (conftest.py), without a device count of this
    # process's.
    env["XLA_FLAGS"] = LAYOUT_XLA_FLAGS
    return env


def assert_same_metrics(got: list[dict], want: list[dict], label: str) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want], label
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w), label
        for key in w:
            if key.startswith(("time/", "perf/")) or key in LAYOUT_KEYS:
                continue
            assert abs(g[key] - w[key]) <= ATOL * max(1.0, abs(w[key])), (label, key, g[key],
                                                                          w[key])


# ---- one process, 8 devices ---------------------------------------------------------------

MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    from jaxrl_agentic.pipeline import Pipeline
    from jaxrl_agentic.train import parse_config

    def adam_nu(pipe):
        # optax's ScaleByAdamState: nu = EMA of squared (clipped) gradients, one per param.
        states = jax.tree.leaves(pipe.learner.state.opt_state, is_leaf=lambda x: hasattr(x, "nu"))
        [state] = [s for s in states if hasattr(s, "nu")]
        return [np.asarray(x, np.float64) for x in jax.tree.leaves(state.nu)]

    c = parse_config(["train", *json.loads(sys.argv[1])])
    b2 = 0.999  # LearnerConfig.adam_b2
    report, reference, decided = {}, None, None
    # fsdp without tensor is the split run's learner (2, 2, 1); tests/runtime/test_parallel.py
    # checks train steps on (2, 4, 1).
    # Continuous batching on the data-only mesh (slots over data) and turn lockstep on the
    # others: each layout is a whole set of compiled programs, so no layout runs twice.
    runs = [("(1, 1, 1)", (1, 1, 1), 0), ("(8, 1, 1) continuous", (8, 1, 1), 0),
            ("(2, 2, 2)", (2, 2, 2), 0),
            ("split", (2, 2, 1), 4)]  # 4 learner devices, 4 sampler devices
    for label, shape, sampler_devices in runs:
        c.rollout_batching = "continuous" if label.endswith("continuous") else "turn"
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = shape
        c.mesh.sampler_devices = sampler_devices
        pipe = Pipeline(c, devices=jax.devices()[:1] if shape == (1, 1, 1) else None)
        metrics, nus = [], []
        for _ in range(2):
            metrics.append(pipe.train_step()[0])
            nus.append(adam_nu(pipe))
        params = [np.asarray(x) for x in jax.tree.leaves(pipe.learner.params)]
        if reference is None:
            reference = params
            # The reference of the two-process run too (test_two_processes_match_one): the
            # CLI evaluates after its last step, and keeps these parameters.
            reference_eval = pipe.evaluate()[0]
            np.savez(sys.argv[4], *params)
            # |g_t| of every element at both steps, from the reference's Adam moments:
            # nu_1 = (1 - b2) g_1², nu_2 = b2 nu_1 + (1 - b2) g_2².
            g1 = [np.sqrt(n1 / (1 - b2)) for n1 in nus[0]]
            g2 = [np.sqrt(np.maximum(n2 - b2 * n1, 0) / (1 - b2))
                  for n1, n2 in zip(nus[0], nus[1])]
            assert [x.shape for x in g1] == [x.shape for x in params]
            # See ROUNDING_DECIDED in the test file.
            ratio = float(sys.argv[2])
            decided = [(a < ratio * a.max()) | (b < ratio * b.max()) for a, b in zip(g1, g2)]
        diffs = [np.abs(a.astype(np.float64) - b) for a, b in zip(params, reference)]
        q = pipe.learner.params["layers"]["attn"]["q_proj"]["kernel"][...]
        dev0 = jax.devices()[0]
        ids = lambda tree: sorted({d.id for x in jax.tree.leaves(tree) for d in x.devices()})
        report[label] = {
            "learner_devices": ids(pipe.learner.params),
            "sampler_devices": ids(pipe.sampler_params()),
            "metrics": metrics,
            "param_max_abs_diff": max(float(d.max()) for d in diffs),
            "conditioned_max_abs_diff": max(float(np.where(r, 0, d).max())
                                            for d, r in zip(diffs, decided)),
            "rounding_decided": [int(r.sum()) for r in decided],
            "rounding_decided_over_atol": int(sum(((d > float(sys.argv[3])) & r).sum()
                                                  for d, r in zip(diffs, decided))),
            "num_params": sum(int(x.size) for x in params),
            "q_shard": list(q.addressable_shards[0].data.shape[1:]),  # past the layer axis
            "bytes_dev0": sum(s.data.nbytes for leaf in jax.tree.leaves(pipe.learner.params)
                              for s in leaf.addressable_shards if s.device == dev0),
            "cache_spec": str(pipe.sampler.new_session(8).cache.k[0].sharding.spec),
        }
    report["(1, 1, 1)"]["eval"] = reference_eval
    print("REPORT " + json.dumps(report))
""")


@pytest.fixture(scope="module")
def mesh_report(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mesh"))
    env = dict(_env(), XLA_FLAGS=f"{LAYOUT_XLA_FLAGS} --xla_force_host_platform_device_count=8")
    params = os.path.join(out, "one_device_params.npz")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, json.dumps(small_overrides(out)),
                           str(ROUNDING_DECIDED), str(ATOL), params],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    report = json.loads(line[len("REPORT "):])
    with np.load(params) as f:
        report["(1, 1, 1)"]["params"] = [f[f"arr_{i}"] for i in range(len(f.files))]
    return report


@pytest.mark.parametrize("shape", ["(8, 1, 1) continuous", "(2, 2, 2)", "split"])
def test_pipeline_steps_on_a_mesh_match_one_device(mesh_report, shape):
    one, report = mesh_report["(1, 1, 1)"], mesh_report[shape]
    assert_same_metrics(report["metrics"], one["metrics"], shape)
    assert report["conditioned_max_abs_diff"] <= ATOL
    assert report["param_max_abs_diff"] <= ADAM_MAX_DIFF
    # The exact comparison covers most parameters (12.6% are rounding-decided, most of them
    # embedding rows of tokens the batch never held, whose gradient is exactly 0).
    assert sum(one["rounding_decided"]) <= 0.25 * one["num_params"]
    # The comparison means something: there were generated tokens and real updates.
    assert one["metrics"][0]["tokens/loss"] > 0
    assert one["metrics"][1]["actor/grad_norm"] > 0


def test_pipeline_mesh_shards_params_and_kv_cache(mesh_report):
    full = mesh_report["(1, 1, 1)"]["bytes_dev0"]
    assert mesh_report["(8, 1, 1) continuous"]["bytes_dev0"] == full  # data only: replicated
    assert mesh_report["(2, 2, 2)"]["bytes_dev0"] < 0.3 * full  # ~1/4 + norms
    assert mesh_report["(2, 2, 2)"]["q_shard"] == [64, 64]  # [128, 128] over fsdp × tensor
    # Colocated: the sampler reads the learner's params in place.
    assert mesh_report["(2, 2, 2)"]["sampler_devices"] == list(range(8))
    # Split: the learner trains on devices 0-3, the sampler decodes on 4-7 with a copy.
    assert mesh_report["split"]["learner_devices"] == [0, 1, 2, 3]
    assert mesh_report["split"]["sampler_devices"] == [4, 5, 6, 7]
    # Sampler streams over data × fsdp, kv heads over tensor.
    assert mesh_report["(2, 2, 2)"]["cache_spec"] == str(
        jax.sharding.PartitionSpec(("data", "fsdp"), "tensor", None, None))


# ---- two processes (jax.distributed over loopback) -----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params_at(checkpoints: str, step: int) -> list[np.ndarray]:
    """Learner params of a checkpoint, whatever topology wrote it, on this one device."""
    path = os.path.join(checkpoints, str(step), "state")
    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            meta)
    restored = checkpointer.restore(path, abstract)
    return [np.asarray(x) for x in jax.tree.leaves(restored["learner"]["params"])]


def test_two_processes_match_one(mesh_report, tmp_path):
    """Two `jax.distributed` processes (a CLI run each) against the one-device run of
    `mesh_report`, which has the same overrides and compile flags: the metrics of both steps
    and the final eval, and the parameters of the checkpoint the two wrote together."""
    multi = str(tmp_path / "multi")
    port = _free_port()
    runs = [[*small_overrides(multi), "--config.distributed.enabled=True",
             f"--config.distributed.coordinator_address=127.0.0.1:{port}",
             "--config.distributed.num_processes=2",
             f"--config.distributed.process_id={rank}"] for rank in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxrl_agentic.train", *args], cwd=ROOT,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for args in runs]
    try:
        logs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"run {rank}:\n{log[-3000:]}"
    # Only process 0 of the two logs: one metrics line per step, not two.
    assert "step 2:" in logs[0] and "step 2:" not in logs[1]

    with open(os.path.join(multi, "metrics.jsonl")) as f:
        got = [json.loads(line) for line in f]
    one = mesh_report["(1, 1, 1)"]
    want = [dict(m) for m in one["metrics"]]  # copies: the fixture's are shared
    want[-1].update(one["eval"])
    assert len(got) == 2 and "eval/success" in got[-1] and "eval/success" in want[-1]
    # The CLI adds its own bookkeeping (streak counters, wall time) to the pipeline's metrics.
    assert_same_metrics([{k: g[k] for k in w} for g, w in zip(got, want, strict=True)], want,
                        "2 processes")
    assert want[1]["actor/grad_norm"] > 0
    # The checkpoint both processes wrote together holds the one-device run's params.
    multi_params = _params_at(os.path.join(multi, "checkpoints"), 2)
    assert [p.shape for p in multi_params] == [p.shape for p in one["params"]]
    diffs = [float(np.abs(a - b).max()) for a, b in zip(multi_params, one["params"],
                                                         strict=True)]
    assert max(diffs) <= ATOL
