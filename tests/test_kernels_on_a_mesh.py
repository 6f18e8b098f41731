"""The accelerator kernels on a mesh of several devices: once per device, on its own rows.

XLA cannot partition a Pallas kernel. Before ``pallas_kernels._per_shard``, lowering the
learner's update step for a TPU over more than one chip raised "Mosaic kernels cannot be
automatically partitioned" (any multi-chip TPU run with the default kernels stopped at its
first update), and on several GPUs every device would have computed every row. Now the
learner traces its steps with its mesh as JAX's abstract mesh and each kernel runs under
``jax.shard_map``. Checked in one subprocess with 4 CPU devices:

* numbers: one learner step with the Pallas kernels (interpret mode) equals the step with
  the jnp references, on a 4-way data mesh and on a 2 × 2 data × tensor mesh (heads split),
  and the Pallas program holds manual (per-device) computations;
* lowering: with JAX's backend reading "tpu" or "gpu", the update step and the logprob
  recomputation lower for that hardware on the 4-device mesh, kernels per device.
"""

import textwrap

import pytest

from tests.cpu_devices import run_with_cpu_devices

_SCRIPT = textwrap.dedent(
    """
    import importlib, json, re
    import jax, numpy as np
    from flax import nnx
    from jaxrl_agentic.data import PackingConfig
    from jaxrl_agentic.data.types import Sample
    from jaxrl_agentic.training.learner import LOGPROB_BATCH_KEYS, Learner
    from jaxrl_agentic.training.learner_config import LearnerConfig
    from jaxrl_agentic.models import load_pretrained
    from jaxrl_agentic.models.tiny import default_tiny_model_dir
    from jaxrl_agentic.runtime.parallel import make_mesh
    from jaxrl_agentic.training.update import pad_to_shards, put_batch

    assert len(jax.devices()) == 4, jax.devices()
    rng = np.random.default_rng(0)
    samples = []
    for i in range(8):
        n = int(rng.integers(100, 250))
        m = np.zeros(n, np.float32)
        m[n // 2:] = 1
        samples.append(Sample(tokens=rng.integers(0, 500, n), loss_mask=m,
                              old_logprobs=-3.0 * m, advantages=m * float(rng.normal()),
                              traj_id=i, prompt_len=n // 2))
    def learner(dtype, impl, mesh, row):
        # Rows longer than 2 attention blocks, or attention runs dense (nothing to skip):
        # fp32 on a GPU has 64-token blocks, bf16 and TPUs 128.
        packing = PackingConfig(micro_batch_max_tokens=row, sequence_length=256)
        model, _ = load_pretrained(default_tiny_model_dir(), dtype=dtype, param_dtype="float32")
        graphdef, params = nnx.split(model)
        config = LearnerConfig(learning_rate=1e-5, mini_batch_size=8, attention_impl=impl,
                               kernel_impl=impl, packing=packing)
        return Learner(graphdef, params, config, mesh)

    def lowered(l, platform):
        eng, packing = l.engine, l.config.packing
        def batch(keys):
            return put_batch(pad_to_shards(packing.pack(samples), eng.mesh, 0), keys, eng.mesh)
        update = eng.update_step.trace(l.state, batch(eng.batch_keys), np.float32(1e-5))
        recompute = l.compute_logprobs.trace(l.state.params, batch(LOGPROB_BATCH_KEYS))
        return [t.lower(**({"lowering_platforms": (platform,)} if platform else {})).as_text()
                for t in (update, recompute)]

    out = {"numbers": {}, "lowered": {}}
    for name, shape in (("data4", dict(data=4)), ("data2_tensor2", dict(data=2, tensor=2))):
        for impl in ("pallas", "reference"):
            l = learner("float32", impl, make_mesh(**shape), 256)
            m = l.step(samples, [1e-5])
            manual = sum(t.count("sdy.manual_computation") for t in lowered(l, None))
            out["numbers"][f"{name}/{impl}"] = [m["actor/loss"], m["actor/grad_norm"], manual]

    kernels = re.compile(r"(?:segment_attention|masked_ppo_loss|token_logprobs|splash_mha)_[a-z_]+")
    for backend, platform in (("tpu", "tpu"), ("gpu", "cuda")):
        jax.default_backend = lambda: backend
        for module in ("pallas_kernels.token_logprobs", "pallas_kernels.ppo_loss"):
            importlib.import_module(module).default_platform = lambda: backend
        try:
            texts = lowered(learner("bfloat16", "auto", make_mesh(data=4), 512), platform)
            out["lowered"][backend] = [sorted(set(kernels.findall(t))) +
                                       [t.count("sdy.manual_computation")] for t in texts]
        except Exception as e:
            out["lowered"][backend] = f"{type(e).__name__}: {str(e)[:300]}"
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def report():
    return run_with_cpu_devices(_SCRIPT, 4)


@pytest.mark.parametrize("mesh", ["data4", "data2_tensor2"])
def test_kernels_per_device_give_the_references_numbers(report, mesh):
    loss, grad_norm, manual = report["numbers"][f"{mesh}/pallas"]
    ref_loss, ref_grad_norm, ref_manual = report["numbers"][f"{mesh}/reference"]
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grad_norm == pytest.approx(ref_grad_norm, rel=1e-5)
    assert manual > 0 and ref_manual == 0  # the kernels ran per device; the references not


def test_update_step_lowers_for_a_multi_chip_tpu(report):
    update, recompute = report["lowered"]["tpu"]  # a string (the error) before the fix
    assert update[:-1] == ["masked_ppo_loss_bwd", "masked_ppo_loss_fwd",
                           "splash_mha_dkv_segmented_no_residuals",
                           "splash_mha_dq_segmented_no_residuals",
                           "splash_mha_fwd_segmented_residuals", "token_logprobs_bwd_dh",
                           "token_logprobs_bwd_dw", "token_logprobs_fwd"]
    assert recompute[:-1] == ["splash_mha_fwd_segmented_no_residuals", "token_logprobs_fwd"]
    assert update[-1] > 0 and recompute[-1] > 0


def test_update_step_lowers_for_several_gpus_with_kernels_per_device(report):
    update, recompute = report["lowered"]["gpu"]
    assert update[:-1] == ["masked_ppo_loss_bwd", "masked_ppo_loss_fwd",
                           "segment_attention_dkdv", "segment_attention_dq",
                           "segment_attention_fwd"]
    assert recompute[:-1] == ["segment_attention_fwd"]
    assert update[-1] > 0 and recompute[-1] > 0
