"""The worker process's parts: supervisor, producer, executor, claim-mode runners, capacity,
completer, heartbeat, listener, maintenance and event loop (see ``.worker``)."""
