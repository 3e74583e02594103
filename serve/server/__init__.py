"""`vit-serve`: the runtime behind HTTP. `app.build_app(classifier, settings)` is the factory; the `/v1` and
KServe v2 routes, error mapping, micro-batcher, metrics and settings each have a module; the Gradio UI lives
in `ui` alone, and is imported only when the UI is served.
"""
