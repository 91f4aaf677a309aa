"""The OpenAI-compatible HTTP server (`orinfer serve`): `app.build_app(llm, name)` on FastAPI + uvicorn.

Nothing is imported here, so `import orinfer` never needs FastAPI; install the `serve` extra to use the server.
"""
