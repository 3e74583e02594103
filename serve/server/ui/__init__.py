"""The Gradio UI (blocks) and the HTTP glue that keeps its routes' errors JSON (http). Only here is gradio imported."""
