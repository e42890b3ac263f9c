"""``python -m colibri_aio``: one module per command (:mod:`colibri_aio.cli.main` assembles them), the options
they share, their telemetry and diagnostics."""
