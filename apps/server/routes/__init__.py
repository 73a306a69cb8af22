"""The server's routes, one group per module; :data:`ROUTERS` is what the app includes."""

from __future__ import annotations

from pitstop.server.routes import chat, completions, health, lora, models, tokenize

ROUTES = (
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /v1/models/{id}",
    "POST /v1/load_lora_adapter",
    "POST /v1/unload_lora_adapter",
    "POST /tokenize",
    "POST /detokenize",
    "GET /health",
    "GET /metrics",
)

# In the order of ROUTES.
ROUTERS = (
    completions.router,
    chat.router,
    models.router,
    lora.router,
    tokenize.router,
    health.router,
)
