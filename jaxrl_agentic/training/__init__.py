"""Training the models: the optimizer update every trained model shares (``update``, with
its gradient accumulation and per-token passes), the policy learner and the GAE critic."""

from jaxrl_agentic.training.critic import Critic, CriticConfig
from jaxrl_agentic.training.learner import Learner, TrainState, init_train_state
from jaxrl_agentic.training.learner_config import LearnerConfig
from jaxrl_agentic.training.update import UpdateConfig, UpdateEngine, UpdateLoss

__all__ = [
    "Critic",
    "CriticConfig",
    "Learner",
    "LearnerConfig",
    "TrainState",
    "UpdateConfig",
    "UpdateEngine",
    "UpdateLoss",
    "init_train_state",
]
