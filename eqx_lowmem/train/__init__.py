"""Training: the accumulating step, the Trainer, checkpoints."""

from ._losses import (
    cross_entropy as cross_entropy,
    mse as mse,
    next_token_loss as next_token_loss,
)
from ._step import Step as Step, TrainState as TrainState, make_step as make_step
