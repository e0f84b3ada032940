"""Train state, steps, loop, samples and run outputs."""

from jmegatron.train.config import (AdamWConfig, DataConfig, MuonConfig, PipelineConfig,
                                    ScheduleConfig, TrainConfig)
from jmegatron.train.loop import Trainer, train
from jmegatron.train.planning import Plan, fit_mesh, plan_run
from jmegatron.train.metrics import read_metrics
from jmegatron.train.plots import plot_runs
from jmegatron.train.state import TrainState, create_train_state
from jmegatron.train.step import make_eval_step, make_loss_fn, make_train_step

__all__ = ["AdamWConfig", "DataConfig", "MuonConfig", "PipelineConfig", "ScheduleConfig", "TrainConfig", "Plan", "plan_run", "Trainer", "train", "fit_mesh",
           "read_metrics", "plot_runs", "TrainState", "create_train_state",
           "make_loss_fn", "make_train_step", "make_eval_step"]
