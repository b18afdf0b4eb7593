"""The checkpoint, the artifact a run leaves: writing, finding and loading a step (checkpoints), what makes one
complete (manifest), the best one (best), room on disk before one (room), and copies off the box (sync)."""
