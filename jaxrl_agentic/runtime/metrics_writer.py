"""Metrics to TensorBoard (tensorboardX), `<output_dir>/metrics.jsonl` and the console.

One JSON object per pipeline step; on resume the file is cut back to the restored step so
a resumed run's metrics continue the same file without duplicates.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np


def _jsonable(value: float):
    return value if math.isfinite(value) else str(value)


class MetricsWriter:
    def __init__(self, output_dir: str, logging_dir: str, *, resume_step: int = 0):
        from tensorboardX import SummaryWriter

        os.makedirs(output_dir, exist_ok=True)
        self.jsonl_path = os.path.join(output_dir, "metrics.jsonl")
        self._truncate_after(resume_step)
        self.jsonl = open(self.jsonl_path, "a")  # noqa: SIM115 - closed in close()
        self.tb = SummaryWriter(logging_dir, purge_step=resume_step + 1 if resume_step else None)

    def _truncate_after(self, step: int) -> None:
        if not os.path.exists(self.jsonl_path):
            return
        with open(self.jsonl_path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(self.jsonl_path, "w") as f:
            f.writelines(kept)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _jsonable(float(v)) for k, v in metrics.items()
                                   if k != "step"}}
        self.jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        self.jsonl.flush()
        for key, value in metrics.items():
            if key != "step":
                self.tb.add_scalar(key, float(value), step)
        self.tb.flush()

    def write_text(self, step: int, tag: str, text: str) -> None:
        # Markdown code block keeps grids aligned in TensorBoard's text tab.
        self.tb.add_text(tag, "```\n" + text + "\n```", step)

    def write_frames(self, step: int, tag: str, frames: list[np.ndarray]) -> None:
        self.tb.add_images(tag, np.stack(frames), step, dataformats="NHWC")

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()


def console_line(step: int, metrics: dict[str, float]) -> str:
    keys = ("env/success", "env/return", "eval/success", "actor/pg_loss", "optim/lr",
            "perf/tokens_per_s", "time/step")
    parts = [f"{k}={metrics[k]:.4g}" for k in keys if k in metrics]
    return f"step {step}: " + " ".join(parts)


def save_gif(path: str, frames: list[np.ndarray], duration_ms: int = 400) -> None:
    from PIL import Image

    os.makedirs(os.path.dirname(path), exist_ok=True)
    images = [Image.fromarray(np.asarray(f, np.uint8)) for f in frames]
    tmp = path + ".tmp.gif"
    images[0].save(tmp, save_all=True, append_images=images[1:], duration=duration_ms, loop=0)
    os.replace(tmp, path)
