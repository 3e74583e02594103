"""`vit-serve`: the runtime behind HTTP. `app.build_app(classifier, settings)` is the factory; beside it the CLI,
settings, the micro-batcher (batching), metrics and the explanations shared by API and UI (explain). Below:

- `http/`: connection limits under the app, the request guard, uploads and the one error writer;
- `api/`: the /v1 and KServe v2 routes, tensor codecs and the OpenAPI document;
- `ui/`: the Gradio UI, imported only when the UI is served;
- `ray/`: the Ray Serve deployment and the launcher behind `vit-serve --ray`.
"""
