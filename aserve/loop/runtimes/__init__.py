"""Model runtimes, one served model version each (layer: loop).

``base`` is the one contract the registry, the reloader and the frontends see;
``factory`` picks the class by engine. All of it runs on the event loop except
``handler_threads``, which runs on a handler model's own threads.
"""
