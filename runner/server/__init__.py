"""The OpenAI-compatible HTTP server (`graphrunner serve`): FastAPI app, request models, metrics."""
