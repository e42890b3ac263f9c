"""``python -m colibri_aio``: the commands, their telemetry and diagnostics."""
