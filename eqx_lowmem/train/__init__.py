"""Training: the accumulating step, the Trainer, checkpoints."""

from ._accumulate import Sums as Sums, accumulate as accumulate, loss_grad as loss_grad
from ._checkpoint import (
    CHECKPOINT_NAME as CHECKPOINT_NAME,
    CheckpointError as CheckpointError,
    clean_stale_temporaries as clean_stale_temporaries,
    load_checkpoint as load_checkpoint,
    read_meta as read_meta,
    save_checkpoint as save_checkpoint,
)
from ._chunked import chunked_cross_entropy as chunked_cross_entropy
from ._config import StepConfig as StepConfig
from ._hooks import Hook as Hook, StepInfo as StepInfo
from ._lock import DirectoryLockedError as DirectoryLockedError, lock_directory as lock_directory
from ._loss import LossOutput as LossOutput, call_loss as call_loss, mean_loss as mean_loss
from ._losses import (
    cross_entropy as cross_entropy,
    mse as mse,
    next_token_loss as next_token_loss,
)
from ._make_step import SHARDS as SHARDS, make_step as make_step
from ._model_io import load_model as load_model, save_model as save_model
from ._orbax import OrbaxCheckpoints as OrbaxCheckpoints
from ._state import TrainState as TrainState
from ._step import Step as Step
from ._trainer import Trainer as Trainer
from ._update import MeanGradient as MeanGradient, UpdateInfo as UpdateInfo
