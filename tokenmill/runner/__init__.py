"""Execution: turns a SchedulerOutput into tensors, runs the model and the sampler."""
