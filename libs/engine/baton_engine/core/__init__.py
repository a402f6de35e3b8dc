"""The engine core: scheduler, its output types and the step loop."""
