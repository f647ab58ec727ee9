"""OpenAI's Responses API (`/v1/responses`), run as chat completions underneath; see docs/responses.md."""

from oxserve.server.responses.routes import add_responses_routes

__all__ = ["add_responses_routes"]
