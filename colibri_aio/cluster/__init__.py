"""Serving beyond one machine: replicas of the engine on Ray Serve, one endpoint in front.

``affinity`` decides which replica serves a request (a chat's next turn goes
to the replica whose KV cache holds its conversation; otherwise the least
loaded; none when every line is full); ``tunnel`` carries one HTTP exchange
between the gateway and a replica, which runs ``colibri_aio.serve``'s own
application; ``gateway`` is the HTTP front (admission, relaying, ``/health``
and ``/metrics`` of every replica). Those three import no Ray. ``router``,
``deployments`` and ``launch`` are the Ray Serve side: the request router
that sends a request to the replica the gateway chose, the two deployments,
and ``serve --ray``. ``colibri_aio.ray_app:app`` is the application for
``serve run``.
"""
