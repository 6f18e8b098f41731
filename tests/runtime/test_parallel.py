"""Mesh, partition rules, and sharded train-step equivalence.

The sharded checks need 8 devices, which a JAX process cannot get after initialisation, so
they run in one subprocess with ``--xla_force_host_platform_device_count=8`` that reports
numbers as JSON; the assertions are made here.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_agentic.runtime.parallel import (
    batch_sharding,
    make_mesh,
    num_batch_shards,
    param_partition_spec,
    shard_params,
)
from tests.conftest import TEST_XLA_FLAGS
from tests.cpu_devices import run_with_cpu_devices

MESH_8 = {"data": 2, "fsdp": 2, "tensor": 2}


def test_make_mesh_fills_and_checks():
    mesh = make_mesh()
    assert mesh.axis_names == ("data", "fsdp", "tensor", "context")
    assert dict(mesh.shape) == {"data": len(jax.devices()), "fsdp": 1, "tensor": 1,
                                "context": 1}
    assert num_batch_shards(mesh) == len(jax.devices())
    devices = [object()] * 8  # the rule arithmetic does not need real devices
    with pytest.raises(ValueError, match="at most one -1"):
        make_mesh(-1, -1, 1, devices=devices)
    with pytest.raises(ValueError, match="not divisible"):
        make_mesh(-1, 3, 1, devices=devices)
    with pytest.raises(ValueError, match="needs 4 devices"):
        make_mesh(2, 2, 1, devices=devices)


@pytest.mark.parametrize(
    "path, shape, expected",
    [
        (("embed", "embedding"), (64, 32), P("tensor", "fsdp")),
        (("lm_head", "kernel"), (32, 64), P("fsdp", "tensor")),
        # Decoder blocks' weights are stacked [L, ...]: the layer axis stays unsharded.
        (("layers", "attn", "q_proj", "kernel"), (2, 32, 32), P(None, "fsdp", "tensor")),
        (("layers", "attn", "k_proj", "bias"), (2, 16), P(None, "tensor")),
        (("layers", "attn", "o_proj", "kernel"), (2, 32, 32), P(None, "tensor", "fsdp")),
        (("layers", "mlp", "gate_proj", "kernel"), (2, 32, 64), P(None, "fsdp", "tensor")),
        (("layers", "mlp", "up_proj", "kernel"), (2, 32, 64), P(None, "fsdp", "tensor")),
        (("layers", "mlp", "down_proj", "kernel"), (2, 64, 32), P(None, "tensor", "fsdp")),
        (("layers", "input_norm", "scale"), (2, 32), P()),
        (("final_norm", "scale"), (32,), P()),
        # Not divisible: the kv width 6 over tensor=2 is fine, 33 rows over fsdp=2 is not.
        (("layers", "attn", "v_proj", "kernel"), (2, 33, 6), P(None, None, "tensor")),
        (("embed", "embedding"), (63, 32), P(None, "fsdp")),
        # Optimizer moments: the path ends with the parameter's path.
        (("opt_state", 1, "inner_state", 0, "mu", "layers", "mlp", "down_proj", "kernel"),
         (2, 64, 32), P(None, "tensor", "fsdp")),
        (("opt_state", 1, "hyperparams", "learning_rate"), (), P()),
        (("step",), (), P()),
    ],
)
def test_partition_rules(path, shape, expected):
    assert param_partition_spec(path, shape, MESH_8) == expected


def test_rules_apply_to_real_key_paths():
    from flax import nnx

    from jaxrl_agentic.models.config import ModelConfig
    from jaxrl_agentic.models.transformer import Transformer

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    _, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    specs = {
        jax.tree_util.keystr(path): param_partition_spec(path, leaf.shape, MESH_8)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert specs["['layers']['attn']['q_proj']['kernel'].value"] == P(None, "fsdp", "tensor")
    assert specs["['layers']['mlp']['down_proj']['kernel'].value"] == P(None, "tensor", "fsdp")
    assert specs["['final_norm']['scale'].value"] == P()
    placed = shard_params(params, make_mesh())
    assert jax.tree.leaves(placed)[0].sharding.mesh.axis_names == ("data", "fsdp", "tensor",
                                                                   "context")
    assert batch_sharding(make_mesh()).spec == P(("data", "fsdp"), None)


_SCRIPT = textwrap.dedent(
    """
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    if os.environ.get("CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.environ["CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    from flax import nnx
    from jaxrl_agentic.data import PackingConfig, Sample, pack_samples
    from jaxrl_agentic.training.learner import (init_train_state, make_compute_logprobs,
                                                make_train_step)
    from jaxrl_agentic.training.learner_config import LearnerConfig
    from jaxrl_agentic.models.config import ModelConfig
    from jaxrl_agentic.models.transformer import Transformer
    from jaxrl_agentic.runtime.parallel import make_mesh, train_state_shardings

    assert len(jax.devices()) == 8, jax.devices()
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    config = LearnerConfig(learning_rate=1e-3, weight_decay=0.01,
                           loss_reduction="seq_mean_token_mean", init_kl_coef=0.05,
                           dual_clip=3.0, entropy_loss_coef=0.01,
                           mini_batch_size=8,
                           packing=PackingConfig(micro_batch_max_tokens=32, sequence_length=32,
                                                 rows_bucket=0, fixed_rows=False))
    rng = np.random.default_rng(0)

    def batch():
        samples = []
        for i in range(12):
            n = int(rng.integers(6, 16)); p = int(rng.integers(1, n - 1))
            mask = np.r_[np.zeros(p), np.ones(n - p)]
            samples.append(Sample(tokens=rng.integers(1, 64, n), loss_mask=mask,
                                  old_logprobs=mask * rng.uniform(-4.6, -3.8, n),
                                  advantages=mask * rng.normal(), prompt_len=p,
                                  ref_logprobs=mask * rng.uniform(-4.5, -3.9, n)))
        packed = pack_samples(samples, micro_batch_max_tokens=32, sequence_length=32, num_rows=8)
        return packed.device_arrays()

    batches = [batch() for _ in range(3)]
    lrs = [np.float32(x) for x in (1e-3, 5e-4, 2e-4)]

    def run(mesh):
        state = init_train_state(params, config)
        shardings = train_state_shardings(state, mesh)
        state = jax.device_put(state, shardings)
        step = make_train_step(graphdef, config, mesh, shardings)
        losses = []
        for b, lr in zip(batches, lrs):
            state, metrics = step(state, b, lr)
            losses.append(float(metrics["loss"]))
        dev0 = jax.devices()[0]
        bytes_dev0 = sum(s.data.nbytes for leaf in jax.tree.leaves(state.params)
                         for s in leaf.addressable_shards if s.device == dev0)
        q = state.params["layers"]["attn"]["q_proj"]["kernel"][...]
        return state, losses, bytes_dev0, str(q.sharding.spec), q.addressable_shards[0].data.shape

    single, single_losses, full_bytes, _, _ = run(make_mesh(devices=jax.devices()[:1]))
    reference = [np.asarray(x) for x in jax.tree.leaves(single.params)]
    out = {"full_bytes": full_bytes, "single_losses": single_losses, "meshes": {}}
    for shape in ((8, 1, 1), (2, 4, 1), (2, 2, 2)):
        state, losses, nbytes, spec, q_shard = run(make_mesh(*shape))
        leaves = [np.asarray(x) for x in jax.tree.leaves(state.params)]
        out["meshes"][str(shape)] = {
            "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(leaves, reference)),
            "losses": losses, "bytes_dev0": nbytes, "q_spec": spec, "q_shard": list(q_shard),
            "ref_bytes_dev0": sum(s.data.nbytes for leaf in jax.tree.leaves(state.ref_params)
                                  for s in leaf.addressable_shards
                                  if s.device == jax.devices()[0]),
        }
        last_state, last_mesh = state, make_mesh(*shape)
    # Logprobs from the sharded (2, 2, 2) params on that mesh vs the single-device params.
    fn_sharded = make_compute_logprobs(graphdef, config, last_mesh,
                                       train_state_shardings(last_state, last_mesh).params)
    one = make_mesh(devices=jax.devices()[:1])
    fn_single = make_compute_logprobs(graphdef, config, one,
                                      train_state_shardings(single, one).params)
    lp_sharded = np.asarray(fn_sharded(last_state.params, batches[0]))
    lp_single = np.asarray(fn_single(single.params, batches[0]))
    out["logprob_max_abs_diff"] = float(np.abs(lp_sharded - lp_single).max())
    out["logprob_nonzero"] = int((lp_single != 0).sum())
    out["loss_tokens"] = int((np.asarray(batches[0]["loss_mask"]) > 0).sum())
    # The host loop on a (2, 4, 1) mesh: 5 short samples need 2 rows, padded to 8 shards.
    from jaxrl_agentic.training.learner import Learner
    import dataclasses
    learner = Learner(graphdef, params, dataclasses.replace(config, init_kl_coef=0.0),
                      make_mesh(2, 4, 1))
    samples = [Sample(tokens=rng.integers(1, 64, 10), loss_mask=np.r_[np.zeros(4), np.ones(6)],
                      old_logprobs=np.r_[np.zeros(4), np.full(6, -4.2)],
                      advantages=np.r_[np.zeros(4), np.ones(6)], prompt_len=4)
               for _ in range(5)]
    out["learner"] = learner.step(samples, [1e-3])
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def sharded_report():
    return run_with_cpu_devices(_SCRIPT, 8)


def test_sharded_train_steps_match_single_device(sharded_report):
    single = sharded_report["single_losses"]
    assert all(np.isfinite(single)) and len(set(single)) == 3
    for shape, report in sharded_report["meshes"].items():
        assert report["max_abs_diff"] <= 1e-5, shape
        np.testing.assert_allclose(report["losses"], single, rtol=1e-5, atol=1e-7, err_msg=shape)
    assert sharded_report["logprob_max_abs_diff"] <= 1e-5
    # Computed at every loss token (and only there: the LM head runs at the loss slots).
    assert sharded_report["logprob_nonzero"] == sharded_report["loss_tokens"] > 50
    learner = sharded_report["learner"]
    assert learner["batch/num_micro_batches"] == 8  # 2 rows needed, padded to the 8 shards
    assert learner["tokens/loss"] == 5 * 6 and learner["tokens/real"] == 50
    assert np.isfinite(learner["actor/loss"]) and learner["optim/nonfinite_updates"] == 0


def test_parameters_are_really_sharded(sharded_report):
    full = sharded_report["full_bytes"]
    meshes = sharded_report["meshes"]
    # data only: every device holds everything.
    assert meshes["(8, 1, 1)"]["bytes_dev0"] == full
    assert meshes["(8, 1, 1)"]["q_spec"] == str(P(None, "fsdp", "tensor"))
    # fsdp = 4: matrices are split 4 ways (norm scales stay replicated).
    assert meshes["(2, 4, 1)"]["bytes_dev0"] < 0.3 * full
    assert meshes["(2, 4, 1)"]["q_shard"] == [1, 8, 32]  # [layers, D, heads·head_dim]
    # fsdp = 2 × tensor = 2: also ~4× smaller; q_proj split on both dimensions.
    assert meshes["(2, 2, 2)"]["bytes_dev0"] < 0.3 * full
    assert meshes["(2, 2, 2)"]["q_shard"] == [1, 16, 16]
    assert meshes["(2, 2, 2)"]["ref_bytes_dev0"] == meshes["(2, 2, 2)"]["bytes_dev0"]


def _last_json_line(code: str, **env) -> dict:
    """Runs `code` in a fresh Python (its own JAX backend; a device count only if given)."""
    base = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env={**base, "JAX_PLATFORMS": "cpu", **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_use_cpu_devices_splits_the_cpu_before_the_backend_starts():
    """cpu_devices=3 gives three CPU devices; a second call, once the backend runs, keeps
    them and says so; 0 means one device per core this process may run on."""
    out = _last_json_line("""
        import json, os
        from jaxrl_agentic.runtime.parallel import use_cpu_devices
        said = []
        asked = use_cpu_devices(3, log=said.append)
        import jax
        have = len(jax.devices())
        again = use_cpu_devices(0, log=said.append)
        print(json.dumps({"asked": asked, "have": have, "again": again, "said": said,
                          "cores": len(os.sched_getaffinity(0))}))
    """)
    assert (out["asked"], out["have"]) == (3, 3)
    assert out["again"] == out["cores"]
    if out["cores"] != 3:
        assert out["said"] == ["cpu_devices=0 not applied: the JAX backend is already running "
                               "with 3 CPU device(s), which this run uses"]


def test_use_cpu_devices_leaves_an_xla_flags_device_count_alone():
    out = _last_json_line("""
        import json
        from jaxrl_agentic.runtime.parallel import use_cpu_devices
        said = []
        use_cpu_devices(1, log=said.append)
        use_cpu_devices(4, log=said.append)
        import jax
        print(json.dumps({"have": len(jax.devices()), "said": said}))
    """, XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=2")
    assert out["have"] == 2
    assert out["said"] == ["cpu_devices=4 not applied: XLA_FLAGS already sets "
                           "--xla_force_host_platform_device_count"]


def test_use_cpu_devices_rejects_a_negative_count():
    from jaxrl_agentic.runtime.parallel import use_cpu_devices

    with pytest.raises(ValueError, match="cpu_devices must be >= 0"):
        use_cpu_devices(-1)
