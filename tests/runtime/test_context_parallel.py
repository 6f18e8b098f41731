"""Context parallelism (the mesh's ``context`` axis): a packed row split over C devices
gives the one-device loss, gradients and logprobs, and less activation memory per device.

The meshes need 8 devices, which a JAX process cannot get after initialisation, so one
subprocess with ``--xla_force_host_platform_device_count=8`` compiles one program per mesh
(the loss and gradients of ``learner.make_loss_and_grads``; its temp bytes are read from
that same compiled program) and reports numbers as JSON; the assertions are made here.
The reference is the (1, 1, 1, 1) mesh, which runs the model's own block-sparse attention
on rows in packed order, not the context-parallel path.
"""

import textwrap

import pytest

from jaxrl_agentic.config import ConfigError, default_config, validate
from jaxrl_agentic.runtime.parallel import make_mesh
from pallas_kernels.context_attention import context_length_error, zigzag_order
from tests.cpu_devices import run_with_cpu_devices

ROW_LEN = 512  # rows of 512 tokens: chunks of 64 (one key block of 64) at context 4

_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, os
    import jax, jax.numpy as jnp, numpy as np, optax
    if os.environ.get("CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.environ["CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    from flax import nnx
    from jaxrl_agentic.data import PackingConfig, Sample
    from jaxrl_agentic.data.packing import pack_tree
    from jaxrl_agentic.models.config import ModelConfig
    from jaxrl_agentic.models.transformer import Transformer
    from jaxrl_agentic.runtime.parallel import (batch_sharding, make_mesh,
                                                train_state_shardings)
    from jaxrl_agentic.training.learner import make_compute_logprobs, make_loss_and_grads
    from jaxrl_agentic.training.learner_config import LearnerConfig
    from jaxrl_agentic.training.update import kernels_see_mesh

    ROW_LEN = %(row_len)d
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    config = LearnerConfig(
        learning_rate=1e-3, loss_reduction="seq_mean_token_mean", init_kl_coef=0.05,
        dual_clip=3.0, entropy_loss_coef=0.01, temperature=0.9, mini_batch_size=8,
        packing=PackingConfig(micro_batch_max_tokens=ROW_LEN, sequence_length=ROW_LEN,
                              share_group_prefix=True, row_prefixes=0))
    rng = np.random.default_rng(0)
    samples = []
    # Groups whose shared prompt (tree packing: one copy) and continuations cross the
    # 64-token zigzag chunks, some single samples, a masked observation inside a reply.
    for g, (prompt, tails) in enumerate([(70, (90, 40, 75)), (33, (120, 61)),
                                         (101, (66, 30, 52)), (12, (140,))]):
        head = rng.integers(1, 64, prompt)
        for m, tail in enumerate(tails):
            tokens = np.concatenate([head, rng.integers(1, 64, tail)])
            mask = np.zeros(len(tokens)); mask[prompt:] = 1
            if m == 1:
                mask[prompt + 5:prompt + 12] = 0
            samples.append(Sample(
                tokens=tokens, loss_mask=mask,
                old_logprobs=mask * rng.uniform(-4.6, -3.7, len(tokens)),
                advantages=mask * (rng.normal() + 0.3 * rng.normal(size=len(tokens))),
                ref_logprobs=mask * rng.uniform(-4.5, -3.8, len(tokens)),
                traj_id=10 * g + m, prompt_len=prompt))
    packed = pack_tree(samples, micro_batch_max_tokens=ROW_LEN, sequence_length=ROW_LEN,
                       num_rows=4)
    keys = ("tokens", "positions", "segment_ids", "loss_mask", "advantages", "old_logprobs",
            "loss_index", "ref_logprobs", "prefix_ids")
    arrays = packed.device_arrays()
    batch = {k: arrays[k] for k in keys}
    lp_batch = {k: batch[k] for k in ("tokens", "positions", "segment_ids", "loss_index",
                                      "prefix_ids")}
    seg = np.asarray(batch["segment_ids"]); pre = np.asarray(batch["prefix_ids"])
    layout = {"segments": int(sum(len(set(r[r > 0])) for r in seg)),
              "rows_with_prefix": int((pre > 0).any(axis=1).sum()),
              "loss_tokens": int((np.asarray(batch["loss_mask"]) > 0).sum())}

    def program(mesh, logprobs=True):
        shardings = train_state_shardings(params, mesh)
        fn = kernels_see_mesh(mesh)(make_loss_and_grads(graphdef, config, mesh))
        jitted = jax.jit(fn, in_shardings=(shardings, batch_sharding(mesh), None))
        compiled = jitted.lower(params, batch, 0.05).compile()
        grads, sums, denominator = compiled(jax.device_put(params, shardings),
                                            jax.device_put(batch, batch_sharding(mesh)),
                                            0.05)
        lp = np.zeros(np.shape(batch["tokens"]), np.float32)
        if logprobs:
            lp = make_compute_logprobs(graphdef, config, mesh, shardings)(
                jax.device_put(params, shardings),
                jax.device_put(lp_batch, batch_sharding(mesh)))
        return {"all_gathers": compiled.as_text().count("all-gather"),
                "objective": float(sums.objective), "denominator": float(denominator),
                "tokens": float(sums.tokens), "grads": jax.device_get(grads),
                "logprobs": np.asarray(lp),
                "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}

    devices = jax.devices()
    meshes = {"1,1,1,1": make_mesh(1, 1, 1, devices=devices[:1]),
              "1,1,1,2": make_mesh(1, 1, 1, devices=devices[:2], context=2),
              "1,1,1,4": make_mesh(1, 1, 1, devices=devices[:4], context=4),
              "2,1,1,4": make_mesh(2, 1, 1, devices=devices, context=4)}
    results = {name: program(mesh, name != "1,1,1,2") for name, mesh in meshes.items()}
    ref = results["1,1,1,1"]
    out = {"layout": layout, "meshes": {}}
    for name, r in results.items():
        diff = jax.tree.map(lambda a, b: a - b, r["grads"], ref["grads"])
        out["meshes"][name] = {
            "objective": r["objective"], "denominator": r["denominator"],
            "tokens": r["tokens"], "temp_bytes": r["temp_bytes"],
            "all_gathers": r["all_gathers"],
            "grad_rel_err": float(optax.tree.norm(diff) / optax.tree.norm(ref["grads"])),
            "grad_norm": float(optax.tree.norm(r["grads"])),
            "logprob_max_abs_diff": float(np.abs(r["logprobs"] - ref["logprobs"]).max()),
            "logprob_nonzero": int((r["logprobs"] != 0).sum()),
        }
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def report():
    return run_with_cpu_devices(_SCRIPT % {"row_len": ROW_LEN}, 8)


def test_batch_has_segments_and_a_shared_prefix(report):
    layout = report["layout"]
    assert layout["segments"] >= 8 and layout["rows_with_prefix"] >= 2
    assert layout["loss_tokens"] > 400


@pytest.mark.parametrize("mesh", ["1,1,1,2", "1,1,1,4", "2,1,1,4"])
def test_loss_and_gradients_equal_one_devices(report, mesh):
    one, split = report["meshes"]["1,1,1,1"], report["meshes"][mesh]
    assert split["denominator"] == one["denominator"] and split["tokens"] == one["tokens"]
    assert split["objective"] == pytest.approx(one["objective"], rel=1e-5, abs=1e-6)
    assert one["grad_norm"] > 0 and split["grad_rel_err"] <= 2e-5
    # The split program gathers keys and values over the context axis; one device has none.
    assert one["all_gathers"] == 0 and split["all_gathers"] > 0


@pytest.mark.parametrize("mesh", ["1,1,1,4", "2,1,1,4"])
def test_logprobs_equal_one_devices(report, mesh):
    one, split = report["meshes"]["1,1,1,1"], report["meshes"][mesh]
    assert split["logprob_nonzero"] == one["logprob_nonzero"] > 0
    assert split["logprob_max_abs_diff"] <= 1e-5


def test_activation_memory_per_device_falls_with_the_context_axis(report):
    temp = {m: report["meshes"][m]["temp_bytes"] for m in ("1,1,1,1", "1,1,1,2", "1,1,1,4")}
    assert temp["1,1,1,2"] < temp["1,1,1,1"] and temp["1,1,1,4"] < temp["1,1,1,2"]


def test_zigzag_order_gives_each_shard_equal_causal_work():
    order = zigzag_order(64, 4).reshape(4, 16)  # 4 shards, chunks of 8 columns
    assert sorted(order.reshape(-1).tolist()) == list(range(64))
    assert order[0, :8].tolist() == list(range(8)) and order[0, 8:].tolist() == list(
        range(56, 64))
    work = (order + 1).sum(axis=1)  # causal (query, key) pairs of each shard's queries
    assert len(set(work.tolist())) == 1
    assert zigzag_order(32, 1).tolist() == list(range(32))


def test_make_mesh_context_axis():
    mesh = make_mesh(1, 1, 1, devices=[object()] * 4, context=4)
    assert mesh.axis_names == ("data", "fsdp", "tensor", "context")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1, "context": 4}
    assert dict(make_mesh(devices=[object()] * 2).shape)["context"] == 1


def test_row_length_rule():
    assert context_length_error(512, 1) is None and context_length_error(512, 4) is None
    assert context_length_error(1024, 4) is None  # chunks of 128: one block each
    assert "multiple of 2·context·block" in context_length_error(1600, 4)
    assert context_length_error(514, 4) is not None


@pytest.mark.parametrize("overrides,field", [
    ({"micro_batch_max_tokens": 4160}, "micro_batch_max_tokens"),
    ({"row_len_buckets": 2}, "row_len_buckets"),
    ({"policy_loss": "gspo"}, "policy_loss"),
])
def test_config_rejects_what_a_context_axis_cannot_split(overrides, field):
    c = default_config()  # rows of 4,096 tokens: chunks of 512 at context 4
    c.mesh.context = 4
    for key, value in overrides.items():
        setattr(c, key, value)
    with pytest.raises(ConfigError, match=field):
        validate(c)


def test_config_accepts_a_context_axis_and_rejects_a_bad_size():
    c = default_config()  # rows of 4,096 tokens: chunks of 512 at context 4
    c.mesh.context = 4
    validate(c)
    c.mesh.context = 0
    with pytest.raises(ConfigError, match="mesh.context"):
        validate(c)
