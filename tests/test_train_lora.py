"""`lora_rank` alone turns any recipe into LoRA training: the run trains, its checkpoints
hold the adapters (and the head the recipe unties, and the embedding when it trains) with
their optimizer state but not the base, resume is exact, and the export is the merged dense
model."""

import json
import os

import numpy as np
import orbax.checkpoint as ocp

from jaxrl_agentic import train
from tests.test_train import check_outputs, comparable, read_metrics, tiny_overrides

# LoRA+ and a trained embedding on too: the rescaling is part of the optimizer state a resume
# restores, and the embedding is trained state beside the adapters.
LORA = ["--config.lora_rank=4", "--config.lora_alpha=8.0", "--config.learning_rate=1e-3",
        "--config.loraplus_lr_ratio=4.0", "--config.lora_train_embedding=True",
        "--config.entropy_loss_coef=0.01"]


def checkpoint_arrays(out: str, step: int) -> dict[str, tuple]:
    path = os.path.join(out, "checkpoints", str(step), "state")
    meta = ocp.StandardCheckpointer().metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}/{k}")
        elif node is not None and hasattr(node, "shape"):
            flat[prefix] = tuple(node.shape)

    walk(dict(meta), "")
    return flat


def test_lora_trains_saves_only_adapters_and_resumes_exactly(tmp_path):
    full = str(tmp_path / "full")
    assert train.main(["train", *tiny_overrides("frozen_lake", full, 2), *LORA]) == 0
    records = check_outputs(full, 2)
    assert records[-1]["actor/grad_norm"] > 0
    saved = checkpoint_arrays(full, 1)
    params = [k for k in saved if k.startswith("/learner/params/")]
    # The adapters, the head the recipe unties (lora_train_head="auto" trains it) and the
    # embedding (lora_train_embedding).
    assert params and all("lora_" in k or k.startswith(("/learner/params/lm_head/kernel",
                                                        "/learner/params/embed/embedding"))
                          for k in params)
    assert any("lm_head" in k for k in params) and any("embed" in k for k in params)
    assert not any("frozen" in k or "base_kernel" in k or "base_embedding" in k
                   or "proj/kernel" in k for k in saved)  # no base
    assert not any(k.startswith("/learner/ref_params") for k in saved)  # the base is the ref
    with open(os.path.join(full, "config.json")) as f:
        assert json.load(f)["lora_rank"] == 4

    resumed = str(tmp_path / "resumed")
    args = [*tiny_overrides("frozen_lake", resumed, 2), *LORA,
            f"--config.resume_from_checkpoint={os.path.join(full, 'checkpoints', '1')}"]
    assert train.main(["train", *args]) == 0
    got = read_metrics(resumed)
    assert [r["step"] for r in got] == [2]
    assert comparable(got[0]) == comparable(records[1])
    assert np.isfinite(got[0]["actor/pg_loss"])


def test_a_lora_run_exports_merged_or_as_a_peft_adapter(tmp_path, capsys):
    from jaxrl_agentic import export

    out = str(tmp_path / "run")
    assert train.main(["train", *tiny_overrides("frozen_lake", out, 1), *LORA]) == 0
    checkpoint = os.path.join(out, "checkpoints", "1")
    assert export.main(["--checkpoint", checkpoint, "--out", str(tmp_path / "merged")]) == 0
    assert os.path.exists(os.path.join(tmp_path, "merged", "model.safetensors"))
    assert export.main(["--checkpoint", checkpoint, "--out", str(tmp_path / "adapter"),
                        "--adapter"]) == 0
    with open(os.path.join(tmp_path, "adapter", "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], len(config["target_modules"])) == (4, 8.0, 7)
    plain = str(tmp_path / "plain")
    assert train.main(["train", *tiny_overrides("frozen_lake", plain, 1)]) == 0
    capsys.readouterr()
    assert export.main(["--checkpoint", os.path.join(plain, "checkpoints", "1"),
                        "--out", str(tmp_path / "x"), "--adapter"]) == 2
    assert "--adapter: the run was not trained with LoRA" in capsys.readouterr().err


def test_lora_with_asynchronous_rollouts_trains(tmp_path):
    """The rollout thread samples with a copy of the adapters over the shared base while the
    learner's update donates its own adapters."""
    out = str(tmp_path / "async")
    assert train.main(["train", *tiny_overrides("frozen_lake", out, 2), *LORA,
                       "--config.async_generation_ratio=1"]) == 0
    records = check_outputs(out, 2)
    assert records[-1]["actor/grad_norm"] > 0
    assert records[-1]["off_policy/staleness_max"] <= 1
