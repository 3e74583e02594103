"""Ray Serve: the deployments that wrap the same app (for one file, or per model of a repository), the
rollout of a repository's new versions, and the launcher behind `vit-serve --ray`."""
