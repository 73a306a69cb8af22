"""``pitstop.server``: an OpenAI-compatible HTTP server over :class:`pitstop.entrypoints.async_engine.AsyncLLM`.

Run it with ``pitstop serve MODEL``; build the app in code with
:func:`pitstop.server.app.create_app`. Needs the ``serve`` extra
(FastAPI, uvicorn, prometheus_client); ``pitstop`` itself does not.
"""
