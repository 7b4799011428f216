"""Continuous-batching scheduler: decides, each step, which requests run and how many tokens each computes."""
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler

__all__ = ["ModelRunnerOutput", "Scheduler", "SchedulerOutput"]
