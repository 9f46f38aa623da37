"""Training: the accumulating step, the Trainer, checkpoints."""

from .._deprecated import moved as _moved
from ._checkpoint import (
    CheckpointError as CheckpointError,
    load_checkpoint as load_checkpoint,
    read_meta as read_meta,
    save_checkpoint as save_checkpoint,
)
from ._chunked import chunked_cross_entropy as chunked_cross_entropy
from ._config import StepConfig as StepConfig
from ._hooks import Hook as Hook, StepInfo as StepInfo
from ._lock import DirectoryLockedError as DirectoryLockedError
from ._losses import (
    cross_entropy as cross_entropy,
    mse as mse,
    next_token_loss as next_token_loss,
)
from ._make_step import make_step as make_step
from ._model_io import load_model as load_model, save_model as save_model
from ._orbax import OrbaxCheckpoints as OrbaxCheckpoints
from ._state import TrainState as TrainState
from ._step import Step as Step
from ._trainer import Trainer as Trainer
from ._update import UpdateInfo as UpdateInfo

__getattr__ = _moved(
    __name__,
    {
        "CHECKPOINT_NAME": "_checkpoint",
        "LossOutput": "_loss",
        "MeanGradient": "_update",
        "SHARDS": "_make_step",
        "Sums": "_accumulate",
        "accumulate": "_accumulate",
        "call_loss": "_loss",
        "clean_stale_temporaries": "_checkpoint",
        "lock_directory": "_lock",
        "loss_grad": "_accumulate",
        "mean_loss": "_loss",
    },
)
