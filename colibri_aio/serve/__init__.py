"""Serving: an OpenAI-compatible HTTP server and a terminal chat on one engine.

``session`` turns prompts into requests for a SyncEngine (the engine on its
own thread), which reuses the KV cache across them; the bounded line in front
of the engine's sequence slots is :mod:`colibri_aio.engine.line`; ``requests`` / ``responses`` / ``errors`` are the
OpenAI shapes; ``app`` the routes; ``metrics`` the Prometheus text;
``server`` the ``serve`` command; ``chat`` the ``chat`` command.
"""
