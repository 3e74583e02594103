"""The model repository: the layout on disk, the loaded versions, and their rollout without downtime."""
