"""FrozenLake by on-policy distillation alone: a fresh tiny student learns from the tiny
model that `configs/frozen_lake.py` trained, which judges every move the student makes.

    python -m jaxrl_agentic.train --config configs/frozen_lake.py
    python -m jaxrl_agentic.train --config configs/tiny_distill_frozen_lake.py

The first run writes the teacher to `outputs/frozen_lake` (its latest checkpoint is the
teacher; `--config.teacher.pretrain=<run dir>` names another). The student has the
default recipe's layout and warm-up (it generates only the action token, so each reply
is one judged token) and trains on the per-token reverse KL alone, centred on the batch's
mean; the episodes' rewards are still played and logged. What it measured:
docs/algorithms.md, "On-policy distillation".
"""

import os

from jaxrl_agentic.config import recipe_config


def get_config():
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "frozen_lake.py"))
    c.exp_name = "tiny_distill_frozen_lake"
    c.teacher.pretrain = "outputs/frozen_lake"
    c.distill_mode = "only"
    c.distill_coef = 1.0
    # Against the batch's mean reverse KL: uncentred, this student's entropy rose from 1.35
    # to 3.6 within 19 steps (every sampled move pushed down while the teacher is less sure
    # of them than the student); docs/algorithms.md, "On-policy distillation".
    c.distill_center = True
    # The teacher is the anchor: no KL towards the warmed student's own start.
    c.init_kl_coef = 0.0
    c.max_steps = 30
    c.eval_before_training = True
    return c
