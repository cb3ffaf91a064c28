"""PolicyLens engine: objectives, tasks, policy, rollouts, the training loop and the run log."""
