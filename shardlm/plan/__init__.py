"""The planner: memory and time models, layout search, schedule simulation."""
