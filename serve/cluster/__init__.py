"""vit-predict beyond one machine: the same job on a Ray cluster, with Ray Data (`ray_job`, `cli`), its --out
folder written beside itself and renamed into place when whole (`output`).

Imports `serve.runtime` and Ray; nothing of ours imports it but the `vit-predict` entry point (`cli`), so a
core install (`pip install vitscope`, no Ray) runs vit-predict as before.
"""
