"""Training: the accumulating step, the Trainer, checkpoints."""

from ._checkpoint import (
    load_checkpoint as load_checkpoint,
    read_meta as read_meta,
    save_checkpoint as save_checkpoint,
)
from ._losses import (
    cross_entropy as cross_entropy,
    mse as mse,
    next_token_loss as next_token_loss,
)
from ._step import Step as Step, TrainState as TrainState, make_step as make_step
from ._trainer import Trainer as Trainer
