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

from jaxrl_agentic import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Padding rows for the shards change these by design; nothing else may differ.
LAYOUT_KEYS = {"tokens/computed", "batch/num_micro_batches", "tokens/efficiency"}
ATOL = 1e-5


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
        "--config.max_steps=2",
        "--config.save_steps=2",
        "--config.eval_steps=2",
        "--config.train_env_manager.num_env_groups=2",
        "--config.train_env_manager.group_size=2",
        "--config.val_env_manager.num_env_groups=2",
        "--config.mini_batch_size=4",
        "--config.custom_envs.frozen_lake.max_turns=2",
        "--config.custom_envs.frozen_lake.max_tokens_per_step=6",
        "--config.max_input_length=512",
        "--config.sequence_length=512",
        "--config.micro_batch_max_tokens=512",
        "--config.entropy_loss_coef=0.01",
        "--config.warmup_steps=0",
        "--config.learning_rate=1e-3",
        "--config.reply_prefix=",
        "--config.reply_suffix=",
        "--config.adv_estimator=grpo",
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or "",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2")
    env.pop("XLA_FLAGS", None)
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

    c = parse_config(["train", *json.loads(sys.argv[1])])
    report, reference = {}, None
    runs = [("(1, 1, 1)", (1, 1, 1), 0), ("(8, 1, 1)", (8, 1, 1), 0),
            ("(2, 4, 1)", (2, 4, 1), 0), ("(2, 2, 2)", (2, 2, 2), 0),
            ("split", (2, 2, 1), 4)]  # 4 learner devices, 4 sampler devices
    for label, shape, sampler_devices in runs:
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = shape
        c.mesh.sampler_devices = sampler_devices
        pipe = Pipeline(c, devices=jax.devices()[:1] if shape == (1, 1, 1) else None)
        metrics = [pipe.train_step()[0] for _ in range(2)]
        params = [np.asarray(x) for x in jax.tree.leaves(pipe.learner.params)]
        reference = params if reference is None else reference
        q = pipe.learner.params["layers"][0]["attn"]["q_proj"]["kernel"][...]
        dev0 = jax.devices()[0]
        ids = lambda tree: sorted({d.id for x in jax.tree.leaves(tree) for d in x.devices()})
        report[label] = {
            "learner_devices": ids(pipe.learner.params),
            "sampler_devices": ids(pipe.sampler_params()),
            "metrics": metrics,
            "param_max_abs_diff": max(float(np.abs(a - b).max())
                                      for a, b in zip(params, reference)),
            "q_shard": list(q.addressable_shards[0].data.shape),
            "bytes_dev0": sum(s.data.nbytes for leaf in jax.tree.leaves(pipe.learner.params)
                              for s in leaf.addressable_shards if s.device == dev0),
            "cache_spec": str(pipe.sampler.new_session(8).cache.k[0].sharding.spec),
        }
    print("REPORT " + json.dumps(report))
""")


@pytest.fixture(scope="module")
def mesh_report(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mesh"))
    env = dict(_env(), XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, json.dumps(small_overrides(out))],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


@pytest.mark.parametrize("shape", ["(8, 1, 1)", "(2, 4, 1)", "(2, 2, 2)", "split"])
def test_pipeline_steps_on_a_mesh_match_one_device(mesh_report, shape):
    one, report = mesh_report["(1, 1, 1)"], mesh_report[shape]
    assert_same_metrics(report["metrics"], one["metrics"], shape)
    assert report["param_max_abs_diff"] <= ATOL
    # The comparison means something: there were generated tokens and real updates.
    assert one["metrics"][0]["tokens/loss"] > 0
    assert one["metrics"][1]["actor/grad_norm"] > 0


def test_pipeline_mesh_shards_params_and_kv_cache(mesh_report):
    full = mesh_report["(1, 1, 1)"]["bytes_dev0"]
    assert mesh_report["(8, 1, 1)"]["bytes_dev0"] == full  # data only: replicated
    assert mesh_report["(2, 4, 1)"]["bytes_dev0"] < 0.3 * full  # ~1/4 + norms
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


def test_two_processes_match_one(tmp_path):
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    assert train.main(["train", *small_overrides(single)]) == 0

    port = _free_port()
    procs = []
    for rank in range(2):
        args = [*small_overrides(multi), "--config.distributed.enabled=True",
                f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                "--config.distributed.num_processes=2", f"--config.distributed.process_id={rank}"]
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxrl_agentic.train", *args],
                                      cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"process {rank}:\n{log[-3000:]}"
    # Only process 0 logs: one metrics line per step, not two.
    assert "step 2:" in logs[0] and "step 2:" not in logs[1]

    def metrics(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]

    want, got = metrics(single), metrics(multi)
    assert len(got) == 2 and "eval/success" in got[-1]
    assert_same_metrics(got, want, "2 processes")
    assert want[1]["actor/grad_norm"] > 0
    # The checkpoint both processes wrote together holds the single run's params.
    diffs = [float(np.abs(a - b).max()) for a, b in zip(
        _params_at(os.path.join(multi, "checkpoints"), 2),
        _params_at(os.path.join(single, "checkpoints"), 2), strict=True)]
    assert max(diffs) <= ATOL
