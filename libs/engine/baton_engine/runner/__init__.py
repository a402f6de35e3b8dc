"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens."""
