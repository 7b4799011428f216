"""The OpenAI-compatible HTTP server (FastAPI/uvicorn) over an engine thread.

``api_server`` holds the routes, ``async_engine`` the engine-owner thread, ``protocol`` the
request models, ``serving_*`` the endpoint logic, ``openai_format`` the response formats,
``errors`` the OpenAI error bodies and ``metrics`` the Prometheus metrics.
"""
