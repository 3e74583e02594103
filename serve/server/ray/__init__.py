"""Ray Serve: the deployment that wraps the same app, and the launcher behind `vit-serve --ray`."""
