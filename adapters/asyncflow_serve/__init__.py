"""``asyncflow_serve``: an OpenAI-compatible chat-completions endpoint over the rollout engines
that records exact tokens, and ``EndpointLoop``, the ``AgentLoop`` that trains agent programs
written for the ``openai`` client (or LangChain, LangGraph, ...) unchanged under ``RLJob``.
See ``asyncflow_serve.endpoint``. Needs aiohttp (``pip install 'asyncflow[serve]'``)."""

from asyncflow_serve.endpoint import (
    DEFAULT_MAX_BODY_BYTES,
    AgentProgram,
    ChatEndpoint,
    EndpointLoop,
    Session,
    SessionRecord,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "AgentProgram",
    "ChatEndpoint",
    "EndpointLoop",
    "Session",
    "SessionRecord",
]
