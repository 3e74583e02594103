"""Everything after training, one package per job (arrows point one way: server -> runtime <- export).

serve/export/   checkpoint -> one self-describing ONNX file (needs torch; `vit-export`)
serve/runtime/  the file -> predictions and explanations with onnxruntime, numpy and Pillow only (`vit-predict`)
serve/server/   the runtime behind HTTP: JSON API, KServe v2, metrics and the Gradio UI (`vit-serve`)
"""
